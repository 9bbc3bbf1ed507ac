"""Stage split by measured time vs by traced FLOPs: predicted and measured per-stage time and bubble, side by side.

Trains ``tests/pipeline/measured_split.py``'s model — blocks alike in their matrix products, some also running
rounds of cumulative sums along the sequence that traced FLOPs count as zero — under ``HybridStrategy(pp=2)`` on 2
CPU processes, once with ``pp_split="measured"`` and once with the default FLOP-balanced split, both fits in one
launch. Predicted: each stage's forward + backward time per microbatch from the block times the measured split
timed at setup (the same costs for both splits), and :func:`~lightning_hybrid.pipeline.timed_split.predicted_bubble`.
Measured: the monitor's timeline (``Pipeline.record_timeline``): each rank's compute actions per step divided by the
microbatches, and the bubble ``ParallelMonitor`` logs (``1 - busy / step``, mean over ranks); medians over the
steps after ``--warmup``.

Usage::

    python benchmarks/measured_split.py
    python benchmarks/measured_split.py --scans 0 0 0 0 0 0 12 12 --microbatches 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import launch_saved_once, markdown_table  # noqa: E402
from lightning_hybrid.observe.timeline import timeline_bubble  # noqa: E402

SCRIPT = ROOT / "tests" / "pipeline" / "measured_split.py"


def launch(args: argparse.Namespace) -> dict[str, Any]:
    """Both fits (measured, then FLOP-balanced) in one 2-rank launch; rank 0's results."""
    return launch_saved_once(SCRIPT, ["--splits", "measured", "flops", "--timeline", "--scans", *args.scans,
                                      "--dim", args.dim, "--seq", args.seq, "--batch", args.batch,
                                      "--steps", args.steps, "--microbatches", args.microbatches], world=2)


def measured_figures(run: dict[str, Any], microbatches: int, warmup: int) -> tuple[list[float], float, float]:
    """Per rank (one stage each) compute seconds per microbatch, the bubble and the step seconds: medians over
    the steps after ``warmup``."""
    steps = run["timelines"][warmup:]
    stages = [statistics.median(step[rank].busy for step in steps) / microbatches for rank in range(len(steps[0]))]
    bubble = statistics.median(timeline_bubble(list(step)) for step in steps)
    step_s = statistics.median(max(t.duration for t in step) for step in steps)
    return stages, bubble, step_s


def _ms(values: list[float]) -> str:
    return "[" + ", ".join(f"{v * 1e3:.2f}" for v in values) + "]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scans", type=int, nargs="+", default=[0, 0, 0, 0, 0, 0, 12, 12])
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    results = launch(args)
    measured = results["measured"]["measured"]
    print(f"pp=2 1f1b, m={args.microbatches}, {args.steps - args.warmup} steps after {args.warmup} warm-up; block scans"
          f" {args.scans}, dim {args.dim}, {args.batch // args.microbatches}×{args.seq} tokens per microbatch")
    print(f"measured costs (ms): before {measured['times']['before'] * 1e3:.2f},"
          f" blocks {_ms(measured['times']['blocks'])}, after {measured['times']['after'] * 1e3:.2f}")
    rows = []
    for entry, counts, predicted, bubble in (("measured", "blocks_per_stage", "stage_seconds", "bubble"),
                                             ("flops", "flop_blocks_per_stage", "flop_stage_seconds", "flop_bubble")):
        run = results[entry]
        assert run["blocks_per_stage"][0] == measured[counts]  # the FLOP fit adopted the split predicted for it
        stages, measured_bubble, step_s = measured_figures(run, args.microbatches, args.warmup)
        rows.append(["measured time" if entry == "measured" else "traced FLOPs", measured[counts],
                     _ms(measured[predicted]), _ms(stages), f"{measured[bubble]:.3f}", f"{measured_bubble:.3f}",
                     f"{step_s * 1e3:.0f} ms"])
    print(markdown_table(["split", "blocks per stage", "predicted stage time (ms)", "measured stage time (ms)",
                          "predicted bubble", "measured bubble", "step time"], rows))


if __name__ == "__main__":
    main()
