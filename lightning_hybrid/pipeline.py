"""Pipeline parallelism for an unmodified LightningModule, on ``torch.distributed.pipelining``.

Every pipeline rank runs the user's own ``training_step`` (or validation/test/predict step) for each of its
stages and microbatches. What differs per stage is which modules really compute:

* the units (blocks, embedding, head, ... see :mod:`lightning_hybrid.stage_split`) of the running stage compute;
* units of other stages are *stood in for*: a meta-device copy computes only the output's shape, and zeros of
  that shape are returned — no parameters, no FLOPs — so the user's code around them (rotary tables, masks,
  position ids computed from the embedding's output) still runs and hands the blocks their extra arguments;
* the stage's first block takes the activation received from the previous stage in place of the stand-in
  output it was given, and its last block ends the stage by raising :class:`_StageOutput` (a
  ``BaseException``, so user code catching ``Exception`` cannot swallow it) with its output, which the stage
  module returns to :class:`~torch.distributed.pipelining.PipelineStage` to send on.

The batch reaches every stage as a keyword argument, which the schedules split into microbatches for every stage.

Lightning semantics kept by :class:`Pipeline` (see :meth:`Pipeline.run_step`): each microbatch's loss is scaled
by ``1 / (microbatches × accumulate_grad_batches)`` in the schedule's loss function (schedules are built with
``scale_grads=False``, which would otherwise divide earlier accumulated gradients again); gradients computed
inside the step are set aside and added back when Lightning calls ``backward``, after its ``zero_grad``; the
values the last stage's ``self.log`` calls produced are combined over microbatches (by their ``reduce_fx``) and
replayed on every rank, so rank 0's logger and the callbacks see them; the step's output (mean over
microbatches) is returned on every rank.

Example::

    schedule = PipelineSchedule.resolve("1f1b", pp=2)
    pipeline = Pipeline(lightning_module, split, schedule, mesh["pp"], device, make_shadows(lightning_module, split))
    pipeline.install()                                       # then FSDP2 on pipeline.stage_modules, then:
    pipeline.route_units()
    loss = pipeline.run_step("training_step", batch, 0)     # forward and backward for all microbatches
"""

from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping
from torch.distributed.pipelining.schedules import (
    PipelineScheduleSingle,
    _Action,
    _ComputationType,
    _add_send_recv,
    _add_unshard_reshard,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    Schedule1F1B,
    ScheduleZBVZeroBubble,
)
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from lightning_hybrid.stage_split import StageSplit

#: Accepted schedule names → torch schedule class. "v" schedules place two stages per rank in a V.
SCHEDULES: dict[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "looped_bfs": ScheduleLoopedBFS,
    "interleaved_zero_bubble": ScheduleInterleavedZeroBubble,
    "zbv_zero_bubble": ScheduleZBVZeroBubble,
    "dualpipev": ScheduleDualPipeV,
}
_V_SHAPED = {"zbv_zero_bubble", "dualpipev"}
#: Zero-bubble schedules compute weight gradients in a separate pass after the input gradients.
_SPLIT_WEIGHT_GRADIENTS = {"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"}


@dataclass(frozen=True)
class PipelineSchedule:
    """A validated schedule choice: name, pipeline degree, stages per rank and microbatches per step.

    Example::

        PipelineSchedule.resolve("interleaved_1f1b", pp=4)   # virtual_stages=2, microbatches=8
    """

    name: str
    pp: int
    virtual_stages: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def torch_class(self) -> type:
        return SCHEDULES[self.name]

    @property
    def placement(self) -> str:
        """``"v"`` (rank r holds stages r and 2·pp−1−r) or ``"loop"`` (rank r holds stages r, r+pp, ...)."""
        return "v" if self.name in _V_SHAPED else "loop"

    @property
    def splits_weight_gradients(self) -> bool:
        """Whether weight gradients are computed after, and apart from, the input gradients (zero-bubble)."""
        return self.name in _SPLIT_WEIGHT_GRADIENTS

    @property
    def single_stage(self) -> bool:
        return issubclass(self.torch_class, PipelineScheduleSingle)

    @classmethod
    def resolve(
        cls, name: str, pp: int, virtual_stages: Optional[int] = None, microbatches: Optional[int] = None
    ) -> "PipelineSchedule":
        """Check a schedule against its stage-count and microbatch rules (torch's, stated up front)."""
        key = _schedule_key(name)
        single = issubclass(SCHEDULES[key], PipelineScheduleSingle)
        if virtual_stages is None:
            virtual_stages = 1 if single else 2
        if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise ValueError(f"HybridStrategy(virtual_stages={virtual_stages!r}) must be a positive integer.")
        if single and virtual_stages != 1:
            raise ValueError(
                f"pp_schedule={name!r} runs one stage per rank; virtual_stages={virtual_stages} needs a multi-stage"
                " schedule: 'interleaved_1f1b', 'looped_bfs', 'interleaved_zero_bubble' (or 'zbv_zero_bubble' /"
                " 'dualpipev' with virtual_stages=2)."
            )
        if key in _V_SHAPED and virtual_stages != 2:
            raise ValueError(f"pp_schedule={name!r} places exactly 2 stages per rank in a V; use virtual_stages=2.")
        stages = pp * virtual_stages
        if microbatches is None:
            microbatches = stages
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
            raise ValueError(f"HybridStrategy(microbatches={microbatches!r}) must be a positive integer.")
        _check_microbatches(key, name, pp, stages, microbatches)
        return cls(key, pp, virtual_stages, microbatches)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages that pipeline rank ``pp_rank`` runs (torch's own stage → rank mapping for the schedule)."""
        mapping = generate_stage_to_rank_mapping(self.pp, self.num_stages, style=self.placement)
        return sorted(stage for stage, rank in mapping.items() if rank == pp_rank)

    def theoretical_bubble(self) -> Optional[float]:
        """Idle fraction of an ideal schedule with equal stage times: ``(p − 1) / (m·v + p − 1)`` for GPipe, 1F1B,
        interleaved 1F1B and looped BFS (``v`` stages per rank); ``None`` for the zero-bubble schedules, whose
        idle time has no closed form (it depends on the ratio of forward, input- and weight-gradient times)."""
        if self.splits_weight_gradients:
            return None
        return (self.pp - 1) / (self.microbatches * self.virtual_stages + self.pp - 1)


def _schedule_key(name: str) -> str:
    normalized = str(name).lower().replace("-", "_")
    aliases = {key.replace("_", ""): key for key in SCHEDULES}
    key = aliases.get(normalized.replace("_", ""))
    if key is None:
        raise ValueError(f"Unknown pp_schedule={name!r}. Choose one of: {', '.join(SCHEDULES)}.")
    return key


def _check_microbatches(key: str, name: str, pp: int, stages: int, microbatches: int) -> None:
    if key == "1f1b" and microbatches < pp:
        raise ValueError(f"pp_schedule={name!r} needs microbatches ≥ pp ({pp}); got microbatches={microbatches}.")
    if key == "dualpipev" and microbatches < stages:
        raise ValueError(
            f"pp_schedule={name!r} needs microbatches ≥ its {stages} stages (2 × pp); got microbatches={microbatches}."
        )
    if key in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"pp_schedule={name!r} runs microbatches in rounds of pp={pp}: microbatches={microbatches} must be"
                f" below pp or a multiple of its {rounds} rounds (e.g. {pp * rounds})."
            )


# ------------------------------------------------------------------------------------------------- step timing
@dataclass(frozen=True)
class ActionSpan:
    """One compute action of a pipeline rank: ``kind`` is ``"F"`` (forward), ``"B"`` (full backward), ``"I"``
    (input gradients only) or ``"W"`` (weight gradients, zero-bubble schedules); times in seconds from the start
    of the rank's step."""

    stage: int
    microbatch: int
    kind: str
    start: float
    end: float


@dataclass
class StepTimeline:
    """What one pipeline rank did during one training step.

    ``duration`` runs from the rank entering the step to the end of the step's closing broadcast, which every
    rank of the pipeline leaves together: ends are aligned across ranks, starts are not.
    """

    pp_rank: int
    duration: float
    actions: list[ActionSpan] = field(default_factory=list)
    #: Seconds spent computing (the rest of ``duration`` is waiting, communication and bookkeeping); summed from
    #: ``actions`` unless given (a summary without its actions keeps it).
    busy: Optional[float] = None

    def __post_init__(self) -> None:
        if self.busy is None:
            self.busy = sum(action.end - action.start for action in self.actions)

    def summary(self) -> "StepTimeline":
        """The same step without its actions: what measuring the bubble needs, small enough to gather every step."""
        return StepTimeline(self.pp_rank, self.duration, [], self.busy)


class _StepClock:
    """Timestamps relative to the start of a step; CUDA events on GPUs (kernels run asynchronously)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._origin: Any = None

    def now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._origin = self.now()

    def seconds(self, mark: Any) -> float:
        if self._cuda:
            return self._origin.elapsed_time(mark) / 1e3
        return mark - self._origin

    def synchronize(self) -> None:
        if self._cuda:
            torch.cuda.synchronize()


# ------------------------------------------------------------------------------------------------ unit dispatch
class _StageOutput(BaseException):
    """Raised after a stage's last block to end the user's step there; carries the block's output."""

    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output


@dataclass
class _ActiveStage:
    index: int
    blocks: range
    is_first: bool
    is_last: bool
    received: tuple[Tensor, ...]


class _RemoteUnit(nn.Module):
    """Takes the place of a unit that lives on another pipeline rank: holds no parameters, returns stand-ins."""

    def __init__(self, dispatcher: "_UnitDispatcher", index: int) -> None:
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


def _staged_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` asks the dispatcher whether to compute or stand in."""
    if cls not in _STAGED_CLASSES:

        def __call__(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            dispatcher, index = self._pipeline_unit
            return dispatcher.call(index, lambda *a, **k: nn.Module.__call__(self, *a, **k), args, kwargs)

        _STAGED_CLASSES[cls] = type(f"Staged{cls.__name__}", (cls,), {"__call__": __call__})
    return _STAGED_CLASSES[cls]


class _UnitDispatcher:
    """Decides, for each unit called during a stage's step, whether it computes, stands in, or ends the stage."""

    def __init__(
        self, split: StageSplit, shadows: list[nn.Module], device: torch.device, compute_dtype: Optional[torch.dtype]
    ) -> None:
        self.split = split
        self._shadows = shadows
        self._device = device
        self._compute_dtype = compute_dtype
        self.active: Optional[_ActiveStage] = None
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
                raise _StageOutput(output)
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


class _StageModule(nn.Module):
    """What :class:`PipelineStage` runs for one stage: the user's step, with this stage's units computing.

    It registers the stage's units so that FSDP2 can make it the root of their sharding; the LightningModule
    itself is held without registering it (it also contains other stages' units).
    """

    def __init__(self, pipeline: "Pipeline", stage: int, units: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stage_units = nn.ModuleList(units)
        self._pipeline_ref = (pipeline, stage)

    def forward(self, *received: Tensor, batch: Any, step_args: tuple = (), step_kwargs: Optional[dict] = None) -> Any:
        pipeline, stage = self._pipeline_ref
        return pipeline.run_stage(stage, received, batch, step_args, step_kwargs or {})


# ------------------------------------------------------------------------------------------------- the pipeline
class Pipeline:
    """Stages of one pipeline rank, their torch schedules, and the Lightning semantics of a pipelined step."""

    def __init__(
        self,
        module: Any,
        split: StageSplit,
        schedule: PipelineSchedule,
        pp_mesh: DeviceMesh,
        device: torch.device,
        shadows: list[nn.Module],
        compute_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.module = module
        self.split = split
        self.schedule = schedule
        self.stage_ids = schedule.stage_ids(pp_mesh.get_local_rank())
        self._group = pp_mesh.get_group()
        self._device = device
        self._dispatcher = _UnitDispatcher(split, shadows, device, compute_dtype)
        self.stage_modules: dict[int, _StageModule] = {}
        self._schedules: dict[Any, Any] = {}
        self._step_name = "training_step"
        self._loss_scale = 1.0
        self._microbatch_outputs: list[Any] = []
        self._microbatch_logs: list[list[tuple[str, Any, dict]]] = []
        self._step_gradients: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        self._pp_rank = pp_mesh.get_local_rank()
        #: Record each training step's compute actions into :attr:`last_timeline` (the monitor turns this on).
        self.record_timeline = False
        #: The last recorded training step of this rank (see :class:`StepTimeline`).
        self.last_timeline: Optional[StepTimeline] = None
        self._clock = _StepClock(device)
        self._marks: list[tuple[int, int, str, Any, Any]] = []
        mapping = generate_stage_to_rank_mapping(schedule.pp, schedule.num_stages, style=schedule.placement)
        self._last_stage_rank = dist.get_global_rank(self._group, mapping[schedule.num_stages - 1])

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of this pipeline's ranks."""
        return self._group

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this pipeline, in pipeline order."""
        return dist.get_process_group_ranks(self._group)

    # ---------------------------------------------------------------------------------------- building
    def install(self) -> None:
        """Swap other ranks' units for parameter-free stand-ins and build this rank's stage modules (before FSDP2,
        which the caller applies to ``stage_modules``)."""
        owned: dict[int, list[nn.Module]] = {stage: [] for stage in self.stage_ids}
        for index, unit in enumerate(self.split.units):
            parent_name, _, attribute = unit.name.rpartition(".")
            parent = self.module.get_submodule(parent_name)
            if unit.stage in owned:
                owned[unit.stage].append(getattr(parent, attribute))
            else:
                setattr(parent, attribute, _RemoteUnit(self._dispatcher, index))
        self.stage_modules = {stage: _StageModule(self, stage, units) for stage, units in owned.items()}

    def route_units(self) -> None:
        """Make this rank's units consult the dispatcher on every call (after FSDP2 fixed their classes)."""
        for index, unit in enumerate(self.split.units):
            if unit.stage in self.stage_modules:
                module = self.module.get_submodule(unit.name)
                module.__class__ = _staged_class(type(module))
                module._pipeline_unit = (self._dispatcher, index)

    # --------------------------------------------------------------------------------------- one stage
    def run_stage(self, stage: int, received: tuple, batch: Any, step_args: tuple, step_kwargs: dict) -> Any:
        """The body of a stage module's forward: the user's step with this stage active."""
        blocks = self.split.block_range(stage)
        self._dispatcher.active = _ActiveStage(stage, blocks, stage == 0, stage == self.split.num_stages - 1, received)
        logs: list[tuple[str, Any, dict]] = []
        try:
            with _recording_logs(self.module, logs):
                output = getattr(self.module, self._step_name)(batch, *step_args, **step_kwargs)
        except _StageOutput as done:
            return tuple(t for t in tree_flatten(done.output)[0] if isinstance(t, Tensor))
        finally:
            self._dispatcher.end_stage()
        self._microbatch_logs.append(logs)
        self._microbatch_outputs.append(tree_map(_detached, output))
        loss = output.get("loss") if isinstance(output, Mapping) else output
        if self._step_name == "training_step":
            if not isinstance(loss, Tensor):
                raise RuntimeError(
                    "With pp > 1, training_step must return the loss (a tensor, or a dict with 'loss') for every"
                    f" microbatch; it returned {type(output).__name__}."
                )
            return loss
        return loss if isinstance(loss, Tensor) and loss.numel() == 1 else torch.zeros((), device=self._device)

    # ---------------------------------------------------------------------------------------- one step
    def run_step(self, step_name: str, batch: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``step_name`` over the batch's microbatches on all stages; returns the step's (combined) output."""
        training = step_name == "training_step"
        microbatches = self.schedule.microbatches
        _check_batch(batch, microbatches)
        schedule = self._schedule_for(training, batch)
        self._step_name = step_name
        trainer = self.module.trainer
        self._loss_scale = 1.0 / (microbatches * trainer.accumulate_grad_batches) if training else 1.0
        self._microbatch_outputs, self._microbatch_logs = [], []
        target = torch.arange(microbatches, device=self._device)  # unused by the loss: one entry per microbatch
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        kept = [p.grad for p in parameters]
        for parameter in parameters:
            parameter.grad = None  # this step's gradients alone; the kept ones come back below
        timed = training and self.record_timeline
        if timed:
            self._marks = []
            self._clock.start()
        try:
            step_inputs = dict(batch=batch, step_args=args, step_kwargs=kwargs)
            if training:
                schedule.step(target=target, return_outputs=False, **step_inputs)
            else:
                with torch.no_grad():
                    schedule.eval(target=target, return_outputs=False, **step_inputs)
        finally:
            self._step_gradients = [(p, p.grad) for p in parameters] if training else []
            for parameter, grad in zip(parameters, kept):
                parameter.grad = grad
        output, logs = self._broadcast_from_last_stage(step_name)
        if timed:
            self.last_timeline = self._timeline(self._clock.now())
        for name, value, log_kwargs in logs:
            _original_log(self.module)(name, value, **log_kwargs)
        return output

    def add_step_gradients(self) -> None:
        """Accumulate the gradients of the last pipelined training step (Lightning's ``backward``)."""
        for parameter, grad in self._step_gradients:
            if grad is None:
                continue
            if parameter.grad is None:
                parameter.grad = grad
            else:
                parameter.grad += grad
        self._step_gradients = []

    def _timeline(self, end_mark: Any) -> StepTimeline:
        self._clock.synchronize()
        seconds = self._clock.seconds
        actions = [ActionSpan(stage, microbatch, kind, seconds(start), seconds(end))
                   for stage, microbatch, kind, start, end in self._marks]
        return StepTimeline(self._pp_rank, seconds(end_mark), actions)

    def _time_actions(self, stage: PipelineStage) -> None:
        """Wrap the stage's compute calls (the schedule's F / B / I / W actions) to timestamp them when recording."""

        def timed(method: Callable[..., Any], kind: str) -> Callable[..., Any]:
            def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
                if not self.record_timeline:
                    return method(chunk, *args, **kwargs)
                action = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
                start = self._clock.now()
                try:
                    return method(chunk, *args, **kwargs)
                finally:
                    self._marks.append((stage.stage_index, chunk, action, start, self._clock.now()))

            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, "F")  # type: ignore[method-assign]
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "B")  # type: ignore[method-assign]
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "W")  # type: ignore[method-assign]

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        return output * self._loss_scale

    def _schedule_for(self, training: bool, batch: Any) -> Any:
        """One torch schedule (with its own stages) per mode and microbatch shape: a stage infers its
        send/receive shapes once, and switching modes on one schedule would redo that and clear gradients."""
        key = (training, tuple((tuple(t.shape), t.dtype) for t in tree_flatten(batch)[0] if isinstance(t, Tensor)))
        if key not in self._schedules:
            stages = [
                PipelineStage(self.stage_modules[s], s, self.schedule.num_stages, self._device, group=self._group)
                for s in self.stage_ids
            ]
            for stage in stages:
                self._time_actions(stage)
            cls = self.schedule.torch_class
            schedule = cls(
                stages[0] if self.schedule.single_stage else stages,
                n_microbatches=self.schedule.microbatches,
                loss_fn=self._loss_fn,
                scale_grads=False,
            )
            if not training and self.schedule.placement == "v":
                _keep_forwards_only(schedule)
            self._schedules[key] = schedule
        return self._schedules[key]

    def _broadcast_from_last_stage(self, step_name: str) -> tuple[Any, list]:
        """The last stage's combined output and log calls, sent to every rank of this pipeline."""
        payload: list[Any] = [None]
        if dist.get_rank() == self._last_stage_rank:
            count = self.schedule.microbatches
            # A new schedule's first step also ran each stage once to infer shapes: keep the real microbatches.
            outputs, logs = self._microbatch_outputs[-count:], self._microbatch_logs[-count:]
            payload = [(tree_map(_to_cpu, _combine_outputs(outputs, step_name)), _combine_logs(logs))]
        dist.broadcast_object_list(payload, src=self._last_stage_rank, group=self._group)
        output, logs = payload[0]
        return tree_map(lambda v: v.to(self._device) if isinstance(v, Tensor) else v, output), logs


# --------------------------------------------------------------------------------------------------- helpers
def _keep_forwards_only(schedule: Any) -> None:
    """Re-lower a V-shaped schedule with its forward actions only.

    torch 2.13's V schedules still run their backward actions under ``eval()`` (and fail); the forward actions
    of the training order, lowered again with torch's own passes (FSDP unshard/reshard, send/receive), are a
    valid forward-only schedule for the same stage placement. (The public lowering entry point refuses an order
    without backward actions, hence the two passes called directly.)
    """
    forwards: dict[int, list[_Action]] = {}
    for rank, actions in schedule.pipeline_order.items():
        kept: list[_Action] = []
        for action in actions:
            if action is None:
                continue
            parts = action.sub_actions if action.computation_type == _ComputationType.OVERLAP_F_B else (action,)
            kept += [a for a in parts or () if a.computation_type == _ComputationType.FORWARD]
        forwards[rank] = _add_unshard_reshard(kept)
    schedule.pipeline_order_with_comms = _add_send_recv(
        forwards, stage_to_rank=lambda stage: schedule.stage_index_to_group_rank[stage], num_stages=schedule._num_stages
    )


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


def _check_batch(batch: Any, microbatches: int) -> None:
    sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("With pp > 1 the batch must contain tensors to split into microbatches along dimension 0.")
    size = min(sizes)
    if size % microbatches:
        raise ValueError(
            f"A batch of {size} samples cannot be split into {microbatches} equal microbatches"
            f" (HybridStrategy(microbatches={microbatches})). Use a batch size divisible by the microbatch count,"
            " and drop_last=True in the DataLoader if the dataset does not divide into full batches."
        )


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, Tensor) else value


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _combine_outputs(outputs: list[Any], step_name: str) -> Any:
    """Scalars average over microbatches (each is a mean over equal microbatches); batched tensors concatenate."""
    if not outputs or outputs[0] is None:
        return None
    flat = [tree_flatten(o)[0] for o in outputs]
    spec = tree_flatten(outputs[0])[1]
    combined = []
    for values in zip(*flat):
        first = values[0]
        if isinstance(first, Tensor) and first.dim() == 0:
            combined.append(torch.stack(values).mean())
        elif isinstance(first, Tensor):
            combined.append(torch.cat(values))
        else:
            combined.append(values[-1])
    return tree_unflatten(combined, spec)


_REDUCTIONS = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}


def _combine_logs(per_microbatch: list[list[tuple[str, Any, dict]]]) -> list[tuple[str, Any, dict]]:
    """One ``self.log`` call per name whose value is the microbatch values reduced by the call's ``reduce_fx``."""
    calls: dict[str, list[tuple[Any, dict]]] = {}
    for logs in per_microbatch:
        for name, value, kwargs in logs:
            calls.setdefault(name, []).append((value, kwargs))
    combined = []
    for name, entries in calls.items():
        kwargs = dict(entries[-1][1])
        reduce = _reduction(kwargs.get("reduce_fx", "mean"), name)
        values = torch.stack([torch.as_tensor(_to_cpu(v), dtype=torch.float64) for v, _ in entries])
        value = reduce(values, 0)
        first = entries[0][0]
        value = value.to(first.dtype) if isinstance(first, Tensor) else value.item()
        if "batch_size" in kwargs:
            kwargs["batch_size"] = sum(e[1]["batch_size"] for e in entries)
        combined.append((name, value, kwargs))
    return combined


def _reduction(reduce_fx: Any, name: str) -> Callable[..., Tensor]:
    key = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    key = {"amax": "max", "amin": "min"}.get(key, key)
    if key not in _REDUCTIONS:
        raise ValueError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): with pp > 1 the strategy combines a step's microbatch"
            " values itself and knows 'mean', 'sum', 'max' and 'min'."
        )
    return _REDUCTIONS[key]


@contextlib.contextmanager
def _recording_logs(module: Any, logs: list) -> Iterator[None]:
    """Collect ``self.log(name, value, ...)`` calls of the step instead of logging them."""

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("With pp > 1, pass self.log options by keyword (e.g. self.log(name, value, sync_dist=True)).")
        if not isinstance(value, (Tensor, float, int)):
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}: with pp > 1 only tensors and numbers can be"
                " logged from a pipelined step (the strategy combines them over microbatches)."
            )
        logs.append((name, _detached(value), kwargs))

    module.log = record  # an instance attribute shadows LightningModule.log for the step's duration
    try:
        yield
    finally:
        del module.log


def _original_log(module: Any) -> Callable[..., None]:
    return type(module).log.__get__(module)


@contextlib.contextmanager
def muted_logs(module: Any) -> Iterator[None]:
    """Run a step outside Lightning's loops (setup-time tracing) with its ``self.log`` calls ignored."""
    with _recording_logs(module, []):
        yield
