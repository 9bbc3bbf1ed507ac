"""Which units compute on this pipeline rank, and what stands in for the others while the user's step runs.

Every pipeline rank runs the user's own step for each of its stages and microbatches. What differs per stage is
which modules really compute:

* the units (blocks, embedding, head, ... see :mod:`lightning_hybrid.pipeline.split`) of the running stage compute;
* units of other stages are *stood in for*: zeros shaped like the unit's output, derived from the shapes of the
  inputs by how its outputs followed its inputs in the calls seen (:mod:`lightning_hybrid.probe.shapes`: a
  block's output keeps its hidden-state input's batch and sequence lengths), else like the output of a meta-device
  copy, which also teaches the relation — no parameters, no FLOPs — so the user's code around them (rotary tables, masks, position ids computed from the
  embedding's output) still runs and hands the blocks their extra arguments. Attributes read from a stand-in
  (``head.weight.dtype``, ``embeddings.config``) come from that copy, tensors as zero-memory tensors of the right
  shape and dtype on this device;
* the stage's first block takes the activation received from the previous stage in place of the stand-in
  output it was given, and its last block ends the stage by raising :class:`StageOutput` (a ``BaseException``,
  so user code catching ``Exception`` cannot swallow it) with its output, which the stage module returns to
  ``PipelineStage`` to send on.

Example::

    dispatcher = UnitDispatcher(split, make_shadows(lightning_module, split), trace.outputs, device, None)
    dispatcher.boundary_shapes(lambda: lightning_module.training_step(microbatch, 0))  # {0: [(2, 10, 32)]}
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
from lightning_hybrid.probe.shapes import TensorSpec, UnitShapes, describe_call, output_spec


def tensor_leaves(value: Any) -> list[Tensor]:
    """The tensors in ``value``, in ``tree_flatten`` order. A block's output is most often one tensor, and flattening
    it costs more than the stand-in itself (tens of microseconds per call, several calls per microbatch)."""
    if isinstance(value, Tensor):
        return [value]
    return [t for t in tree_flatten(value)[0] if isinstance(t, Tensor)]


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
    #: Set for a shape pass (:meth:`UnitDispatcher.boundary_shapes`): the last block of each stage → that stage,
    #: and where the shapes of what the stages send are collected.
    boundaries: Optional[tuple[dict[int, int], dict[int, list[tuple[int, ...]]]]] = None


class RemoteUnit(nn.Module):
    """Takes the place of a unit that lives on another pipeline rank: holds no parameters, returns stand-ins."""

    def __init__(self, dispatcher: "UnitDispatcher", index: int) -> None:
        super().__init__()
        self._dispatcher_ref = (dispatcher, index)  # a tuple: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher, index = self._dispatcher_ref
        return dispatcher.call(index, None, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_dispatcher_ref" not in self.__dict__:
                raise
            dispatcher, index = self.__dict__["_dispatcher_ref"]
            return dispatcher.remote_value(getattr(dispatcher.shadow(index), name), f"{dispatcher.name(index)}.{name}")

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


class RemoteView:
    """A submodule of another rank's unit as attribute reads see it (see :meth:`UnitDispatcher.remote_value`); it
    cannot be called: only whole units stand in."""

    def __init__(self, dispatcher: "UnitDispatcher", module: nn.Module, name: str) -> None:
        self.__dict__.update(_dispatcher=dispatcher, _module=module, _name=name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._dispatcher.remote_value(getattr(self._module, name), f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"'{self._name}' is part of a unit that computes on another pipeline rank; the step called it directly,"
            " and only whole units can stand in there. Call the unit itself, or move the call into it."
        )


class UnitDispatcher:
    """Decides, for each unit called during a stage's step, whether it computes, stands in, or ends the stage."""

    def __init__(self, split: StageSplit, shadows: list[nn.Module], shapes: UnitShapes,
                 device: torch.device, compute_dtype: Optional[torch.dtype]) -> None:
        self.split = split
        self._shadows = shadows
        self._shapes = shapes
        self._device = device
        self._compute_dtype = compute_dtype
        self.active: Optional[ActiveStage] = None
        self._previous_block_output: list[Tensor] = []
        self._ghosts: dict[int, Tensor] = {}

    def name(self, index: int) -> str:
        return self.split.units[index].name

    def shadow(self, index: int) -> nn.Module:
        return self._shadows[index]

    def remote_value(self, value: Any, name: str) -> Any:
        """What reading ``value`` off another rank's unit gives here: a tensor as a zero-memory tensor of its shape
        and dtype on this device, a submodule as a :class:`RemoteView`, anything else as it is."""
        if isinstance(value, Tensor):
            if id(value) not in self._ghosts:
                self._ghosts[id(value)] = torch.zeros((), dtype=value.dtype, device=self._device).expand(value.shape)
            return self._ghosts[id(value)]
        if isinstance(value, nn.Module):
            return RemoteView(self, value, name)
        return value

    def end_stage(self) -> None:
        # Drop the last block's output too: kept, it would hold a microbatch's activation until the next stage runs
        # (measured: one extra residual-stream tensor at the activation peak of a checkpointed last stage).
        self.active = None
        self._previous_block_output = []

    def call(
        self, index: int, compute: Optional[Callable[..., Any]], args: tuple, kwargs: dict
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
        if active.index in unit.computes_on:
            if block == active.blocks.start and not active.is_first:
                args, kwargs = self._take_received(block, args, kwargs)
            output = compute(*args, **kwargs)  # type: ignore[misc]
        elif block is not None and block > active.blocks.stop - 1:
            raise RuntimeError(
                f"Block {block} ran after block {active.blocks.stop - 1}, where stage {active.index} ends: with pp > 1"
                " the step must run its blocks in order, each once."
            )
        else:
            output = self._stand_in(index, args, kwargs)
        if block is not None:
            self._previous_block_output = tensor_leaves(output)
            if active.boundaries is not None and block in active.boundaries[0]:
                stage = active.boundaries[0][block]
                active.boundaries[1][stage] = [tuple(t.shape) for t in self._previous_block_output]
            if block == active.blocks.stop - 1 and not active.is_last:
                raise StageOutput(output)
        return output

    def boundary_shapes(self, run_step: Callable[[], Any]) -> dict[int, list[tuple[int, ...]]]:
        """Stage → shapes of the tensors it sends on, for the microbatch ``run_step`` runs the user's step on: a
        shape pass, where every unit stands in (no FLOPs) and the step ends after the last stage boundary."""
        ends = {self.split.block_range(stage).stop - 1: stage for stage in range(self.split.num_stages - 1)}
        shapes: dict[int, list[tuple[int, ...]]] = {}
        self.active = ActiveStage(-1, range(0, max(ends) + 1), True, False, (), boundaries=(ends, shapes))
        try:
            run_step()
        except StageOutput:
            pass  # the last boundary: nothing after it is needed
        finally:
            self.end_stage()
        return shapes

    def _stand_in(self, index: int, args: tuple, kwargs: dict) -> Any:
        """Zeros shaped like the unit's output: derived from the input shapes by the unit's shape relation, else
        computed on its meta-device copy (no parameters, no FLOPs), whose answer narrows the relation. Nothing is
        kept per shape: running the copy costs Python time per operation (0.2 s per microbatch for two GPT blocks
        on a CPU, measured), and the relation makes it rare (bounded per unit, whatever the number of shapes)."""
        call = describe_call(args, kwargs)
        output = self._shapes.predict(self.name(index), call)
        if output is None:
            output = output_spec(self._meta_output(index, args, kwargs))
            self._shapes.observe(self.name(index), call, output)
        if isinstance(output, TensorSpec):  # one tensor, as most units return: no tree to map over
            return self._zeros(output)
        return tree_map(lambda v: self._zeros(v) if isinstance(v, TensorSpec) else v, output)

    def _zeros(self, spec: TensorSpec) -> Tensor:
        # Floating outputs in the compute dtype, as FSDP2's mixed-precision policy makes a real unit's.
        dtype = self._compute_dtype if self._compute_dtype is not None and spec.dtype.is_floating_point else spec.dtype
        return torch.zeros(spec.shape, dtype=dtype, device=self._device)

    def _meta_output(self, index: int, args: tuple, kwargs: dict) -> Any:
        def to_meta(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            cast = self._compute_dtype if self._compute_dtype is not None and value.is_floating_point() else None
            return value.detach().to("meta", dtype=cast)

        try:
            with torch.no_grad():
                return self._shadows[index](*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception as error:
            shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            unit = self.split.units[index]
            raise RuntimeError(
                f"'{unit.name}' computes on pipeline stage {unit.stage}; this rank stands in for it and needs the"
                f" shape of its output for inputs of shapes {shapes}, which the calls it saw do not derive (a call"
                f" of another structure, or a size no input size gives), and its meta-device copy could not compute"
                f" it ({type(error).__name__}: {error}). Give the unit the argument structure of the first batch's"
                " call, or use pp=1."
            ) from error

    def _take_received(self, block: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put the received activation where the stand-in output of the previous block was passed in."""
        received = self.active.received  # type: ignore[union-attr]
        previous = self._previous_block_output
        if len(previous) != len(received):
            raise RuntimeError(
                f"Block {block - 1} gave {len(previous)} tensors but its stage sent {len(received)}."
            )
        replacement = {id(stand_in): real for stand_in, real in zip(previous, received)}
        if not kwargs and all(isinstance(v, Tensor) for v in args):  # block(x, ...): the args are the leaves
            leaves, spec = list(args), None
        else:
            leaves, spec = tree_flatten((args, kwargs))
        swapped = [replacement.get(id(v), v) if isinstance(v, Tensor) else v for v in leaves]
        if all(a is b for a, b in zip(swapped, leaves)):
            raise RuntimeError(
                f"Pipeline stages are cut between blocks {block - 1} and {block}, but block {block} is not called"
                f" with block {block - 1}'s output (the step changes it between the blocks). Cut elsewhere with"
                " HybridStrategy(pp_split=[...]), or make the code between blocks part of a block."
            )
        return (tuple(swapped), kwargs) if spec is None else tree_unflatten(swapped, spec)


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
