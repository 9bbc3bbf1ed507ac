"""The stage split by measured time (``HybridStrategy(pp_split="measured")``): profile the step, then split.

Traced FLOPs count matrix products only; a block whose time goes to elementwise work, sorting, scans or gathers
(routing, masking, normalizations on long sequences) costs more than its FLOPs say, and the FLOP-balanced split
leaves its stage the slowest. Here every rank, at setup and on the real device, runs the user's step on the
first microbatch — forward and backward, a warm-up and then :data:`REPEATS` times — and timestamps:

* each block's forward (forward pre- and post-hooks) and its backward: from the moment the gradients of all of
  its outputs are in (gradient hooks on its outputs) to the moment its first input's gradient, or its last
  parameter's gradient, is (gradient hooks on its inputs, post-accumulate hooks on its parameters);
* the work before the first block, from the moment the model's first module starts (the LightningModule, the
  modules that contain the blocks, or one outside them: the batch's preparation is not timed) plus the backward
  after the first block's; and the work after the last block (head, loss) plus the backward before the last
  block's. Code between blocks, which every stage runs, is in neither.

Each figure is the median over the repetitions, then the mean over all ranks (every rank timed the whole model on
its own microbatch): every rank balances the same numbers, so all adopt the same split.
:func:`~lightning_hybrid.pipeline.split.balanced_split` balances these seconds as it balances FLOPs otherwise.
The timed steps leave nothing behind that training sees: random streams are forked, each gradient is dropped as
soon as it is accumulated (the whole model's gradients never exist at once), buffers (BatchNorm statistics) are
restored. On GPUs every timestamp waits for the device (``torch.accelerator.synchronize``).

Example::

    measured = measure_split(module, blocks, record, schedule, run_step, device, "model.blocks")
    measured.blocks_per_stage, measured.stage_seconds       # e.g. [1, 3], [0.0061, 0.0042]
    measured.flop_blocks_per_stage, measured.flop_stage_seconds   # [3, 1] and its times under the measured costs
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid._compat import tree_leaves
from lightning_hybrid.options.hybrid_options import MEASURED_SPLIT
from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.pipeline.split import balanced_split, check_enough_blocks, flop_balanced_split
from lightning_hybrid.probe.record import SetupRecord
from lightning_hybrid.probe.step_probe import StepProbe, leaving_no_trace

#: Timed repetitions of the step (the median of each figure is kept) after :data:`WARMUP` untimed ones.
REPEATS, WARMUP = 5, 1

META_DEVICE = (
    "HybridStrategy(pp_split='measured') times each block's forward and backward on the device at setup, but the"
    " model's parameters are on the meta device (built under meta-device initialization), where nothing can run."
    " Pass pp_split=[...] (blocks per stage), or leave pp_split out to balance the stages by traced FLOPs."
)


@dataclass(frozen=True)
class StepTimes:
    """Seconds of one microbatch's forward and backward: before the first block, each block, after the last.
    ``backward`` is ``False`` where the step returned no loss to differentiate (forward times only)."""

    before: float
    blocks: list[float]
    after: float
    backward: bool = True

    def stage_seconds(self, blocks_per_stage: Sequence[int]) -> list[float]:
        """Each stage's time for these blocks per stage: its blocks, plus the work before the blocks on the first
        stage and after them on the last."""
        seconds, start = [], 0
        for count in blocks_per_stage:
            seconds.append(sum(self.blocks[start:start + count]))
            start += count
        seconds[0] += self.before
        seconds[-1] += self.after
        return seconds


@dataclass(frozen=True)
class MeasuredSplit:
    """The split balanced by :class:`StepTimes`, its predicted per-stage seconds (one microbatch's forward and
    backward) and bubble, next to the FLOP-balanced split's under the same measured costs."""

    times: StepTimes
    schedule: PipelineSchedule
    blocks_per_stage: list[int]
    stage_seconds: list[float]
    bubble: float
    flop_blocks_per_stage: list[int]
    flop_stage_seconds: list[float]
    flop_bubble: float

    def describe(self) -> str:
        """One log line: the measured costs, the split and its prediction, the FLOP split's."""
        kind = "forward + backward" if self.times.backward else "forward (no loss to differentiate)"
        return (
            f"pp_split='measured': {kind} of one microbatch, median of {REPEATS}: before the blocks"
            f" {_ms(self.times.before)}, blocks [{', '.join(_ms(t, unit='') for t in self.times.blocks)}] ms, after"
            f" {_ms(self.times.after)}. Blocks per stage {self.blocks_per_stage}: stage times"
            f" [{', '.join(_ms(t, unit='') for t in self.stage_seconds)}] ms, imbalance"
            f" {imbalance(self.stage_seconds):.2f}, predicted bubble {self.bubble:.3f} ({self.schedule.name},"
            f" m={self.schedule.microbatches}); the FLOP-balanced split {self.flop_blocks_per_stage} would take"
            f" [{', '.join(_ms(t, unit='') for t in self.flop_stage_seconds)}] ms, predicted bubble"
            f" {self.flop_bubble:.3f}."
        )


def _ms(seconds: float, unit: str = " ms") -> str:
    return f"{seconds * 1e3:.3g}{unit}"


def imbalance(stage_seconds: Sequence[float]) -> float:
    """The slowest stage over the mean stage, minus 1 (0: balanced)."""
    mean = sum(stage_seconds) / len(stage_seconds)
    return max(stage_seconds) / mean - 1.0 if mean > 0 else 0.0


def predicted_bubble(stage_seconds: Sequence[float], schedule: PipelineSchedule) -> float:
    """Idle share of a step whose stages take ``stage_seconds`` per microbatch (forward + backward).

    The slowest rank (per microbatch ``R``, the sum of its stages) paces the step: ``m·R`` plus the fill and drain,
    the other stages' time once (``(S − R) / v``, ``S`` all stages' time, ``v`` stages per rank). For equal stages
    this is the theory's ``(p − 1) / (m·v + p − 1)``; for one stage per rank it is the flow-shop makespan
    ``S + (m − 1)·max``. Compute only: communication and the zero-bubble schedules' split backward are left out.

    Example::

        predicted_bubble([1.0, 1.0], PipelineSchedule.resolve("1f1b", pp=2, microbatches=4))   # 1/5
        predicted_bubble([3.0, 1.0], PipelineSchedule.resolve("1f1b", pp=2, microbatches=4))   # 1 - 4·2/13
    """
    per_rank = [sum(stage_seconds[stage] for stage in schedule.stage_ids(rank)) for rank in range(schedule.pp)]
    slowest, m = max(per_rank), schedule.microbatches
    step = m * slowest + (sum(stage_seconds) - slowest) / schedule.virtual_stages
    return 1.0 - m * (sum(per_rank) / len(per_rank)) / step if step > 0 else 0.0


def split_by_time(times: StepTimes, schedule: PipelineSchedule, flop_split: Sequence[int]) -> MeasuredSplit:
    """Balance the schedule's stages by ``times`` and predict both that split and ``flop_split`` under them."""
    counts = balanced_split(times.blocks, schedule.num_stages, times.before, times.after)
    seconds, flop_seconds = times.stage_seconds(counts), times.stage_seconds(flop_split)
    return MeasuredSplit(times, schedule, counts, seconds, predicted_bubble(seconds, schedule), list(flop_split),
                         flop_seconds, predicted_bubble(flop_seconds, schedule))


def resolve_split(pp_split: Union[None, str, Sequence[int]], root: nn.Module, blocks: BlockList, blocks_path: str,
                  record: SetupRecord, schedule: PipelineSchedule, probe: StepProbe,
                  device: torch.device) -> tuple[Optional[Sequence[int]], Optional[MeasuredSplit]]:
    """``pp_split`` as :func:`~lightning_hybrid.pipeline.split.plan_split` takes it (blocks per stage, or ``None``
    for the FLOP split) and, for ``"measured"``, the :func:`measure_split` that chose the blocks per stage, timing
    the setup ``probe``'s step on the schedule's first microbatch."""
    if pp_split != MEASURED_SPLIT:
        return pp_split, None  # type: ignore[return-value]  # HybridOptions allows no other string
    microbatch_step = functools.partial(probe.run, schedule.microbatches)
    measured = measure_split(root, blocks, record, schedule, microbatch_step, device, blocks_path)
    return measured.blocks_per_stage, measured


def measure_split(root: nn.Module, blocks: BlockList, record: SetupRecord, schedule: PipelineSchedule,
                  run_step: Callable[[], Any], device: torch.device, blocks_path: str = "") -> MeasuredSplit:
    """Time the step (:func:`measure_step`), agree on the times over all ranks and split by them. Every rank
    calls it."""
    check_enough_blocks(blocks_path, len(blocks), schedule.num_stages)
    times = averaged_over_ranks(measure_step(root, blocks, run_step, device), device)
    return split_by_time(times, schedule, flop_balanced_split(blocks, record, schedule.num_stages))


def averaged_over_ranks(times: StepTimes, device: torch.device) -> StepTimes:
    """The mean of every rank's ``times`` (collective; ``times`` itself outside a process group). An all-reduce
    hands every rank the same sum, so every rank balances the same numbers."""
    if not (dist.is_available() and dist.is_initialized()):
        return times
    values = torch.tensor([times.before, *times.blocks, times.after], dtype=torch.float64, device=device)
    dist.all_reduce(values)
    mean = (values / dist.get_world_size()).tolist()
    return StepTimes(mean[0], mean[1:-1], mean[-1], times.backward)


def measure_step(root: nn.Module, blocks: BlockList, run_step: Callable[[], Any], device: torch.device,
                 repeats: int = REPEATS, warmup: int = WARMUP) -> StepTimes:
    """Run ``run_step`` (forward; backward of the loss it returns) ``warmup + repeats`` times and return the median
    of each figure over the last ``repeats`` (see the module docstring)."""
    if any(parameter.is_meta for parameter in root.parameters()):
        raise ValueError(META_DEVICE)
    clock = _StepClock(blocks, device)
    handles = clock.attach(root)
    try:
        with _leaving_no_trace(root, device):
            samples = [clock.time_step(run_step) for _ in range(warmup + repeats)][warmup:]
    finally:
        for handle in handles:
            handle.remove()
    columns = list(zip(*(sample.blocks for sample in samples)))
    return StepTimes(statistics.median(s.before for s in samples), [statistics.median(c) for c in columns],
                     statistics.median(s.after for s in samples), samples[0].backward)


@contextlib.contextmanager
def _leaving_no_trace(root: nn.Module, device: torch.device) -> Iterator[None]:
    """Gradients on; the random streams and the buffers (the setup probe's isolation) and the parameters'
    gradients as they were afterwards."""
    parameters = [p for p in root.parameters() if p.requires_grad]
    kept_grads = [p.grad for p in parameters]
    try:
        with leaving_no_trace(root, device), torch.enable_grad():
            yield
    finally:
        for parameter, grad in zip(parameters, kept_grads):
            parameter.grad = grad


class _StepClock:
    """Hooks that timestamp one step's phases (see the module docstring); :meth:`time_step` runs one step."""

    def __init__(self, blocks: BlockList, device: torch.device) -> None:
        self.blocks, self.device = blocks, device
        self._reset()

    def _reset(self) -> None:
        count = len(self.blocks)
        self.model_start: Optional[float] = None
        self.forward = [[0.0, 0.0] for _ in range(count)]
        self.backward_start: dict[int, float] = {}  # the last of the block's output gradients in
        self.input_gradient: dict[int, float] = {}  # the first of its input gradients out
        self.parameter_gradient: dict[int, float] = {}  # the last of its parameter gradients accumulated

    def now(self) -> float:
        if self.device.type != "cpu":
            torch.accelerator.synchronize(self.device)  # the device's queued work belongs to what ran before
        return time.perf_counter()

    def attach(self, root: nn.Module) -> list[Any]:
        handles = [entry.register_forward_pre_hook(self._model_started) for entry in _model_entries(root, self.blocks)]
        owner = {id(p): index for index, block in enumerate(self.blocks) for p in block.parameters()}
        for index, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._block_started, index),
                                                           with_kwargs=True))
            handles.append(block.register_forward_hook(functools.partial(self._block_finished, index)))
        for parameter in root.parameters():
            if parameter.requires_grad:
                hook = functools.partial(self._gradient_accumulated, owner.get(id(parameter)))
                handles.append(parameter.register_post_accumulate_grad_hook(hook))
        return handles

    def _model_started(self, module: nn.Module, args: Any) -> None:
        if self.model_start is None:
            self.model_start = self.now()

    def _block_started(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._model_started(module, args)
        self.forward[index][0] = self.now()
        for tensor in _grad_leaves((args, kwargs)):
            tensor.register_hook(functools.partial(self._input_gradient, index))

    def _block_finished(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self.forward[index][1] = self.now()
        for tensor in _grad_leaves(output):
            tensor.register_hook(functools.partial(self._output_gradient, index))

    def _output_gradient(self, index: int, grad: Tensor) -> None:
        self.backward_start[index] = self.now()  # hooks fire in order: the last one in is the block's start

    def _input_gradient(self, index: int, grad: Tensor) -> None:
        self.input_gradient.setdefault(index, self.now())

    def _gradient_accumulated(self, index: Optional[int], parameter: Tensor) -> None:
        parameter.grad = None  # timing only: no gradient is kept, so the whole model's never exist at once
        if index is not None:
            self.parameter_gradient[index] = self.now()

    def time_step(self, run_step: Callable[[], Any]) -> StepTimes:
        """Run one step (and the backward of its loss) and return its phases' seconds."""
        self._reset()
        output = run_step()
        loss = output.get("loss") if isinstance(output, Mapping) else output
        backward = isinstance(loss, Tensor) and loss.requires_grad
        if backward:
            loss.backward()
        return self._sample(self.now(), backward)

    def _sample(self, step_end: float, backward: bool) -> StepTimes:
        last = len(self.blocks) - 1
        blocks = [stop - start + self._backward_seconds(i) for i, (start, stop) in enumerate(self.forward)]
        assert self.model_start is not None  # the first block's start starts the model at the latest
        first_done = self._backward_end(0)
        before = self.forward[0][0] - self.model_start + step_end - (first_done if first_done is not None else step_end)
        after = self.backward_start.get(last, step_end) - self.forward[last][1]  # head, loss and their backward
        return StepTimes(before, blocks, after, backward)

    def _backward_end(self, index: int) -> Optional[float]:
        ends = [t for t in (self.input_gradient.get(index), self.parameter_gradient.get(index)) if t is not None]
        return max(ends) if ends else None

    def _backward_seconds(self, index: int) -> float:
        start, end = self.backward_start.get(index), self._backward_end(index)
        return end - start if start is not None and end is not None else 0.0


def _model_entries(root: nn.Module, blocks: BlockList) -> list[nn.Module]:
    """Modules whose call starts the model's work: the root, the modules that contain the blocks and every child
    of those outside the blocks (embeddings, the head)."""
    entries: dict[int, nn.Module] = {}
    for module in root.modules():
        if not blocks.is_container(module) and any(blocks.is_container(m) for m in module.modules()):
            entries.update((id(m), m) for m in (module, *module.children()) if not blocks.is_container(m))
    return list(entries.values())


def _grad_leaves(value: Any) -> list[Tensor]:
    return [leaf for leaf in tree_leaves(value) if isinstance(leaf, Tensor) and leaf.requires_grad]
