"""Pipeline parallelism for an unmodified LightningModule, on ``torch.distributed.pipelining``.

Every pipeline rank runs the user's own ``training_step`` (or validation/test/predict step) for each of its
stages and microbatches, with only its stages' units computing (:mod:`lightning_hybrid.pipeline.dispatch`). The
batch reaches every stage as a keyword argument, which torch's schedules split into microbatches for every stage.

Lightning semantics kept by :meth:`Pipeline.run_step`: each microbatch's loss is weighted by its share of the
step's loss terms and by ``1 / accumulate_grad_batches`` (:mod:`lightning_hybrid.pipeline.microbatches`: in the
schedule's loss function relative to the first microbatch, the step's gradients corrected once all counts are
known; schedules are built with ``scale_grads=False``, which would otherwise divide earlier accumulated gradients
again); batches whose shapes change from step to step reuse the mode's one schedule, its receive buffers fitted
to each step's shapes; gradients computed
inside the step are set aside and added back when Lightning calls ``backward``, after its ``zero_grad``; logs and
the step's output are combined over microbatches and replayed on every rank
(:mod:`lightning_hybrid.pipeline.semantics`).

Example::

    pipeline = build_pipeline(lightning_module, "model.blocks", blocks, PipelineSchedule.resolve("1f1b", pp=2),
                              mesh, device, probe)      # probe: the setup probe (lightning_hybrid.probe.step_probe)
    pipeline.install()                                       # then FSDP2 on pipeline.stage_modules, then:
    pipeline.route_units()
    loss = pipeline.run_step("training_step", batch, 0)     # forward and backward for all microbatches
"""

from __future__ import annotations

import contextlib
from typing import Any, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid._compat import tree_map
from lightning_hybrid._compat.pipelining import keep_forward_actions, pipeline_stage, release_sends_on_arrival
from lightning_hybrid.mesh import PIPELINE
from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.pipeline.dispatch import (ActiveStage, StageOutput, UnitDispatcher, make_shadows, remote_unit,
                                                staged_class)
from lightning_hybrid.pipeline.metric_calls import (MetricCall, MetricRef, combine_metric_calls,
                                                    recording_metric_calls, replay_metric_calls)
from lightning_hybrid.pipeline.microbatches import LossTerms, StageBuffers, received_with_contiguous_gradients, samples
from lightning_hybrid.pipeline.semantics import (check_batch, combine_logs, combine_outputs, muted_logs, original_log,
                                                 recording_logs, to_cpu)
from lightning_hybrid.pipeline.shared import (SharedParameter, combine_gradients, counted_elsewhere,
                                              ghost_unread_parameters, shared_parameters)
from lightning_hybrid.pipeline.split import StageSplit, check_block_runs, plan_split
from lightning_hybrid.pipeline.step_recorder import StepRecorder, StepTimeline
from lightning_hybrid.pipeline.timed_split import MeasuredSplit, resolve_split
from lightning_hybrid.pipeline.verify import UnsplitStep, unsplit_step, verifiable
from lightning_hybrid.probe.blocks import BlockList, detached
from lightning_hybrid.probe.step_probe import StepProbe

_TWO_LOCAL_STAGES = (
    "'{name}' lives on pipeline stages {stages}, which pp_schedule='{schedule}' places on the same rank, and FSDP2"
    " cannot shard one module for two stage modules. Use a schedule that places them on different ranks (e.g."
    " '1f1b' or 'interleaved_1f1b'), or one data-parallel rank with 32-true precision (no FSDP2)."
)
NEEDS_AUTOMATIC_OPTIMIZATION = (
    "the pipeline runs forward and backward of all microbatches inside its schedule, so it needs automatic"
    " optimization; manual_backward() cannot be pipelined"
)


def build_pipeline(module: Any, blocks_path: str, blocks: BlockList, schedule: PipelineSchedule,
                   mesh: DeviceMesh, device: torch.device, probe: StepProbe,
                   pp_split: Union[None, str, Sequence[int]] = None,
                   compute_dtype: Optional[torch.dtype] = None, verify: bool = False) -> "Pipeline":
    """Split the step the setup ``probe`` recorded into the schedule's stages (``pp_split`` blocks per stage;
    ``"measured"``: by the probe's step timed, :mod:`lightning_hybrid.pipeline.timed_split`; else by its FLOPs) and keep
    meta-device copies of every unit before any other parallelism changes them. ``mesh``: the whole device mesh.
    ``verify``: the unsplit step's loss and gradients are taken now, for :mod:`~lightning_hybrid.pipeline.verify`
    (where the probe can run a training step on a model that has values)."""
    if not getattr(module, "automatic_optimization", True):
        raise ValueError(f"HybridStrategy(pp > 1): {NEEDS_AUTOMATIC_OPTIMIZATION}. Set"
                         " self.automatic_optimization = True or use pp=1.")
    record = probe.record()
    check_block_runs(record.block_runs)
    pp_split, measured = resolve_split(pp_split, module, blocks, blocks_path, record, schedule, probe, device)
    split = plan_split(module, blocks_path, blocks, record, schedule.num_stages, pp_split)
    unsplit = None
    if verify and verifiable(probe):
        stage_ids = schedule.stage_ids(mesh[PIPELINE].get_local_rank())
        accumulation = module.trainer.accumulate_grad_batches
        unsplit = unsplit_step(probe, split, stage_ids, accumulation, schedule.microbatches)
    shadows = make_shadows(module, split, compute_dtype)
    dispatcher = UnitDispatcher(split, shadows, record.outputs, device, compute_dtype)
    pipeline = Pipeline(module, split, schedule, mesh, device, dispatcher, measured)
    pipeline.unsplit = unsplit
    return pipeline


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


class Pipeline:
    """Stages of one pipeline rank, their torch schedules, and the Lightning semantics of a pipelined step."""

    def __init__(self, module: Any, split: StageSplit, schedule: PipelineSchedule, mesh: DeviceMesh,
                 device: torch.device, dispatcher: UnitDispatcher,
                 measured_split: Optional[MeasuredSplit] = None) -> None:
        self.module = module
        self.split = split
        self.schedule = schedule
        self._mesh = mesh
        self._pp_rank = mesh[PIPELINE].get_local_rank()
        self.stage_ids = schedule.stage_ids(self._pp_rank)
        self._group = mesh[PIPELINE].get_group()
        self._device = device
        self._dispatcher = dispatcher
        #: Parameters whose gradients this rank combines after each step (set by :meth:`install`).
        self.shared: list[SharedParameter] = []
        self.stage_modules: dict[int, _StageModule] = {}
        self._schedules: dict[bool, tuple[Any, StageBuffers]] = {}
        self._step_name = "training_step"
        self._step_call: tuple[tuple, dict] = ((), {})
        self._loss_scale = 1.0
        #: Loss terms of each microbatch the last stage ran (see :mod:`lightning_hybrid.pipeline.microbatches`), and
        #: of the step's first: the loss function weighs each microbatch relative to it.
        self._microbatch_terms: list[float] = []
        self._first_terms: Optional[float] = None
        self._microbatch_outputs: list[Any] = []
        self._microbatch_logs: list[list[tuple[str, Any, dict]]] = []
        self._microbatch_metric_calls: list[list[MetricCall]] = []
        #: The running step's log and metric calls, of all its microbatches (see :meth:`run_stage`).
        self._step_logs: list[tuple[str, Any, dict]] = []
        self._step_metric_calls: list[MetricCall] = []
        self._step_gradients: list[tuple[nn.Parameter, Optional[Tensor]]] = []
        self._recorder = StepRecorder(device)
        #: The last recorded training step of this rank (see :class:`StepTimeline`).
        self.last_timeline: Optional[StepTimeline] = None
        #: With ``pp_split="measured"``: the measured costs, the split and its predicted stage times and bubble.
        self.measured_split = measured_split
        #: The unsplit step on the first batch, which :mod:`~lightning_hybrid.pipeline.verify` compares the pipelined
        #: step with (``None``: not verified).
        self.unsplit: Optional[UnsplitStep] = None
        last_stage = schedule.stage_ranks()[schedule.num_stages - 1]
        self._last_stage_rank = dist.get_global_rank(self._group, last_stage)

    @property
    def record_timeline(self) -> bool:
        """Record each training step's compute actions into :attr:`last_timeline` (the monitor turns this on)."""
        return self._recorder.recording

    @record_timeline.setter
    def record_timeline(self, value: bool) -> None:
        self._recorder.recording = value

    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The process group of this pipeline's ranks."""
        return self._group

    @property
    def pp_ranks(self) -> list[int]:
        """Global ranks of this pipeline, in pipeline order."""
        return dist.get_process_group_ranks(self._group)

    def counted_elsewhere(self) -> set[int]:
        """``id``\\ s of this rank's parameters that another pipeline rank counts in the total gradient norm."""
        return counted_elsewhere(self.module, self.shared)

    @property
    def owned_blocks(self) -> list[int]:
        """Indices of the blocks this rank's stages run."""
        return [i for stage in self.stage_ids for i in self.split.block_range(stage)]

    # ---------------------------------------------------------------------------------------- building
    def install(self, sharded: bool) -> None:
        """Swap other ranks' units for parameter-free stand-ins and build this rank's stage modules (before FSDP2,
        which the caller applies to ``stage_modules`` when ``sharded``)."""
        self.shared = shared_parameters(self.module, self.split, self.schedule, self._mesh, sharded)
        owned: dict[int, list[nn.Module]] = {stage: [] for stage in self.stage_ids}
        for index, unit in enumerate(self.split.units):
            parent_name, _, attribute = unit.name.rpartition(".")
            parent = self.module.get_submodule(parent_name)
            local = [stage for stage in unit.stages if stage in owned]
            if sharded and len(local) > 1:
                raise ValueError(_TWO_LOCAL_STAGES.format(name=unit.name, stages=local, schedule=self.schedule.name))
            for stage in local:
                owned[stage].append(getattr(parent, attribute))
            if not local:
                setattr(parent, attribute, remote_unit(self._dispatcher, index, getattr(parent, attribute), owned))
        ghost_unread_parameters(self.module, self.split, self.stage_ids, self._device)
        self.stage_modules = {stage: _StageModule(self, stage, units) for stage, units in owned.items()}

    def route_units(self) -> None:
        """Make this rank's units consult the dispatcher on every call (after FSDP2 fixed their classes), those
        held here only for a weight too: called on a stage they do not compute on, they stand in (a tied embedding
        on the last stage would otherwise look its tokens up, and all-reduce them over tp, for nothing)."""
        for index, unit in enumerate(self.split.units):
            if self.stage_modules.keys() & set(unit.stages):
                module = self.module.get_submodule(unit.name)
                module.__class__ = staged_class(type(module))
                module._pipeline_unit = (self._dispatcher, index)

    # --------------------------------------------------------------------------------------- one stage
    def run_stage(self, stage: int, received: tuple, batch: Any, step_args: tuple, step_kwargs: dict) -> Any:
        """The body of a stage module's forward: the user's step with this stage active."""
        blocks = self.split.block_range(stage)
        last = stage == self.split.num_stages - 1
        received = received_with_contiguous_gradients(received)
        self._dispatcher.active = ActiveStage(stage, blocks, stage == 0, last, received)
        # The step's log and metric calls go to lists recorded once per step (run_step); this microbatch's are the
        # part added while it runs (one forward at a time).
        logs, metric_calls = self._step_logs, self._step_metric_calls
        marks = len(logs), len(metric_calls)
        terms = LossTerms()
        try:
            # Only the last stage weighs its loss by its terms; elsewhere the step ends at a stage boundary, and the
            # mode would make every torch call of the step a Python call for nothing.
            with terms if last else contextlib.nullcontext():
                output = getattr(self.module, self._step_name)(batch, *step_args, **step_kwargs)
        except StageOutput as done:
            del logs[marks[0]:], metric_calls[marks[1]:]  # the step did not finish here: its calls do not count
            return tuple(done.output)  # the next stage's first block's tensors (see the dispatcher)
        finally:
            self._dispatcher.end_stage()
        self._microbatch_logs.append(logs[marks[0]:])
        self._microbatch_terms.append(terms.count if terms.count is not None else float(samples(batch)))
        if self._first_terms is None:
            self._first_terms = self._microbatch_terms[-1]
        self._microbatch_metric_calls.append(metric_calls[marks[1]:])
        self._microbatch_outputs.append(output.detach() if isinstance(output, Tensor) else tree_map(detached, output))
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
    def check_step(self, batch: Any, stand_in: float = 0.0) -> tuple[Any, list[tuple[nn.Parameter, Optional[Tensor]]]]:
        """One training step on ``batch`` for :mod:`~lightning_hybrid.pipeline.verify`: its combined output and each
        parameter's gradient, set aside and not kept; its logs and metric calls dropped. What stands in for other
        stages' units holds ``stand_in``."""
        with self._dispatcher.stand_ins_filled_with(stand_in):
            output = self.run_step("training_step", batch, 0, replay=False)
        gradients, self._step_gradients = self._step_gradients, []
        return output, gradients

    def run_step(self, step_name: str, batch: Any, *args: Any, replay: bool = True, **kwargs: Any) -> Any:
        """Run ``step_name`` over the batch's microbatches on all stages; returns the step's (combined) output.
        ``replay``: the step's log and metric calls are made on every rank (Lightning's loop is running)."""
        training = step_name == "training_step"
        schedule = self._start_step(step_name, batch, args, kwargs)
        target = torch.arange(self.schedule.microbatches, device=self._device)  # unused by the loss: one per microbatch
        parameters = [p for p in self.module.parameters() if p.requires_grad]
        kept = [p.grad for p in parameters]
        for parameter in parameters:
            parameter.grad = None  # this step's gradients alone; the kept ones come back below
        timed = training and self.record_timeline
        if timed:
            self._recorder.start()
        try:
            self._run_schedule(schedule, training, target, dict(batch=batch, step_args=args, step_kwargs=kwargs))
        finally:
            self._step_gradients = [(p, p.grad) for p in parameters] if training else []
            for parameter, grad in zip(parameters, kept):
                parameter.grad = grad
        output, logs, metric_calls, correction = self._broadcast_from_last_stage(step_name)
        for _, grad in self._step_gradients if correction != 1.0 else ():
            if grad is not None:
                grad.mul_(correction)  # each microbatch's share of the loss terms, now that all are counted
        if timed:
            self.last_timeline = self._recorder.timeline(self._pp_rank)
        if not replay:
            return output
        replay_metric_calls(self.module, metric_calls, self._device)  # every rank's metrics as one device's
        for name, value, log_kwargs in logs:
            if isinstance(value, MetricRef):
                value = self.module.get_submodule(value.name)
            original_log(self.module)(name, value, **log_kwargs)
        return output

    def _run_schedule(self, schedule: Any, training: bool, target: Tensor, step_inputs: dict) -> None:
        """All microbatches of the step through the schedule, the step's log and metric calls recorded."""
        self._step_logs, self._step_metric_calls = [], []
        # Recorded once per step, not per microbatch: entering the recording walks the module for its metrics and
        # copies each (per microbatch, a cost that grew with the model's size).
        with recording_logs(self.module, self._step_logs), \
                recording_metric_calls(self.module, self._step_metric_calls):
            if training:
                schedule.step(target=target, return_outputs=False, **step_inputs)
            else:
                with torch.no_grad():
                    schedule.eval(target=target, return_outputs=False, **step_inputs)
        if training:
            combine_gradients(self.module, self.shared)  # tied weights: the sum over their stages

    def _start_step(self, step_name: str, batch: Any, args: tuple, kwargs: dict) -> Any:
        """The mode's schedule, its receive buffers fitted to this batch's microbatches, and the step's state reset."""
        microbatches = self.schedule.microbatches
        check_batch(batch, microbatches)
        schedule, buffers = self._schedule_for(step_name == "training_step")
        self._step_name, self._step_call = step_name, (args, kwargs)
        buffers.fit(batch, microbatches)
        accumulation = self.module.trainer.accumulate_grad_batches if step_name == "training_step" else 1
        self._loss_scale = 1.0 / (microbatches * accumulation)
        self._microbatch_outputs, self._microbatch_logs, self._microbatch_metric_calls = [], [], []
        self._microbatch_terms, self._first_terms = [], None
        return schedule

    def _shape_pass(self, microbatch: Any) -> dict[int, list[tuple[int, ...]]]:
        """Shapes of what each stage sends for ``microbatch`` (see :class:`StageBuffers`): the step run with every
        unit standing in, its logs and metrics ignored and the random state left as it was."""
        args, kwargs = self._step_call
        step = getattr(self.module, self._step_name)
        devices = [] if self._device.type == "cpu" else [self._device]
        with torch.no_grad(), torch.random.fork_rng(devices, device_type=self._device.type), muted_logs(self.module):
            return self._dispatcher.boundary_shapes(lambda: step(microbatch, *args, **kwargs))

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

    def _loss_fn(self, output: Tensor, target: Tensor) -> Tensor:
        # Weighted relative to the step's first microbatch (the total is known only after the last): run_step
        # corrects the gradients by first × microbatches / total. Equal counts weigh exactly 1.
        return output * (self._loss_scale * self._microbatch_terms[-1] / self._first_terms)

    def _schedule_for(self, training: bool) -> tuple[Any, StageBuffers]:
        """One torch schedule (with its own stages) per mode, whatever the batch shapes: a stage infers its
        send/receive shapes on its first step, switching modes on one schedule would redo that and clear gradients,
        and :class:`StageBuffers` refits the buffers when a step's shapes change."""
        if training not in self._schedules:
            release_sends_on_arrival()
            stages = [
                pipeline_stage(self.stage_modules[s], s, self.schedule.num_stages, self._device, self._group)
                for s in self.stage_ids
            ]
            for stage in stages:
                self._recorder.wrap(stage)
            schedule = self.schedule.torch_class(
                stages[0] if self.schedule.single_stage else stages,
                n_microbatches=self.schedule.microbatches,
                loss_fn=self._loss_fn,
                scale_grads=False,
            )
            if not training and self.schedule.placement == "v":
                keep_forward_actions(schedule)
            self._schedules[training] = (schedule, StageBuffers(stages, self._shape_pass))
        return self._schedules[training]

    def _broadcast_from_last_stage(self, step_name: str) -> tuple[Any, list, list[MetricCall], float]:
        """The last stage's combined output, log calls and metric calls, sent to every rank of this pipeline, and
        the factor that turns the gradients' weights relative to the first microbatch into shares of the total."""
        payload: list[Any] = [None]
        if dist.get_rank() == self._last_stage_rank:
            count = self.schedule.microbatches
            # A new schedule's first step also ran each stage once to infer shapes: keep the real microbatches.
            outputs, logs = self._microbatch_outputs[-count:], self._microbatch_logs[-count:]
            terms = self._microbatch_terms[-count:]
            metric_calls = combine_metric_calls(self._microbatch_metric_calls[-count:])
            correction = self._first_terms * count / sum(terms) if sum(terms) > 0 else 1.0
            payload = [(tree_map(to_cpu, combine_outputs(outputs, step_name, terms)), combine_logs(logs, terms),
                        metric_calls, correction)]
        dist.broadcast_object_list(payload, src=self._last_stage_rank, group=self._group)
        output, logs, metric_calls, correction = payload[0]
        output = tree_map(lambda v: v.to(self._device) if isinstance(v, Tensor) else v, output)
        return output, logs, metric_calls, correction
