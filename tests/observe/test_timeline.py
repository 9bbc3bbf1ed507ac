"""The measured bubble, the Gantt image and the Chrome trace of a pipelined step, on a hand-built ideal 1F1B step."""

from __future__ import annotations

import numpy as np
import pytest

from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.pipeline.step_recorder import ActionSpan, StepTimeline
from lightning_hybrid.observe.timeline import (
    KIND_COLOURS,
    aligned_actions,
    bubble_per_rank,
    render_timeline,
    timeline_bubble,
    to_chrome_trace,
)

#: Ideal 1F1B, p=2, m=2, forward 1 s, backward 2 s (common clock): (stage, microbatch, kind, start, end).
IDEAL_1F1B = {
    0: [(0, 0, "F", 0, 1), (0, 1, "F", 1, 2), (0, 0, "B", 4, 6), (0, 1, "B", 7, 9)],
    1: [(1, 0, "F", 1, 2), (1, 0, "B", 2, 4), (1, 1, "F", 4, 5), (1, 1, "B", 5, 7)],
}
RANK_1_ENTERS_AT = 0.5  # its own clock starts then; both leave the step at 9 s


def _timelines() -> list[StepTimeline]:
    timelines = []
    for rank, actions in IDEAL_1F1B.items():
        entered = RANK_1_ENTERS_AT if rank == 1 else 0.0
        spans = [ActionSpan(stage, mb, kind, start - entered, end - entered) for stage, mb, kind, start, end in actions]
        timelines.append(StepTimeline(rank, 9.0 - entered, spans))
    return timelines


def test_measured_bubble_of_an_ideal_1f1b_step_equals_the_theory() -> None:
    theory = PipelineSchedule.resolve("1f1b", pp=2, microbatches=2).theoretical_bubble()
    assert theory == pytest.approx(1 / 3)
    assert bubble_per_rank(_timelines()) == pytest.approx({0: 1 / 3, 1: 1 / 3})
    assert timeline_bubble(_timelines()) == pytest.approx(theory)


def test_ranks_are_aligned_at_the_end_of_the_step() -> None:
    step, actions = aligned_actions(_timelines())
    assert step == 9.0
    rank_1 = [(a.kind, a.microbatch, a.start, a.end) for rank, a in actions if rank == 1]
    assert rank_1 == [("F", 0, 1, 2), ("B", 0, 2, 4), ("F", 1, 4, 5), ("B", 1, 5, 7)]


def test_gantt_image_shows_actions_in_their_colours_and_idle_time_white() -> None:
    image = render_timeline(_timelines(), "1f1b")
    height, width, channels = image.shape
    assert (channels, image.dtype) == (3, np.uint8)
    left, scale, top, row = 70, (width - 70 - 10) / 9.0, 28, 36

    def pixel(rank: int, seconds: float) -> tuple[int, ...]:
        return tuple(int(c) for c in image[top + rank * row + row // 2 + 6, int(left + seconds * scale)])

    assert pixel(0, 0.9) == KIND_COLOURS["F"]
    assert pixel(0, 3.0) == (255, 255, 255)  # rank 0 waits for rank 1's first backward
    assert pixel(1, 3.5) == KIND_COLOURS["B"]
    assert pixel(1, 8.0) == (255, 255, 255)  # rank 1 is done, rank 0 drains


def test_chrome_trace_has_one_event_per_action_in_microseconds() -> None:
    events = to_chrome_trace(_timelines())["traceEvents"]
    actions = [e for e in events if e["ph"] == "X"]
    assert len(actions) == 8 and len(events) == 10  # + one thread name per rank
    last = max(actions, key=lambda e: e["ts"])
    assert (last["name"], last["tid"], last["ts"], last["dur"]) == ("B1", 0, 7e6, 2e6)


def test_the_first_timeline_is_drawn_after_warm_up_then_every_n_batches() -> None:
    from lightning_hybrid.observe.timeline import timeline_due

    due = lambda every, accumulation: [b for b in range(1, 41) if timeline_due(b, every, accumulation)]  # noqa: E731
    assert due(100, 1) == [3]  # a 40-batch run still gets one
    assert due(10, 1) == [3, 10, 20, 30, 40]
    assert due(4, 2) == [6, 8, 12, 16, 20, 24, 28, 32, 36, 40]  # the third optimizer step ends at batch 6
    assert due(None, 1) == []
