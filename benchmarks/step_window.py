"""What one rank of ``benchmarks/compare.py`` measures over a step, the same way on every side.

A step runs from the end of the previous one to its own end: from one ``on_train_batch_end`` to the next (Lightning),
from one loop iteration's end to the next (the hand-written loop). Data fetch, forward, backward, optimizer, LR
scheduler and the framework's own per-step work (for Lightning 2.6.6 also the sigterm-flag broadcast it issues before
every batch, ``training_epoch_loop.py:_broadcast_sigterm_tensor``) all fall inside; timing, counting and memory
tracking use this same window (:class:`StepWindows`: warm-up steps, then the timed steps, then one counted step, then
one memory-tracked step).

Step time
    ``time.perf_counter()`` at each step's end (:class:`RankRecord` ``step_ends``).
CPU time per step
    ``time.process_time()`` of the rank's process (all its threads, gloo's included) at the same step ends. It is the
    work a side does per step, and far less sensitive than wall time to other processes taking turns on the cores
    (not to cache or memory-bandwidth contention); it excludes time spent waiting, so a side that waits longer
    (pipeline bubble, a slow peer) is only seen in wall time.
Peak memory
    Tensor bytes, not the process's RSS: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a
    TorchDispatchMode following every storage by weak reference) over the step after the counted one. Existing
    storages are registered at entry (parameters, current gradients, optimizer state, the pipeline's persistent
    receive buffers), so the peak is of everything alive: parameters + gradients + optimizer state + activations +
    temporaries + gathered parameters and communication buffers + the batch. Module hooks and the optimizer hook
    are off (:func:`make_peak_tracker`: a pipeline stage runs once per microbatch, which MemTracker's per-module
    bookkeeping refuses, and Lightning runs forward inside ``optimizer.step``); the phase of the peak and its
    breakdown by category are kept.
Communication
    ``lightning_hybrid.observe.counting.StepCounter`` around the step after the timed ones: bytes of the full tensor
    each collective works on, per collective type. :func:`make_comm_counter` also counts calls per type (``barrier``
    included: no payload, but a synchronization of all ranks) and books collectives on 1-rank process groups apart
    (no byte leaves the process).
Python overhead (``--profile``)
    cProfile of the rank's timed steps: the Python function calls per step are a deterministic measure of framework
    work in Python, where time on a shared machine is not. The profiler slows Python-heavy sides more, so step times
    of such a run are distorted.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor


def make_comm_counter() -> Any:
    """``StepCounter`` that books collectives on 1-rank process groups apart (``local_bytes``): they move no data.
    (Subclassed here, on first use, so the parent process never imports ``lightning_hybrid``.)"""
    import torch.distributed as dist

    from lightning_hybrid.observe.counting import COLLECTIVE_TYPES, StepCounter

    class _CommCounter(StepCounter):
        def __init__(self) -> None:
            super().__init__()
            #: Calls per collective type on groups of more than one rank (``barrier`` included: it moves no
            #: payload but synchronizes the ranks, which StepCounter's byte count does not show).
            self.calls: dict[str, int] = defaultdict(int)
            self.local_bytes: dict[str, int] = defaultdict(int)
            self.local_calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            if func.namespace not in ("c10d", "_c10d_functional"):
                return super().__torch_dispatch__(func, types, args, kwargs)
            before = dict(self.comm_bytes)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = func._overloadpacket.__name__
            kind = COLLECTIVE_TYPES.get(name, "barrier" if name == "barrier" else None)
            if kind is None:  # wait_tensor and the like
                return out
            if _group_size(dist, func, args) == 1:
                self.local_calls[kind] += 1
                for moved_kind, value in list(self.comm_bytes.items()):
                    moved = value - before.get(moved_kind, 0)
                    if moved:
                        self.comm_bytes[moved_kind] -= moved
                        self.local_bytes[moved_kind] += moved
            else:
                self.calls[kind] += 1
            return out

    return _CommCounter()


def _group_size(dist: Any, func: Any, args: tuple) -> Optional[int]:
    """Size of the process group a collective runs on: a ProcessGroup script object (c10d ops) or a group name
    (functional collectives, the last string argument)."""
    if func.namespace == "c10d":
        for value in args:
            if isinstance(value, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(value).size()
                except RuntimeError:  # another script object (a ReduceOp)
                    continue
        return None
    for value in reversed(args):
        if isinstance(value, str):
            try:
                return dist.distributed_c10d._resolve_process_group(value).size()
            except Exception:
                continue
    return None


def make_peak_tracker() -> Any:
    """MemTracker without module hooks: only the peak of the total tensor bytes is read (see the module doc)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchmarks.memory import EngineOnly

    class PeakTracker(MemTracker):
        """Also notes the phase of the step the peak falls in and its breakdown by MemTracker's categories:
        storages existing at entry (``Parameter``, ``Gradient``, ``Optstate``), created in forward (``Activation``:
        activations, gathered parameters) or in backward (``Temp``: new gradients, activation gradients)."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = EngineOnly()  # type: ignore[assignment]
            self._backward_seen = False
            self.peak_phase = "entry"

        def _register_global_optimizer_hook(self) -> None:
            # MemTracker files everything inside optimizer.step() as optimizer state; Lightning runs forward and
            # backward inside optimizer.step(closure), which would blur the breakdown.
            pass

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = self.peak_bytes()
            super()._update_peak_stats(peak_state)
            backward = self._mod_tracker.is_bw
            self._backward_seen |= backward
            if self.peak_bytes() > before:
                self.peak_phase = "backward" if backward else "optimizer step" if self._backward_seen else "forward"

        def peak_bytes(self) -> int:
            # Meta-device "storages" (the pipeline's shape-only stand-ins) hold no memory.
            return sum(total for device, total in self._peak_mem.items() if device.type != "meta")

        def peak_breakdown(self) -> dict[str, int]:
            result: dict[str, int] = defaultdict(int)
            for device, snapshot in self._peak_mem_snap.items():
                if device.type != "meta":
                    for key, value in snapshot.items():
                        name = str(getattr(key, "value", key))
                        if value and name != "Total":
                            result[name] += value
            return dict(result)

    return PeakTracker()


def pipeline_receive_buffers(stages: Iterable[Any]) -> list[Tensor]:
    """The receive buffers a ``PipelineStage`` holds now (private attributes): torch's stage allocates one per
    microbatch and keeps it; HybridStrategy's holds meta placeholders except for the messages in flight."""
    buffers: list[Tensor] = []
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            buffers += [info.buffer for info in infos
                        if isinstance(getattr(info, "buffer", None), Tensor) and not info.buffer.is_meta]
    return buffers


@dataclass
class RankRecord:
    """What one rank of one launch measured (written as JSON)."""

    rank: int
    step_ends: list[float] = field(default_factory=list)
    step_cpu_ends: list[float] = field(default_factory=list)
    losses: list[Optional[float]] = field(default_factory=list)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)
    local_comm_bytes: dict[str, int] = field(default_factory=dict)
    local_comm_calls: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class StepWindows:
    """Which steps are timed, counted, memory-tracked (and profiled), and the contexts that do it (shared by every
    side)."""

    def __init__(self, warmup_steps: int, timed_steps: int, record: RankRecord,
                 profile_to: Optional[Path] = None) -> None:
        self.warmup_steps = warmup_steps
        self.count_step = warmup_steps + timed_steps
        self.memory_step = self.count_step + 1
        self.total_steps = self.memory_step + 1
        self.record = record
        self._counter: Any = None
        self._tracker: Any = None
        self._profile_to = profile_to
        self._profiler: Any = None

    def begin(self, step: int, track: Callable[[], list[Any]]) -> None:
        """Before step ``step``'s work; ``track()`` lists what exists already (modules, optimizers, tensors)."""
        if step == self.warmup_steps and self._profile_to is not None:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()
        if step == self.count_step:
            self._counter = make_comm_counter()
            self._counter.__enter__()
        elif step == self.memory_step:
            self._tracker = make_peak_tracker()
            # Modules bring their parameters, buffers and current gradients; optimizers their state.
            self._tracker.track_external(*track())
            self._tracker.__enter__()

    def end(self, step: int, loss: Optional[float]) -> None:
        """After step ``step``'s work (optimizer step included)."""
        self.record.step_ends.append(time.perf_counter())
        self.record.step_cpu_ends.append(time.process_time())
        self.record.losses.append(loss)
        if self._profiler is not None and step == self.count_step - 1:  # the timed steps, and only those
            self._profiler.disable()
            self._profiler.dump_stats(self._profile_to)
            self._profiler = None
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.record.comm_bytes = {k: v for k, v in self._counter.comm_bytes.items() if v}
            self.record.comm_calls = dict(self._counter.calls)
            self.record.local_comm_bytes = dict(self._counter.local_bytes)
            self.record.local_comm_calls = dict(self._counter.local_calls)
            self._counter = None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.record.peak_bytes = self._tracker.peak_bytes()
            self.record.info["peak_phase"] = self._tracker.peak_phase
            self.record.info["peak_breakdown"] = self._tracker.peak_breakdown()
            self._tracker = None
