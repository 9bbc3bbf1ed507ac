"""Context parallelism over a model's blocks: planned per block structure (:mod:`.plan`), installed on this rank's
blocks, and what stayed whole reported.

An installed block splits its arguments on entry (:func:`~.exchange.split_sequence`), runs its class's forward
with its attention exchanged (:mod:`.attention`; the class swapped for a subclass that routes it, so activation
checkpointing, applied later as a subclass of that one, saves the parts and routes its recompute too), and gathers
its outputs on exit (:func:`~.exchange.gather_sequence`). Between blocks and around them the model computes on the whole sequence, so
stage boundaries, stand-ins, the head and the loss see what they see without context parallelism. A meta-device
call (a pipeline's shape pass) runs the block whole: the shapes are the same; so does every call while the group
is disabled (``group.enabled = False``: the setup check's whole run), and, with a warning, a call that cannot be
split as planned (a sequence length the ranks cannot share equally, other arguments than at setup): every rank of
the group has the same call, so all run it whole, and the numbers stay right.

Example::

    applied = plan_context_parallel(blocks, probe.record().block_calls, parts=2)   # before any other step
    install_context_parallel(applied, blocks, owned=[0, 1, 2, 3], group=group)    # after tp / ep
    applied.describe()   # ["model.layers.0 (4 blocks): split, checked at 16 positions, 4 heads", ...]
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Sequence, Union

from torch import Tensor, nn

from lightning_hybrid._compat import tree_flatten, tree_unflatten
from lightning_hybrid.context_parallel.attention import ExchangedAttention, routed_attention
from lightning_hybrid.context_parallel.exchange import ContextGroup, gather_sequence, running_whole, split_sequence
from lightning_hybrid.context_parallel.plan import BlockPlan, plan_block
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.record import BlockCall


@dataclass
class AppliedContext:
    """Each block structure's plan (first block index → :class:`~.plan.BlockPlan`, or why it stays whole), the
    structures' blocks, and once installed the blocks this rank split."""

    plans: dict[int, Union[BlockPlan, str]]
    structures: dict[int, list[int]]
    names: dict[int, str]
    installed: list[int] = field(default_factory=list)

    def plan_of(self, index: int) -> Union[BlockPlan, str]:
        return next(self.plans[first] for first, members in self.structures.items() if index in members)

    def describe(self) -> list[str]:
        """One line per block structure: split (checked or from shapes only) or kept whole, and why."""
        lines = []
        for first, plan in self.plans.items():
            where = f"{self.names[first]} ({len(self.structures[first])} blocks)"
            if isinstance(plan, str):
                lines.append(f"{where}: kept whole on every cp rank: {plan}")
            else:
                how = "checked" if plan.checked else "planned from shapes (meta device), not checked"
                lines.append(f"{where}: split, {how} at {plan.length} positions, {plan.heads} heads")
        return lines


#: Why a block structure some of whose blocks :func:`~.escapes.find_escapes` found stays whole.
ESCAPES = ("the step reads a value made inside it other than through its outputs (a hook recording a module's"
           " output: Hugging Face's output_router_logits or output_attentions), which would hold this rank's"
           " positions only")


def plan_context_parallel(blocks: BlockList, block_calls: Mapping[int, BlockCall], parts: int,
                          escaping: Collection[int] = ()) -> AppliedContext:
    """Every block structure's plan, on the unmodified blocks and the probe's recorded calls; structures with a
    block in ``escaping`` stay whole."""
    structures = {indices[0]: list(indices) for indices in block_structures(blocks)}
    plans: dict[int, Union[BlockPlan, str]] = {}
    for first in structures:
        if set(structures[first]) & set(escaping):
            plans[first] = ESCAPES
        elif first not in block_calls:
            plans[first] = "the setup step never called it"
        else:
            plans[first] = plan_block(blocks[first], block_calls[first], parts)
    return AppliedContext(plans, structures, {first: blocks.name(first) for first in structures})


def install_context_parallel(applied: AppliedContext, blocks: BlockList, owned: Sequence[int],
                             group: ContextGroup) -> None:
    """Make each block of ``owned`` (this rank's) whose structure is split run on its part over ``group``."""
    for index in owned:
        plan = applied.plan_of(index)
        if isinstance(plan, BlockPlan):
            _install(blocks[index], blocks.name(index), plan, group)
            applied.installed.append(index)


def _install(block: nn.Module, name: str, plan: BlockPlan, group: ContextGroup) -> None:
    block._context_attention = ExchangedAttention(group)
    block.__class__ = _routed_class(type(block))

    def forward(*args: Any, **kwargs: Any) -> Any:
        leaves, spec = tree_flatten((args, kwargs))
        own_forward = type(block).forward  # the class's: a checkpointed one's recompute routes attention again
        if not group.enabled or any(isinstance(x, Tensor) and x.is_meta for x in leaves):
            return own_forward(block, *args, **kwargs)
        unsplittable = _unsplittable(leaves, plan, group.size)
        if unsplittable:  # every rank of the group has this call (same samples): all run it whole
            _warn_once(group, f"HybridStrategy(cp={group.size}): '{name}' ran whole on every cp rank: {unsplittable}."
                              " The numbers are right; the memory is not divided.")
            with running_whole(group):
                return own_forward(block, *args, **kwargs)
        local = [split_sequence(x, plan.split[i], group) if i in plan.split else x for i, x in enumerate(leaves)]
        local_args, local_kwargs = tree_unflatten(local, spec)
        output = own_forward(block, *local_args, **local_kwargs)
        out_leaves, out_spec = tree_flatten(output)
        return tree_unflatten([gather_sequence(x, plan.gather[i], group) if i in plan.gather else x
                               for i, x in enumerate(out_leaves)], out_spec)

    block.forward = forward  # an instance attribute: split and gather stay outside what later steps wrap


def _unsplittable(leaves: list, plan: BlockPlan, size: int) -> str:
    """Why this call cannot be split as planned ("" if it can)."""
    if len(leaves) != plan.leaves:
        return f"it was called with {len(leaves)} values, planned at setup for the {plan.leaves} of its first call"
    if any(not isinstance(leaves[i], Tensor) or leaves[i].dim() <= dim for i, dim in plan.split.items()):
        return "a value it was planned to split is not a tensor of that shape in this call"
    odd = {leaves[i].shape[dim] for i, dim in plan.split.items() if leaves[i].shape[dim] % size}
    if odd:
        return (f"a sequence of {min(odd)} positions does not split into {size} equal parts (pad sequences to a"
                f" multiple of {size})")
    return ""


def _warn_once(group: ContextGroup, message: str) -> None:
    if message not in group.warned:
        group.warned.add(message)
        warnings.warn(message, stacklevel=3)


_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    """``cls`` whose forward routes its attention calls to the exchange: the part activation checkpointing (step 3,
    a subclass of this one) recomputes, so the recompute in backward exchanges as the forward did."""
    if cls not in _ROUTED_CLASSES:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            if not self._context_attention.group.enabled:
                return cls.forward(self, *args, **kwargs)
            with routed_attention(self, self._context_attention):
                return cls.forward(self, *args, **kwargs)

        _ROUTED_CLASSES[cls] = type(f"ContextParallel{cls.__name__}", (cls,), {"forward": forward})
    return _ROUTED_CLASSES[cls]
