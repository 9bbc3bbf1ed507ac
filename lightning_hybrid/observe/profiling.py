"""The monitor's profile of one batch: the wall time its collectives took (:class:`CommunicationProfile`).

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
from typing import Iterator, Optional

import torch
from torch.profiler import ProfilerActivity, profile

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
