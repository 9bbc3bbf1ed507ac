"""The monitor's profile of one batch: the wall time its collectives took (:class:`CommunicationProfile`); and
``ParallelMonitor(profile_steps=...)``'s window of batches written as a trace (:class:`TraceWindow`).

torch's profiler (kineto) writes two lines to the process's standard error each time it starts and stops::

    USDT:2026-12-02 04:25:01 2648:2648 SyncActivityProfilerHandler.cpp:52] profiler_start
    USDT:2026-12-02 04:25:02 2648:2648 SyncActivityProfilerHandler.cpp:59] profiler_stop

markers for tracing tools, printed whatever ``KINETO_LOG_LEVEL`` short of turning all of kineto's messages off
(its warnings and errors too, and for the whole process: it is read once, at the first profile). The monitor
profiles one batch on every rank, so each run printed 2 × world-size of them among the progress bar. Around the
profiler's start and stop only, standard error (the file descriptor, where kineto's C++ logging goes) is captured
and written back without those two markers: anything else written there meanwhile, by kineto or by another
thread, is passed on as it was.

Example::

    profile = CommunicationProfile.start(torch.device("cpu"))   # None if another profiler is running
    ...                                                          # one training batch
    seconds = profile.stop()
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

log = logging.getLogger(__name__)

#: Substrings of the profiler events that are collectives (gloo's threads, NCCL kernels, c10d's ops).
COMMUNICATION_EVENTS = ("gloo:", "nccl", "c10d::")
#: kineto's start and stop markers (see the module docstring); nothing else it writes is dropped.
KINETO_MARKER = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def without_kineto_markers() -> Iterator[None]:
    """Run the block with standard error's file descriptor captured, then write back what the block wrote there
    except kineto's start/stop markers. Without a standard error to capture the block just runs."""
    _flush_python_stderr()
    try:
        saved = os.dup(2)
    except OSError:  # no file descriptor 2 (a daemon, pythonw): nothing would print the markers either
        yield
        return
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            _flush_python_stderr()  # what Python wrote meanwhile belongs to the captured part
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = b"".join(line for line in captured.read().splitlines(keepends=True) if not KINETO_MARKER.match(line))
            while kept:
                kept = kept[os.write(2, kept):]


def _flush_python_stderr() -> None:
    if sys.stderr is not None:
        sys.stderr.flush()


def communication_seconds(profiler: profile) -> float:
    """Wall time covered by collective events, overlapping events counted once."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in profiler.events()
        if any(marker in event.name.lower() for marker in COMMUNICATION_EVENTS)
    )
    covered, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop <= end:
            continue
        covered += stop - max(start, end)
        end = stop
    return covered / 1e6  # profiler times are microseconds


class CommunicationProfile:
    """A running torch profile of this rank's CPU (and CUDA) activity, whose collectives :meth:`stop` measures."""

    def __init__(self, profiler: profile) -> None:
        self._profiler = profiler

    @classmethod
    def start(cls, device: torch.device) -> Optional["CommunicationProfile"]:
        """Start profiling; ``None`` when torch refuses (e.g. ``Trainer(profiler="pytorch")`` already runs one)."""
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        try:
            profiler = profile(activities=activities)
            with without_kineto_markers():
                profiler.__enter__()
        except RuntimeError as error:
            log.info("ParallelMonitor: no communication share (%s).", error)
            return None
        return cls(profiler)

    def stop(self) -> float:
        """Stop profiling; the seconds spent in collectives meanwhile."""
        with without_kineto_markers():
            self._profiler.__exit__(None, None, None)
        return communication_seconds(self._profiler)


def profile_window(profile_steps: Union[None, int, Sequence[int]], measured_batch: int) -> Optional[range]:
    """The batches ``ParallelMonitor(profile_steps=...)`` profiles: ``N`` the ``N`` after the monitor's own
    ``measured_batch``, ``(start, end)`` batches ``start`` to ``end - 1`` (counted from 0 at the fit's first batch),
    ``None`` none. Raises ``ValueError`` for anything else."""
    if profile_steps is None:
        return None
    if isinstance(profile_steps, int) and not isinstance(profile_steps, bool):
        if profile_steps < 1:
            raise ValueError(f"ParallelMonitor(profile_steps={profile_steps!r}) must be a number of batches ≥ 1,"
                             " a (start, end) pair of batch indices or None.")
        return range(measured_batch + 1, measured_batch + 1 + profile_steps)
    pair = tuple(profile_steps) if isinstance(profile_steps, (list, tuple)) else ()
    if len(pair) != 2 or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair) or not (
            0 <= pair[0] < pair[1]):
        raise ValueError(f"ParallelMonitor(profile_steps={profile_steps!r}) must be a number of batches ≥ 1 or a"
                         " (start, end) pair of batch indices with 0 ≤ start < end (end excluded), e.g. (10, 13).")
    if measured_batch in range(*pair):
        rank_zero_info(f"ParallelMonitor(profile_steps={profile_steps!r}) profiles batch {measured_batch}, where the"
                       " monitor's own profile measures comm/share_of_step: that figure is left out of this run.")
    return range(pair[0], pair[1])


class TraceWindow:
    """``torch.profiler`` over a window of batches on every rank, written on its last batch as
    ``<folder>/rank<r>.<ns>.pt.trace.json`` by ``tensorboard_trace_handler`` (TensorBoard's profile plugin,
    Perfetto, ``chrome://tracing``), kineto's start/stop markers kept off the console."""

    def __init__(self, batches: range, folder: Path, rank: int, device: torch.device) -> None:
        self.batches, self.folder, self.rank, self.device = batches, folder, rank, device
        self._profiler: Optional[profile] = None
        self.written = False

    def covers(self, batch: int) -> bool:
        return batch in self.batches

    def before_batch(self, batch: int) -> None:
        if batch != self.batches.start or self.written:
            return
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        profiler = profile(activities=activities,
                           on_trace_ready=tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}"))
        try:
            with without_kineto_markers():
                profiler.__enter__()
        except RuntimeError as error:  # another profiler runs (Trainer(profiler="pytorch"))
            log.warning("ParallelMonitor(profile_steps=...): no trace (%s).", error)
            self.written = True
            return
        self._profiler = profiler

    def after_batch(self, batch: int) -> None:
        if batch == self.batches.stop - 1:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when training ends inside the window)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        with without_kineto_markers():
            profiler.__exit__(None, None, None)
        self.written = True
