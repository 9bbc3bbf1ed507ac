"""Pictures of one pipelined step: a Gantt chart image and a Chrome trace of every rank's compute actions.

Input is one :class:`~lightning_hybrid.pipeline.step_recorder.StepTimeline` per pipeline rank, for the same step. Each rank timed
its actions from its own start of the step, and all ranks leave the step together (its closing broadcast), so the
timelines are aligned at their ends: a rank that entered later is shifted right by the difference in durations.

Example::

    image = render_timeline(timelines, "1f1b, pp=2, m=4")    # H × W × 3 uint8, for SummaryWriter.add_image
    Path("step.json").write_text(json.dumps(to_chrome_trace(timelines)))
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
from PIL import Image, ImageDraw

from lightning_hybrid.pipeline.step_recorder import ActionSpan, StepTimeline

#: Colours of the action kinds: forward, full backward, input-gradient backward, weight-gradient backward.
KIND_COLOURS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (251, 188, 5), "W": (234, 67, 53)}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}
_WIDTH, _ROW, _LEFT, _TOP, _BOTTOM = 1200, 36, 70, 28, 30


def aligned_actions(timelines: list[StepTimeline]) -> tuple[float, list[tuple[int, ActionSpan]]]:
    """The pipeline's step length and every ``(pp_rank, action)`` with times on the common, end-aligned clock."""
    step = max(timeline.duration for timeline in timelines)
    shifted = []
    for timeline in timelines:
        offset = step - timeline.duration
        for action in timeline.actions:
            shifted.append((timeline.pp_rank, ActionSpan(action.stage, action.microbatch, action.kind,
                                                         action.start + offset, action.end + offset)))
    return step, shifted


def bubble_per_rank(timelines: list[StepTimeline]) -> dict[int, float]:
    """Each rank's share of the pipeline's step (the longest duration, ends being aligned) spent outside its
    compute actions: waiting for the neighbouring stages, communicating, and the step's bookkeeping."""
    step = max(timeline.duration for timeline in timelines)
    return {timeline.pp_rank: 1.0 - (timeline.busy or 0.0) / step for timeline in timelines}


def timeline_bubble(timelines: list[StepTimeline]) -> float:
    """The mean of :func:`bubble_per_rank` over the ranks."""
    bubbles = bubble_per_rank(timelines)
    return sum(bubbles.values()) / len(bubbles)


def bubble_metrics(pipeline: Any, per_rank: list[dict]) -> dict[str, float]:
    """Bubble per pipeline rank over the monitor's window (``per_rank``: each rank's ``{"pipeline": its pipeline's
    ranks, "timelines": [StepTimeline]}``), averaged over the pipelines of the mesh."""
    by_pipeline: dict[tuple[int, ...], dict[int, list[StepTimeline]]] = {}
    for summary in per_rank:
        for timeline in summary["timelines"]:
            by_pipeline.setdefault(summary["pipeline"], {}).setdefault(timeline.pp_rank, []).append(timeline)
    bubbles: dict[int, list[float]] = {}
    for ranks in by_pipeline.values():
        steps = min(len(timelines) for timelines in ranks.values())
        if len(ranks) != pipeline.schedule.pp or steps == 0:
            continue
        for step in range(steps):
            for pp_rank, bubble in bubble_per_rank([ranks[r][step] for r in sorted(ranks)]).items():
                bubbles.setdefault(pp_rank, []).append(bubble)
    if not bubbles:
        return {}
    metrics = {f"pipeline/bubble_rank_{r}": sum(v) / len(v) for r, v in sorted(bubbles.items())}
    metrics["pipeline/bubble"] = sum(metrics.values()) / len(metrics)
    theory = pipeline.schedule.theoretical_bubble()
    if theory is not None:
        metrics["pipeline/bubble_theory"] = theory
    return metrics


def render_timeline(timelines: list[StepTimeline], title: str) -> np.ndarray:
    """A Gantt chart: one row per pipeline rank, one box per action labelled ``<kind><microbatch>`` (``s<stage>``
    added when a rank runs several stages), idle time left white."""
    step, actions = aligned_actions(timelines)
    ranks = sorted(timeline.pp_rank for timeline in timelines)
    several_stages = len({action.stage for _, action in actions}) > len(ranks)
    height = _TOP + _ROW * len(ranks) + _BOTTOM
    image = Image.new("RGB", (_WIDTH, height), "white")
    draw = ImageDraw.Draw(image)
    draw.text((4, 6), title, fill="black")
    scale = (_WIDTH - _LEFT - 10) / step if step > 0 else 0.0
    for row, rank in enumerate(ranks):
        top = _TOP + row * _ROW
        draw.text((4, top + _ROW // 3), f"rank {rank}", fill="black")
        draw.line([(_LEFT, top + _ROW - 2), (_WIDTH - 10, top + _ROW - 2)], fill=(220, 220, 220))
    for rank, action in actions:
        top = _TOP + ranks.index(rank) * _ROW
        left, right = _LEFT + action.start * scale, _LEFT + action.end * scale
        draw.rectangle([left, top + 3, max(right, left + 1), top + _ROW - 5], fill=KIND_COLOURS[action.kind],
                       outline="black")
        label = f"{action.kind}{action.microbatch}" + (f"s{action.stage}" if several_stages else "")
        if right - left > 6 * len(label):
            draw.text((left + 2, top + _ROW // 3), label, fill="white")
    legend = "   ".join(f"{kind} = {name}" for kind, name in _KIND_NAMES.items())
    draw.text((_LEFT, height - _BOTTOM + 8), f"{legend}   white = idle   step = {step * 1e3:.1f} ms", fill="black")
    return np.asarray(image)


def to_chrome_trace(timelines: list[StepTimeline]) -> dict[str, Any]:
    """The step in Chrome's trace-event format: one thread per pipeline rank, one complete event per action."""
    _, actions = aligned_actions(timelines)
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": rank, "args": {"name": f"pipeline rank {rank}"}}
        for rank in sorted(timeline.pp_rank for timeline in timelines)
    ]
    for rank, action in actions:
        events.append({
            "name": f"{action.kind}{action.microbatch}",
            "cat": _KIND_NAMES[action.kind],
            "ph": "X",
            "pid": 0,
            "tid": rank,
            "ts": action.start * 1e6,
            "dur": (action.end - action.start) * 1e6,
            "args": {"stage": action.stage, "microbatch": action.microbatch},
        })
    return {"traceEvents": events, "displayTimeUnit": "ms"}


#: The optimizer step after which the first timeline is drawn: the first steps build the schedules, the monitor's
#: measured one is profiled; a run shorter than ``timeline_every_n_steps`` still gets one.
FIRST_TIMELINE_STEP = 3


def timeline_due(batches: int, every: Optional[int], accumulation: int) -> bool:
    """Whether the monitor draws the timeline after batch ``batches`` (counted from 1): after the batch ending
    optimizer step :data:`FIRST_TIMELINE_STEP`, then every ``every`` batches after it (``None``: never)."""
    if not every:
        return False
    first = FIRST_TIMELINE_STEP * accumulation
    return batches == first or (batches > first and batches % every == 0)
