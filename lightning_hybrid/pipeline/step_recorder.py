"""What a pipeline rank did during a training step, action by action: the input of the measured bubble and the
timeline picture (:mod:`lightning_hybrid.observe`).

:class:`StepRecorder` wraps a ``PipelineStage``'s compute calls — the schedule's F (forward), B (full backward),
I (input gradients) and W (weight gradients) actions — and timestamps them while recording is on; CUDA events on
GPUs, where kernels run asynchronously.

Example::

    recorder = StepRecorder(device)
    recorder.wrap(stage)                     # once per PipelineStage
    recorder.start()                         # at the start of a step
    ...                                      # the schedule runs
    timeline = recorder.timeline(pp_rank)    # StepTimeline with one ActionSpan per action
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch


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


class StepRecorder:
    """Timestamps the compute actions of a rank's stages while :attr:`recording` is on."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._origin: Any = None
        self._marks: list[tuple[int, int, str, Any, Any]] = []
        #: Whether actions are being timestamped (the monitor turns this on).
        self.recording = False

    def now(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        self._marks = []
        self._origin = self.now()

    def timeline(self, pp_rank: int) -> StepTimeline:
        """The step recorded since :meth:`start`, ending now."""
        end = self.now()
        if self._cuda:
            torch.cuda.synchronize()
        actions = [ActionSpan(stage, microbatch, kind, self._seconds(start), self._seconds(stop))
                   for stage, microbatch, kind, start, stop in self._marks]
        return StepTimeline(pp_rank, self._seconds(end), actions)

    def wrap(self, stage: Any) -> None:
        """Make ``stage``'s forward / backward / weight-gradient calls record an action each while recording."""
        stage.forward_one_chunk = self._timed(stage, stage.forward_one_chunk, "F")
        stage.backward_one_chunk = self._timed(stage, stage.backward_one_chunk, "B")
        stage.backward_weight_one_chunk = self._timed(stage, stage.backward_weight_one_chunk, "W")

    def _timed(self, stage: Any, method: Callable[..., Any], kind: str) -> Callable[..., Any]:
        def run(chunk: int, *args: Any, **kwargs: Any) -> Any:
            if not self.recording:
                return method(chunk, *args, **kwargs)
            action = "I" if kind == "B" and not kwargs.get("full_backward", True) else kind
            start = self.now()
            try:
                return method(chunk, *args, **kwargs)
            finally:
                self._marks.append((stage.stage_index, chunk, action, start, self.now()))

        return run

    def _seconds(self, mark: Any) -> float:
        if self._cuda:
            return self._origin.elapsed_time(mark) / 1e3
        return mark - self._origin
