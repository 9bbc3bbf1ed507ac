"""See what a parallel run is doing: a Lightning callback that logs throughput, MFU, memory, pipeline bubble,
communication and gradient norm, and draws the pipeline's timeline.

:class:`ParallelMonitor` is added by :class:`~lightning_hybrid.HybridStrategy` when the trainer has a logger or a
progress bar (``HybridStrategy(monitor=False)`` turns it off, ``monitor=ParallelMonitor(...)`` configures it). Every
``log_every_n_steps`` batches rank 0 logs (TensorBoard tags):

* ``throughput/samples_per_sec``, ``throughput/tokens_per_sec``: samples of every data-parallel replica counted
  once (the tp × pp ranks of a replica share its batch; Lightning's ``ThroughputMonitor`` multiplies by the world
  size instead), ``throughput/step_time_sec``;
* ``flops/model_flops_per_batch`` (see :mod:`lightning_hybrid.observe.counting`: measured once, on the second batch),
  ``flops/tflops_per_sec_per_device`` and ``flops/mfu`` against the device's peak (Lightning's table for known
  GPUs, or ``peak_flops=``);
* ``memory/peak_gib_max``, ``memory/peak_gib_min`` over ranks and ``memory/peak_max_rank`` (the device allocator's
  peak on GPUs, the process's peak resident memory on CPUs);
* ``pipeline/bubble`` (mean over stages), ``pipeline/bubble_rank_<r>`` and ``pipeline/bubble_theory``: the share of
  the pipeline's step time a rank does not spend in its stages' forward/backward actions, next to the ideal
  schedule's (p−1)/(m·v+p−1) (GPipe, 1F1B, interleaved 1F1B and looped BFS; zero-bubble schedules have no
  closed form);
* ``comm/share_of_step`` (time in collectives, from a profile of the second batch, mean over ranks) and
  ``comm/bytes_per_batch/<collective>`` (the rank that moves the most);
* ``grad_norm``: the total gradient norm over all meshes and stages, before clipping;
* with expert parallelism, ``experts/...``: tokens per expert, imbalance over experts and over ep ranks,
  all-to-all bytes and share of the step (:mod:`lightning_hybrid.observe.experts`).

After the third optimizer step (the schedules built and warmed up), then every ``timeline_every_n_steps`` batches
(pipelines only), it adds an image ``pipeline/timeline`` — so a short run has one too: a Gantt chart of
each rank's forward (F), backward (B), input-gradient (I) and weight-gradient (W) actions per microbatch, and
with ``chrome_trace_dir`` also writes the same step as a Chrome trace (open in ``chrome://tracing`` or Perfetto).
At fit start it logs the layout, tensor-parallel plan, stage split and the planner's predicted ``plan/...`` figures
(:mod:`lightning_hybrid.observe.run_record`); ``profile_steps`` runs ``torch.profiler`` over a window of batches
and writes its trace to ``<log_dir>/profiler/`` (:class:`~lightning_hybrid.observe.profiling.TraceWindow`).
The progress bar shows one loss (the module's own when it shows one, else the step's ``loss``) and ``tokens/s``
over the last ``log_every_n_steps`` batches (:mod:`lightning_hybrid.observe.progress`).

Example::

    monitor = ParallelMonitor(peak_flops=1e12, timeline_every_n_steps=50, chrome_trace_dir="traces")
    trainer = Trainer(strategy=HybridStrategy(tp=2, pp=2, monitor=monitor), devices=4, logger=TensorBoardLogger("tb"))
"""

from __future__ import annotations

import json
import logging
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid._compat import tree_flatten
from lightning_hybrid.checks import check_positive
from lightning_hybrid.observe.counting import StepCounter
from lightning_hybrid.observe.experts import expert_metrics, take_expert_figures
from lightning_hybrid.observe.profiling import CommunicationProfile, TraceWindow, profile_window
from lightning_hybrid.observe.progress import ProgressFigures, place_before_progress_bar
from lightning_hybrid.observe.run_record import record_run
from lightning_hybrid.observe.timeline import (bubble_metrics, render_timeline, timeline_bubble, timeline_due,
                                               to_chrome_trace)
from lightning_hybrid.parallel.expert_step import spread_norms
from lightning_hybrid.parallel.grad_norm import total_grad_norm
from lightning_hybrid.pipeline.step_recorder import StepTimeline
from lightning_hybrid.planner.hardware_probe import device_peak_flops

log = logging.getLogger(__name__)

#: The batch measured for FLOPs and communication: the second, because the first also builds the pipeline's
#: schedules (shape inference) and warms up allocators.
MEASURED_BATCH = 1


@dataclass
class _Window:
    """This rank's measurements since the last log."""

    step_times: list[float] = field(default_factory=list)
    samples: int = 0
    tokens: int = 0
    timelines: list[StepTimeline] = field(default_factory=list)


class ParallelMonitor(pl.Callback):
    """Log throughput, MFU, memory, pipeline bubble, communication and gradient norm of a HybridStrategy run.

    Args:
        log_every_n_steps: Batches between logs (default: the trainer's ``log_every_n_steps`` optimizer steps, i.e.
            that many × ``accumulate_grad_batches`` batches, Lightning's own logging cadence); also the window of the
            progress bar's ``tokens/s``: tokens of the last ``log_every_n_steps`` measured batches over their time
            (the first two batches, which build the schedules and are profiled, are not measured).
        peak_flops: Peak FLOP/s of one device, for MFU. Default: Lightning's table for the GPU and precision in use;
            CPUs and unknown devices log achieved TFLOP/s without MFU unless this is given.
        timeline_every_n_steps: Batches between pipeline timeline images, the first after the third optimizer step
            (``None``: never).
        chrome_trace_dir: Also write each timeline step as ``step_<N>.json`` (Chrome trace format) here.
        batch_tokens: ``batch -> number of tokens``. Default: the element count of the batch's first integer tensor
            with two or more dimensions (token ids); batches without one log samples only.
        predict: Log the planner's predicted memory, tokens/s, step time and MFU of the layout as ``plan/...``
            (a fixed layout is measured and estimated at setup: one partial forward and, on CPUs, a 0.1 s probe).
        profile_steps: ``N``: profile the ``N`` batches after the monitor's own measured (second) batch;
            ``(start, end)``: batches ``start`` … ``end - 1`` of this fit (a window over batch 1 leaves out
            ``comm/share_of_step``); ``None``: no profile. The trace goes to ``<log_dir>/profiler/``.

    Example::

        Trainer(strategy=HybridStrategy(pp=2, monitor=ParallelMonitor(peak_flops=2e12)), logger=TensorBoardLogger("tb"))
    """

    def __init__(
        self,
        log_every_n_steps: Optional[int] = None,
        peak_flops: Optional[float] = None,
        timeline_every_n_steps: Optional[int] = 100,
        chrome_trace_dir: Optional[Union[str, Path]] = None,
        batch_tokens: Optional[Callable[[Any], int]] = None,
        predict: bool = True,
        profile_steps: Union[None, int, tuple[int, int]] = None,
    ) -> None:
        for name, value in (("log_every_n_steps", log_every_n_steps), ("timeline_every_n_steps", timeline_every_n_steps),
                            ("peak_flops", peak_flops)):
            if value is not None:
                check_positive("ParallelMonitor", name, value, integer=name != "peak_flops", also=" or None")
        self.log_every_n_steps = log_every_n_steps
        self.peak_flops = peak_flops
        self.timeline_every_n_steps = timeline_every_n_steps
        self.chrome_trace_dir = Path(chrome_trace_dir) if chrome_trace_dir is not None else None
        self.batch_tokens = batch_tokens or default_batch_tokens
        self.predict, self.profile_steps = bool(predict), profile_window(profile_steps, MEASURED_BATCH)
        self._trace: Optional[TraceWindow] = None
        self._window = _Window()
        self._batches = 0
        self._step_start = 0.0
        self._counter: Optional[StepCounter] = None
        self._profile: Optional[CommunicationProfile] = None
        self._measured: dict[str, Any] = {}
        self._grad_norm: Optional[Tensor] = None  # on the device; read back only where it is logged
        self._peak_warned = False
        self._progress = ProgressFigures()

    # ------------------------------------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._trace = record_run(trainer, pl_module, self.predict, self.profile_steps)
        take_expert_figures(trainer.strategy)  # what the setup checks routed is not training

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._trace is not None:
            self._trace.close()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None:
            pipeline.record_timeline = True
        if self._batches == MEASURED_BATCH:
            self._start_measuring(trainer)
        if self._trace is not None:
            self._trace.before_batch(self._batches)
        _synchronize(trainer)
        self._step_start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        _synchronize(trainer)
        elapsed = time.perf_counter() - self._step_start
        every = self._batches_between_logs(trainer)
        if self._counter is not None:
            self._stop_measuring(trainer, elapsed)
        elif self._batches > 0:  # the first batch builds schedules and warms up; the measured one runs slower
            self._add_to_window(trainer, batch, elapsed, every)
        self._progress.show(trainer, pl_module, outputs, _data_parallel_size(trainer))
        if self._trace is not None:
            self._trace.after_batch(self._batches)
        self._batches += 1
        if self._batches % every == 0:  # also with nothing timed yet: memory and the step's gradient norm
            self._log_window(trainer)
        if timeline_due(self._batches, self.timeline_every_n_steps, trainer.accumulate_grad_batches):
            self._log_timeline(trainer)

    def _batches_between_logs(self, trainer: pl.Trainer) -> int:
        # Lightning's log_every_n_steps counts optimizer steps, each accumulate_grad_batches batches: logging on the
        # same cadence keeps the monitor's all-rank gathers as rare as Lightning's own logging.
        return self.log_every_n_steps or trainer.log_every_n_steps * trainer.accumulate_grad_batches

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        every = self._batches_between_logs(trainer)
        batches_to_log = -(self._batches + 1) % every
        # The norm communicates, so it is computed on the last optimizer step before each log only (the same step
        # on every rank: the counters agree).
        if batches_to_log < trainer.accumulate_grad_batches:
            pipeline = getattr(trainer.strategy, "pipeline", None)
            group, elsewhere = (pipeline.pp_group, pipeline.counted_elsewhere()) if pipeline is not None else (None, ())
            self._grad_norm = total_grad_norm(pl_module.parameters(), pipeline_group=group, counted_elsewhere=elsewhere,
                                              device=trainer.strategy.root_device,
                                              spread=spread_norms(trainer.strategy))

    def _add_to_window(self, trainer: pl.Trainer, batch: Any, elapsed: float, every: int) -> None:
        samples, tokens = batch_size(batch), self.batch_tokens(batch)
        self._window.step_times.append(elapsed)
        self._window.samples += samples
        self._window.tokens += tokens
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is not None and pipeline.last_timeline is not None:
            self._window.timelines.append(pipeline.last_timeline.summary())
        self._progress.add_batch(tokens or samples, elapsed, window=every, tokens=bool(tokens))

    # ---------------------------------------------------------------------------------------- measurement
    def _start_measuring(self, trainer: pl.Trainer) -> None:
        if self._trace is None or not self._trace.covers(MEASURED_BATCH):  # else it profiles this batch
            self._profile = CommunicationProfile.start(trainer.strategy.root_device)
        dims = getattr(trainer.strategy, "dims", None)
        self._counter = StepCounter(trainer.lightning_module, tensor_parallel=dims.tp if dims is not None else 1)
        self._counter.__enter__()

    def _stop_measuring(self, trainer: pl.Trainer, elapsed: float) -> None:
        assert self._counter is not None
        self._counter.__exit__(None, None, None)
        communication = float("nan")
        if self._profile is not None:
            communication = self._profile.stop()
        per_rank = _gather_to_rank_0(
            trainer, (self._counter.model_flops, dict(self._counter.comm_bytes), communication / elapsed)
        )
        self._counter, self._profile = None, None
        if per_rank is None:
            return
        busiest: dict[str, int] = {}
        for _, comm_bytes, _ in per_rank:
            for kind, count in comm_bytes.items():
                busiest[kind] = max(busiest.get(kind, 0), count)
        self._measured = {
            "model_flops": sum(flops for flops, _, _ in per_rank),
            "comm_bytes": busiest,
            "comm_share": sum(share for _, _, share in per_rank) / len(per_rank),
        }

    def _log_window(self, trainer: pl.Trainer) -> None:
        window, self._window = self._window, _Window()
        pipeline = getattr(trainer.strategy, "pipeline", None)
        summary = {
            "peak_memory": _peak_memory_bytes(trainer.strategy.root_device),
            "timelines": window.timelines,
            "pipeline": tuple(pipeline.pp_ranks) if pipeline is not None else None,
            "experts": take_expert_figures(trainer.strategy),
        }
        per_rank = _gather_to_rank_0(trainer, summary)
        grad_norm, self._grad_norm = self._grad_norm, None
        if per_rank is None or not trainer.loggers:
            return
        metrics = self._timed_metrics(trainer, window, pipeline, per_rank) if window.step_times else {}
        peaks = [rank["peak_memory"] for rank in per_rank]
        metrics["memory/peak_gib_max"] = max(peaks) / 2**30
        metrics["memory/peak_gib_min"] = min(peaks) / 2**30
        metrics["memory/peak_max_rank"] = float(peaks.index(max(peaks)))
        if grad_norm is not None:
            metrics["grad_norm"] = float(grad_norm)  # the one host read of the norm: rank 0, when it logs
        dims = getattr(trainer.strategy, "dims", None)
        metrics.update(expert_metrics([rank["experts"] for rank in per_rank], len(window.step_times),
                                      sum(window.step_times), dims.tp if dims is not None else 1))
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def _timed_metrics(self, trainer: pl.Trainer, window: _Window, pipeline: Any, per_rank: list[dict]
                       ) -> dict[str, float]:
        """Throughput, FLOPs and bubble of the window's timed batches."""
        step_time = sum(window.step_times) / len(window.step_times)
        replicas = _data_parallel_size(trainer)
        metrics = {
            "throughput/step_time_sec": step_time,
            "throughput/samples_per_sec": window.samples * replicas / sum(window.step_times),
        }
        if window.tokens:
            metrics["throughput/tokens_per_sec"] = window.tokens * replicas / sum(window.step_times)
        metrics.update(self._flops_metrics(trainer, step_time))
        if pipeline is not None:
            metrics.update(bubble_metrics(pipeline, per_rank))
        return metrics

    def _flops_metrics(self, trainer: pl.Trainer, step_time: float) -> dict[str, float]:
        if not self._measured:
            return {}
        metrics = {"flops/model_flops_per_batch": self._measured["model_flops"]}
        if not math.isnan(self._measured["comm_share"]):
            metrics["comm/share_of_step"] = self._measured["comm_share"]
        for kind, count in self._measured["comm_bytes"].items():
            metrics[f"comm/bytes_per_batch/{kind}"] = float(count)
        per_device = self._measured["model_flops"] / step_time / trainer.world_size
        metrics["flops/tflops_per_sec_per_device"] = per_device / 1e12
        peak = self.peak_flops or _device_peak_flops(trainer)
        if peak:
            metrics["flops/mfu"] = per_device / peak
        elif not self._peak_warned:
            self._peak_warned = True
            log.info(
                "ParallelMonitor: the peak FLOP/s of %s is unknown; pass ParallelMonitor(peak_flops=...) to log MFU.",
                trainer.strategy.root_device,
            )
        return metrics

    def _log_timeline(self, trainer: pl.Trainer) -> None:
        pipeline = getattr(trainer.strategy, "pipeline", None)
        if pipeline is None:
            return
        # Rank 0 draws its own pipeline: only that pipeline's ranks send their step's actions.
        in_first_pipeline = pipeline.pp_ranks == trainer.strategy.broadcast(pipeline.pp_ranks)
        timelines = _gather_to_rank_0(trainer, pipeline.last_timeline if in_first_pipeline else None)
        if timelines is None:
            return
        own = [timelines[rank] for rank in pipeline.pp_ranks]
        if any(timeline is None for timeline in own):
            return
        step = trainer.global_step
        schedule = pipeline.schedule
        theory = schedule.theoretical_bubble()
        title = (
            f"{schedule.name}, pp={schedule.pp}, v={schedule.virtual_stages}, m={schedule.microbatches}, step {step}:"
            f" measured bubble {timeline_bubble(own):.3f}" + (f", theory {theory:.3f}" if theory is not None else "")
        )
        image = render_timeline(own, title)
        for logger in trainer.loggers:
            experiment = getattr(logger, "experiment", None)
            if hasattr(experiment, "add_image"):
                experiment.add_image("pipeline/timeline", image, global_step=step, dataformats="HWC")
        if self.chrome_trace_dir is not None:
            self.chrome_trace_dir.mkdir(parents=True, exist_ok=True)
            (self.chrome_trace_dir / f"step_{step}.json").write_text(json.dumps(to_chrome_trace(own)))


# ------------------------------------------------------------------------------------------------------ helpers
def add_monitor(trainer: pl.Trainer, monitor: Union[bool, ParallelMonitor]) -> None:
    """What ``HybridStrategy(monitor=...)`` adds to the trainer's callbacks: the given monitor, or with ``True`` a
    default one when something shows it (a logger or the progress bar); nothing when one is there already."""
    if not any(isinstance(callback, ParallelMonitor) for callback in trainer.callbacks):
        if isinstance(monitor, ParallelMonitor):
            trainer.callbacks.append(monitor)
        elif monitor and (trainer.loggers or trainer.progress_bar_callback is not None):
            trainer.callbacks.append(ParallelMonitor())
    for callback in [c for c in trainer.callbacks if isinstance(c, ParallelMonitor)]:
        place_before_progress_bar(trainer, callback)  # its figures drawn with the batch they belong to


def default_batch_tokens(batch: Any) -> int:
    """Elements of the batch's first integer tensor with ≥ 2 dimensions (token ids), else 0."""
    for value in tree_flatten(batch)[0]:
        if isinstance(value, Tensor) and value.dim() >= 2 and not value.is_floating_point() and not value.is_complex():
            return value.numel()
    return 0


def batch_size(batch: Any) -> int:
    """Length of the first dimension of the batch's first tensor."""
    for value in tree_flatten(batch)[0]:
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0]
    return 0


def _data_parallel_size(trainer: pl.Trainer) -> int:
    data_mesh = getattr(trainer.strategy, "data_mesh", None)
    return data_mesh.size() if data_mesh is not None else trainer.world_size


def _gather_to_rank_0(trainer: pl.Trainer, value: Any) -> Optional[list[Any]]:
    """Every rank's ``value`` on global rank 0 (which logs); ``None`` on the other ranks."""
    if not (dist.is_available() and dist.is_initialized()):  # a single-device run under another strategy
        return [value]
    gathered: Optional[list[Any]] = [None] * trainer.world_size if trainer.global_rank == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered


def _synchronize(trainer: pl.Trainer) -> None:
    if trainer.strategy.root_device.type == "cuda":
        torch.cuda.synchronize(trainer.strategy.root_device)


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB, macOS bytes


def _device_peak_flops(trainer: pl.Trainer) -> Optional[float]:
    precision = str(getattr(trainer.precision_plugin, "precision", "32-true"))
    return device_peak_flops(trainer.strategy.root_device, precision)

