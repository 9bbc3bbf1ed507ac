"""Activation checkpointing per block: store a block's inputs in forward, recompute its insides in backward.

Modes (``HybridStrategy(activation_checkpointing=...)``, resolved into a
:class:`~lightning_hybrid.options.recompute.CheckpointPlan`):

================  ===========================================================================================
``None``          store every activation autograd saves (fastest, most memory)
``"every"``       checkpoint every block: only block inputs are stored, each block's forward runs again in backward
``N`` (int ≥ 1)   checkpoint the N-th, 2N-th, … block of the whole model (blocks ``N-1, 2N-1, …``, 0-based,
                  counted over all pipeline stages), trading memory for recompute in between
``"selective"``   every block, but per operation: outputs of matrix multiplications, attention kernels and
                  tensor-parallel collectives are kept, everything else (norms, activations, elementwise) is
                  recomputed, so backward repeats the cheap operations and no communication
================  ===========================================================================================

It is applied after tensor parallelism (the recomputed forward must run the sharded layers and their
collectives) and before FSDP2, so FSDP's all-gather hooks wrap the checkpointed forward and its parameters are
gathered again for the recompute by FSDP's own pre-backward hook, not inside the checkpoint.

Recomputing replays the same operations on the same inputs with the same random state (``torch.utils.checkpoint``
restores it), so losses and gradients are bit-identical to a run without checkpointing.

Example::

    plan = CheckpointPlan.resolve("selective")
    apply_activation_checkpointing(enumerate(model.blocks), plan)
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_hybrid._compat import existing_ops
from lightning_hybrid.options.recompute import CheckpointPlan
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.record import BlockCall, block_call

#: Operations whose outputs selective checkpointing keeps: the expensive ones to recompute (matmuls, attention)
#: and collectives, whose recompute would add communication to backward. Attention kernels and functional
#: collectives are private ops, and not every build has every attention kernel: missing ones are left out.
_KEPT_BY_SELECTIVE = existing_ops([
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.baddbmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "_c10d_functional.all_reduce.default",
    "_c10d_functional.reduce_scatter_tensor.default",
    "_c10d_functional.all_gather_into_tensor.default",
])


def apply_activation_checkpointing(indexed_blocks: Iterable[tuple[int, nn.Module]], plan: CheckpointPlan) -> int:
    """Checkpoint the blocks ``plan`` covers, in place; ``indexed_blocks`` pairs each block with its index in the
    whole model (a pipeline stage passes only its own). Returns how many blocks were checkpointed.

    The block keeps its identity, parameter names and hooks: only its class is swapped for a subclass whose
    ``forward`` runs under :func:`torch.utils.checkpoint.checkpoint`, so state dicts and FQNs are unchanged.
    """
    count = 0
    for index, block in indexed_blocks:
        if plan.covers(index):
            block.__class__ = _checkpointed_class(type(block), plan.selective)
            count += 1
    return count


_CHECKPOINTED_CLASSES: dict[tuple[type, bool], type] = {}


def _checkpointed_class(cls: type, selective: bool) -> type:
    key = (cls, selective)
    if key not in _CHECKPOINTED_CLASSES:
        # Only selective checkpointing passes a context_fn: torch.compile (2.13) cannot trace a checkpoint given
        # torch's own noop_context_fn explicitly, which is what leaving it out means.
        context = {"context_fn": _selective_contexts} if selective else {}

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # Non-reentrant: supports keyword arguments, tuple outputs and torch.autograd.grad with inputs=, which
            # zero-bubble pipeline schedules use to split input and weight gradients.
            return checkpoint(functools.partial(cls.forward, self), *args, use_reentrant=False, **context, **kwargs)

        prefix = "SelectiveCheckpointed" if selective else "Checkpointed"
        _CHECKPOINTED_CLASSES[key] = type(f"{prefix}{cls.__name__}", (cls,), {"forward": forward})
    return _CHECKPOINTED_CLASSES[key]


def refuse_updated_arguments(blocks: BlockList, block_calls: Mapping[int, BlockCall], indices: Sequence[int],
                             plan: CheckpointPlan) -> None:
    """Refuse, before training, to checkpoint a block whose forward updates an object it is handed (a key/value
    cache it appends to): the recomputed forward in backward would get it updated and compute something else (a
    Hugging Face decoder built with ``use_cache=True`` failed in its first backward with a shape error)."""
    for structure in block_structures(blocks):
        covered = [i for i in structure if i in indices and plan.covers(i)]
        if not covered or structure[0] not in block_calls:
            continue
        updated = _updated_arguments(blocks[covered[0]], block_call(block_calls, structure[0]))
        if updated:
            raise ValueError(
                f"HybridStrategy(activation_checkpointing=...): '{blocks.name(covered[0])}' updates the argument"
                f" {' and '.join(repr(name) for name in updated)} it is called with (a key/value cache), so its"
                " recomputed forward would not compute what its forward did. Train without the cache (Hugging Face:"
                " config.use_cache = False) or without activation_checkpointing.")


def _updated_arguments(block: nn.Module, call: BlockCall) -> list[str]:
    """The block's arguments that are objects (not tensors or plain containers of them) whose tensors one forward
    adds or reshapes."""
    args, kwargs = call
    named = {**{f"argument {i}": v for i, v in enumerate(args)}, **kwargs}
    held = {name: value for name, value in named.items() if _holds_tensors(value)}
    if not held or any(p.is_meta for p in block.parameters()):
        return []
    before = copy.deepcopy((args, kwargs))
    shapes = {name: _shapes(value) for name, value in held.items()}
    with torch.no_grad():
        block(*before[0], **before[1])
    after = {**{f"argument {i}": v for i, v in enumerate(before[0])}, **before[1]}
    return [name for name in held if _shapes(after[name]) != shapes[name]]


def _holds_tensors(value: Any) -> bool:
    """An object that may hold tensors in its attributes (a cache, empty before the first block fills it)."""
    return hasattr(value, "__dict__") and not isinstance(value, (torch.Tensor, nn.Module, type))


def _shapes(value: Any, depth: int = 3) -> tuple:
    """Shapes of the tensors an object holds in its attributes (and lists of objects), a few levels deep."""
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape),)
    if depth == 0:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(shape for item in value for shape in _shapes(item, depth - 1))
    if hasattr(value, "__dict__") and not isinstance(value, nn.Module):
        return tuple(shape for item in vars(value).values() for shape in _shapes(item, depth - 1))
    return ()


def _keep_expensive_outputs(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _KEPT_BY_SELECTIVE else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_keep_expensive_outputs)

