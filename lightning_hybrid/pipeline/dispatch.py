"""Which units compute on this pipeline rank, and what stands in for the others while the user's step runs.

Every pipeline rank runs the user's own step for each of its stages and microbatches. What differs per stage is
which modules really compute:

* the units (blocks, embedding, head, ... see :mod:`lightning_hybrid.pipeline.split`) of the running stage compute;
* units of other stages are *stood in for*: a meta-device copy computes only the output's shape, and zeros of
  that shape are returned — no parameters, no FLOPs — so the user's code around them (rotary tables, masks,
  position ids computed from the embedding's output) still runs and hands the blocks their extra arguments;
* the stage's first block takes the activation received from the previous stage in place of the stand-in
  output it was given, and its last block ends the stage by raising :class:`StageOutput` (a ``BaseException``,
  so user code catching ``Exception`` cannot swallow it) with its output, which the stage module returns to
  ``PipelineStage`` to send on.

Example::

    dispatcher = UnitDispatcher(split, make_shadows(lightning_module, split), device, compute_dtype=None)
    parent.head = RemoteUnit(dispatcher, index)            # a unit of another rank
    module.__class__ = staged_class(type(module))          # a unit of this rank consults the dispatcher
    dispatcher.active = ActiveStage(0, range(0, 2), is_first=True, is_last=False, received=())
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._compat import tree_flatten, tree_map, tree_unflatten
from lightning_hybrid.pipeline.split import StageSplit


class StageOutput(BaseException):
    """Raised after a stage's last block to end the user's step there; carries the block's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclass
class ActiveStage:
    """The stage whose units compute right now: its blocks, its ends, and the activation it received."""

    index: int
    blocks: range
    is_first: bool
    is_last: bool
    received: tuple[Tensor, ...]


class RemoteUnit(nn.Module):
    """Takes the place of a unit that lives on another pipeline rank: holds no parameters, returns stand-ins."""

    def __init__(self, dispatcher: "UnitDispatcher", index: int) -> None:
        super().__init__()
        self._dispatcher_ref = (dispatcher, index)  # a tuple: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher, index = self._dispatcher_ref
        return dispatcher.call(index, None, args, kwargs, training=self.training)

    def extra_repr(self) -> str:
        dispatcher, index = self._dispatcher_ref
        unit = dispatcher.split.units[index]
        return f"{unit.name} on pipeline stage {unit.stage}"


_STAGED_CLASSES: dict[type, type] = {}


def staged_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` asks the dispatcher whether to compute or stand in."""
    if cls not in _STAGED_CLASSES:

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            dispatcher, index = self._pipeline_unit
            return dispatcher.call(index, lambda *a, **k: nn.Module.__call__(self, *a, **k), args, kwargs)

        _STAGED_CLASSES[cls] = type(f"Staged{cls.__name__}", (cls,), {"__call__": __call__})
    return _STAGED_CLASSES[cls]


class UnitDispatcher:
    """Decides, for each unit called during a stage's step, whether it computes, stands in, or ends the stage."""

    def __init__(
        self, split: StageSplit, shadows: list[nn.Module], device: torch.device, compute_dtype: Optional[torch.dtype]
    ) -> None:
        self.split = split
        self._shadows = shadows
        self._device = device
        self._compute_dtype = compute_dtype
        self.active: Optional[ActiveStage] = None
        self._previous_block_output: list[Tensor] = []
        self._stand_in_outputs: dict[tuple, Any] = {}

    def end_stage(self) -> None:
        # Drop the last block's output too: kept, it would hold a microbatch's activation until the next stage runs
        # (measured: one extra residual-stream tensor at the activation peak of a checkpointed last stage).
        self.active = None
        self._previous_block_output = []

    def call(
        self, index: int, compute: Optional[Callable[..., Any]], args: tuple, kwargs: dict, training: bool = True
    ) -> Any:
        unit = self.split.units[index]
        active = self.active
        if active is None:
            if compute is None:
                raise RuntimeError(
                    f"'{unit.name}' lives on pipeline stage {unit.stage}, another rank: with pp > 1 the model runs"
                    " only inside the training/validation/test/predict steps that the strategy pipelines."
                )
            return compute(*args, **kwargs)
        block = unit.block_index
        if unit.stage == active.index:
            if block == active.blocks.start and not active.is_first:
                args, kwargs = self._take_received(block, args, kwargs)
            output = compute(*args, **kwargs)  # type: ignore[misc]
        elif block is not None and block > active.blocks.stop - 1:
            raise RuntimeError(
                f"Block {block} ran after block {active.blocks.stop - 1}, where stage {active.index} ends: with pp > 1"
                " the step must run its blocks in order, each once."
            )
        else:
            output = self._stand_in(index, args, kwargs, training)
        if block is not None:
            self._previous_block_output = [t for t in tree_flatten(output)[0] if isinstance(t, Tensor)]
            if block == active.blocks.stop - 1 and not active.is_last:
                raise StageOutput(output)
        return output

    def _stand_in(self, index: int, args: tuple, kwargs: dict, training: bool) -> Any:
        """Zeros shaped like the unit's output, computed on a meta-device copy (no parameters, no FLOPs).

        The meta output is cached per unit, mode and input signature (shapes, dtypes and plain values): running the
        meta copy costs Python time per operation (measured: 0.2 s per microbatch for two GPT blocks on a CPU), and
        every microbatch of a step has the same shapes.
        """
        key = _signature((index, training, args, kwargs))
        output = self._stand_in_outputs.get(key) if key is not None else None
        if output is None:
            output = self._meta_output(index, args, kwargs)
            if key is not None:
                self._stand_in_outputs[key] = output
        return tree_map(
            lambda v: torch.zeros(v.shape, dtype=v.dtype, device=self._device) if isinstance(v, Tensor) else v, output
        )

    def _meta_output(self, index: int, args: tuple, kwargs: dict) -> Any:
        def to_meta(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            # Floating inputs in the compute dtype, as FSDP2's mixed-precision policy casts a real unit's inputs.
            cast = self._compute_dtype if self._compute_dtype is not None and value.is_floating_point() else None
            return value.detach().to("meta", dtype=cast)

        with torch.no_grad():
            return self._shadows[index](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))

    def _take_received(self, block: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put the received activation where the stand-in output of the previous block was passed in."""
        received = self.active.received  # type: ignore[union-attr]
        previous = self._previous_block_output
        if len(previous) != len(received):
            raise RuntimeError(
                f"Block {block - 1} gave {len(previous)} tensors but its stage sent {len(received)}."
            )
        replacement = {id(stand_in): real for stand_in, real in zip(previous, received)}
        leaves, spec = tree_flatten((args, kwargs))
        swapped = [replacement.get(id(v), v) if isinstance(v, Tensor) else v for v in leaves]
        if all(a is b for a, b in zip(swapped, leaves)):
            raise RuntimeError(
                f"Pipeline stages are cut between blocks {block - 1} and {block}, but block {block} is not called"
                f" with block {block - 1}'s output (the step changes it between the blocks). Cut elsewhere with"
                " HybridStrategy(pp_split=[...]), or make the code between blocks part of a block."
            )
        return tree_unflatten(swapped, spec)


def make_shadows(root: nn.Module, split: StageSplit, dtype: Optional[torch.dtype] = None) -> list[nn.Module]:
    """A meta-device copy of every unit (taken before tensor parallelism changes the real ones).

    ``dtype`` (the compute dtype of mixed precision) makes stand-in outputs carry the dtype real ones would have.
    """
    shadows = []
    for unit in split.units:
        module = root.get_submodule(unit.name)
        memo: dict[int, Any] = {}
        for tensor in list(module.parameters()) + list(module.buffers()):
            meta_dtype = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            meta = torch.empty_like(tensor, device="meta", dtype=meta_dtype)
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
        shadows.append(copy.deepcopy(module, memo))
    return shadows


_PLAIN_VALUES = (int, float, bool, str, type(None))


def _signature(value: Any) -> Optional[tuple]:
    """A hashable description of a call's inputs as far as output shapes can depend on them: tensor shapes and
    dtypes, plain values, the nesting. ``None`` if an input is of another kind (its effect cannot be told)."""
    leaves, spec = tree_flatten(value)
    described = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            described.append((tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, _PLAIN_VALUES):
            described.append((type(leaf), leaf))
        else:
            return None
    return (str(spec), tuple(described))
