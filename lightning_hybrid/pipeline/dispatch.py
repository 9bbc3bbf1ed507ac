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
* a stage ends where the next stage's first block is called: that call's floating-point tensors — the residual
  stream, and every value the step computed earlier and hands to the block (an encoder's output for
  cross-attention, a timestep/class conditioning, rotary tables) — are raised with :class:`StageOutput` (a
  ``BaseException``, so user code catching ``Exception`` cannot swallow it), which the stage module returns to
  ``PipelineStage`` to send on. The next stage's first block takes them in place of what its own run computed
  from stand-ins, and every later call on that stage given one of those objects gets the received value: values
  skip stages through the pipeline's messages, and their gradients flow back to where they were computed.

Example::

    dispatcher = UnitDispatcher(split, make_shadows(lightning_module, split), trace.outputs, device, None)
    dispatcher.boundary_shapes(lambda: lightning_module.training_step(microbatch, 0))  # {0: [(2, 10, 32)]}
    parent.head = RemoteUnit(dispatcher, index)            # a unit of another rank
    module.__class__ = staged_class(type(module))          # a unit of this rank consults the dispatcher
    dispatcher.active = ActiveStage(0, range(0, 2), is_first=True, is_last=False, received=())
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._compat import tree_flatten, tree_map, tree_unflatten
from lightning_hybrid.pipeline.split import StageSplit
from lightning_hybrid.probe.meta_step import meta_step
from lightning_hybrid.probe.shapes import TensorSpec, UnitShapes, describe_call, output_spec


class StageOutput(BaseException):
    """Raised after a stage's last block to end the user's step there; carries the block's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclass
class ActiveStage:
    """The stage whose units compute right now: its blocks, its ends, and what it received."""

    index: int
    blocks: range
    is_first: bool
    is_last: bool
    received: tuple[Tensor, ...]
    #: Set for a shape pass (:meth:`UnitDispatcher.boundary_shapes`): the first block of each stage but the first
    #: → the stage before it, and where the shapes of what the stages send are collected.
    boundaries: Optional[tuple[dict[int, int], dict[int, list[tuple[int, ...]]]]] = None
    #: ``id`` of a value this stage computed for itself → (that value, the one the previous stage sent in its
    #: place): every later call on this stage given the same object gets the received one (a conditioning vector
    #: or an encoder's output handed to each block). The replaced value is kept so its ``id`` cannot be reused by a
    #: new tensor while the stage runs.
    substitutes: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)


class RemoteUnit(nn.Module):
    """Takes the place of a unit that lives on another pipeline rank: holds no parameters, returns stand-ins —
    except the modules of it that the step calls from outside it on this rank (:meth:`hold`), held here as real
    modules at their place (``part``: the path of such a module's parent inside the unit)."""

    def __init__(self, dispatcher: "UnitDispatcher", index: int, part: str = "") -> None:
        super().__init__()
        self._dispatcher_ref = (dispatcher, index, part)  # a tuple: not registered as a submodule

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        dispatcher, index, part = self._dispatcher_ref
        if part:
            return dispatcher.stand_in_for(self._shadow(), f"{dispatcher.name(index)}.{part}", args, kwargs)
        return dispatcher.call(index, None, args, kwargs)

    def hold(self, relative: str, module: nn.Module) -> None:
        """Place ``module``, the unit's module at ``relative``, here: the step calls it on this rank."""
        dispatcher, index, part = self._dispatcher_ref
        holder: nn.Module = self
        *parents, last = relative.split(".")
        # Registered in ``_modules`` directly: ``add_module`` refuses a name that attribute reads already answer
        # (from the unit's meta-device copy).
        for depth, name in enumerate(parents):
            if name not in holder._modules:
                holder._modules[name] = RemoteUnit(dispatcher, index, ".".join(filter(None, [part, *parents[:depth + 1]])))
            holder = holder._modules[name]  # type: ignore[assignment]
        holder._modules[last] = module

    def _shadow(self) -> nn.Module:
        dispatcher, index, part = self.__dict__["_dispatcher_ref"]
        shadow = dispatcher.shadow(index)
        return shadow.get_submodule(part) if part else shadow

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_dispatcher_ref" not in self.__dict__:
                raise
            dispatcher, index, part = self.__dict__["_dispatcher_ref"]
            where = ".".join(filter(None, [dispatcher.name(index), part, name]))
            return dispatcher.remote_value(getattr(self._shadow(), name), where)

    def extra_repr(self) -> str:
        dispatcher, index, part = self._dispatcher_ref
        unit = dispatcher.split.units[index]
        return f"{'.'.join(filter(None, [unit.name, part]))} on pipeline stage {unit.stage}"


def remote_unit(dispatcher: "UnitDispatcher", index: int, real: nn.Module, owned: dict[int, list[nn.Module]]) -> RemoteUnit:
    """The stand-in for unit ``index`` (``real``) on a rank whose stages do not hold it, holding those of its
    modules the step calls outside it on this rank's stages (``owned``: stage → its modules, added to; see
    :attr:`~lightning_hybrid.pipeline.split.StageSplit.held_inside`)."""
    unit = dispatcher.split.units[index]
    remote = RemoteUnit(dispatcher, index)
    for name, stages in dispatcher.split.held_inside.items():
        here = [stage for stage in stages if stage in owned]
        if here and dispatcher.split.block_unit_of(name) is unit:
            relative = name[len(unit.name) + 1:]
            module = real.get_submodule(relative)
            remote.hold(relative, module)
            owned[here[0]].append(module)
    return remote


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
    """A submodule of another rank's unit as attribute reads see it (see :meth:`UnitDispatcher.remote_value`).
    Called (a block's module called from outside the block, as diffusers' DiT calls
    ``transformer_blocks[0].norm1.emb``), it stands in like a unit: its value is another stage's, and reaches this
    one only through a block's arguments (the setup verification catches any other use)."""

    def __init__(self, dispatcher: "UnitDispatcher", module: nn.Module, name: str) -> None:
        self.__dict__.update(_dispatcher=dispatcher, _module=module, _name=name)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._dispatcher.remote_value(getattr(self._module, name), f"{self._name}.{name}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._dispatcher.stand_in_for(self._module, self._name, args, kwargs)


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
        self._ghosts: dict[int, Tensor] = {}
        self._fill = 0.0  # what stand-ins hold: zeros, NaN while the verification looks for their use

    @contextmanager
    def stand_ins_filled_with(self, value: float) -> Iterator[None]:
        """Stand-ins and values read off other ranks' units hold ``value`` instead of zeros meanwhile: with NaN,
        any use of one in what this stage computes for real shows in its loss or gradients."""
        self._fill, self._ghosts = value, {}
        try:
            yield
        finally:
            self._fill, self._ghosts = 0.0, {}

    def name(self, index: int) -> str:
        return self.split.units[index].name

    def shadow(self, index: int) -> nn.Module:
        return self._shadows[index]

    def remote_value(self, value: Any, name: str) -> Any:
        """What reading ``value`` off another rank's unit gives here: a tensor as a zero-memory tensor of its shape
        and dtype on this device, a submodule as a :class:`RemoteView`, anything else as it is."""
        if isinstance(value, Tensor):
            if id(value) not in self._ghosts:
                fill = self._fill if value.is_floating_point() else 0
                self._ghosts[id(value)] = torch.full((), fill, dtype=value.dtype, device=self._device).expand(value.shape)
            return self._ghosts[id(value)]
        if isinstance(value, nn.Module):
            return RemoteView(self, value, name)
        return value

    def end_stage(self) -> None:
        # Drops the received values too: kept, they would hold a microbatch's activations until the next stage runs.
        self.active = None

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
        if active.boundaries is not None and block in active.boundaries[0]:
            self._note_boundary_shapes(active, block, args, kwargs)
        if active.index in unit.computes_on:
            if block == active.blocks.start and not active.is_first:
                args, kwargs = self._take_received(block, args, kwargs)
            elif active.substitutes:
                args, kwargs = _substituted(args, kwargs, active.substitutes)
            return compute(*args, **kwargs)  # type: ignore[misc]
        if block == active.blocks.stop and not active.is_last:
            # The next stage's first block: what it is given is what this stage sends.
            raise StageOutput(_call_tensors(*_substituted(args, kwargs, active.substitutes)))
        if block is not None and block > active.blocks.stop:
            raise RuntimeError(
                f"Block {block} ran after block {active.blocks.stop - 1}, where stage {active.index} ends: with pp > 1"
                " the step must run its blocks in order, each once."
            )
        return self._stand_in(index, args, kwargs)

    def _note_boundary_shapes(self, active: ActiveStage, block: int, args: tuple, kwargs: dict) -> None:
        """A shape pass at a stage's first block: the shapes of what the stage before it sends; the pass ends at
        the last boundary."""
        ends, shapes = active.boundaries  # type: ignore[misc]
        shapes[ends[block]] = [tuple(t.shape) for t in _call_tensors(args, kwargs)]
        if len(shapes) == len(ends):
            raise StageOutput(None)

    def boundary_shapes(self, run_step: Callable[[], Any]) -> dict[int, list[tuple[int, ...]]]:
        """Stage → shapes of the tensors it sends on, for the microbatch ``run_step`` runs the user's step on: a
        shape pass, where every unit stands in (no FLOPs) and the step ends at the last stage boundary."""
        starts = {self.split.block_range(stage + 1).start: stage for stage in range(self.split.num_stages - 1)}
        shapes: dict[int, list[tuple[int, ...]]] = {}
        self.active = ActiveStage(-1, range(0, max(starts) + 1), True, True, (), boundaries=(starts, shapes))
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
        return self._stand_in_values(output)

    def stand_in_for(self, module: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
        """Zeros shaped like the output of ``module`` (a meta-device submodule of a unit's copy) for this call."""
        return self._stand_in_values(output_spec(self._meta_call(module, name, args, kwargs)))

    def _stand_in_values(self, output: Any) -> Any:
        """Zeros for every :class:`TensorSpec` of an output spec, other values as they are."""
        if isinstance(output, TensorSpec):  # one tensor, as most units return: no tree to map over
            return self._stand_in_tensor(output)
        return tree_map(lambda v: self._stand_in_tensor(v) if isinstance(v, TensorSpec) else v, output)

    def _stand_in_tensor(self, spec: TensorSpec) -> Tensor:
        # Floating outputs in the compute dtype, as FSDP2's mixed-precision policy makes a real unit's.
        if not spec.dtype.is_floating_point:
            return torch.zeros(spec.shape, dtype=spec.dtype, device=self._device)
        dtype = self._compute_dtype if self._compute_dtype is not None else spec.dtype
        return torch.full(spec.shape, self._fill, dtype=dtype, device=self._device)

    def _meta_output(self, index: int, args: tuple, kwargs: dict) -> Any:
        return self._meta_call(self._shadows[index], self.name(index), args, kwargs)

    def _meta_call(self, module: nn.Module, name: str, args: tuple, kwargs: dict) -> Any:
        def to_meta(value: Any) -> Any:
            if not isinstance(value, Tensor):
                return value
            cast = self._compute_dtype if self._compute_dtype is not None and value.is_floating_point() else None
            return value.detach().to("meta", dtype=cast)

        try:
            with torch.no_grad(), meta_step():
                return module(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        except Exception as error:
            shapes = [tuple(t.shape) for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            raise RuntimeError(
                f"'{name}' computes on another pipeline stage; this rank stands in for it and needs the"
                f" shape of its output for inputs of shapes {shapes}, which the calls it saw do not derive (a call"
                f" of another structure, or a size no input size gives), and its meta-device copy could not compute"
                f" it ({type(error).__name__}: {error}). Give the unit the argument structure of the first batch's"
                " call, or use pp=1."
            ) from error

    def _take_received(self, block: int, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Put what the previous stage sent where this stage's own run computed the call's tensors (from stand-ins),
        and remember each swap for the stage's later calls."""
        active = self.active
        assert active is not None
        leaves, spec = tree_flatten((args, kwargs))
        positions = [i for i, leaf in enumerate(leaves) if _carried(leaf)]
        if len(positions) != len(active.received):
            raise RuntimeError(
                f"Block {block} is called with {len(positions)} floating-point tensors, but the stage before it sent"
                f" {len(active.received)}: with pp > 1 the step must call a stage's first block with the same"
                " arguments on every stage. Cut elsewhere with HybridStrategy(pp_split=[...]), or use pp=1."
            )
        for position, received in zip(positions, active.received):
            active.substitutes.setdefault(id(leaves[position]), (leaves[position], received))
            leaves[position] = received
        return tree_unflatten(leaves, spec)


def _carried(value: Any) -> bool:
    """Whether a call's leaf crosses a stage boundary: its floating-point tensors, the values a stage computes.
    Integer and boolean tensors (labels, position ids, masks) come from the batch and are computed again by every
    stage's own run of the step; sent, they would also reach torch's shape inference as uninitialized memory, used
    as indices."""
    return isinstance(value, Tensor) and value.is_floating_point()


def _call_tensors(args: tuple, kwargs: dict) -> list[Tensor]:
    """The floating-point tensors of a call, in ``tree_flatten`` order: what crosses a stage boundary. Contiguous:
    process groups send only dense tensors, and a block may be handed a view (T5's position bias, permuted)."""
    if not kwargs and all(_carried(v) for v in args):  # block(x): flattening costs more than the call
        return [t.contiguous() for t in args]
    return [t.contiguous() for t in tree_flatten((args, kwargs))[0] if _carried(t)]


def _substituted(args: tuple, kwargs: dict, substitutes: dict[int, tuple[Tensor, Tensor]]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with every tensor this stage received a value for replaced by that value."""
    if not substitutes:
        return args, kwargs
    leaves, spec = tree_flatten((args, kwargs))
    if not any(id(leaf) in substitutes for leaf in leaves):
        return args, kwargs
    return tree_unflatten([substitutes[id(leaf)][1] if id(leaf) in substitutes else leaf for leaf in leaves], spec)


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
