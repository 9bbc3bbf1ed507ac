"""Stage split by measured time vs by traced FLOPs: predicted and measured per-stage time and bubble, side by side.

Trains ``tests/pipeline/measured_split.py``'s model — blocks alike in their matrix products, some also running
rounds of cumulative sums along the sequence that traced FLOPs count as zero — under ``HybridStrategy(pp=2)`` on 2
CPU processes, once with ``pp_split="measured"`` and once with the default FLOP-balanced split, both fits in one
launch. Predicted: each stage's forward + backward time per microbatch from the block times the measured split
timed at setup (the same costs for both splits), and :func:`~lightning_hybrid.pipeline.measured.predicted_bubble`.
Measured: the monitor's timeline (``Pipeline.record_timeline``): each rank's compute actions per step divided by the
microbatches, and the bubble ``ParallelMonitor`` logs (``1 - busy / step``, mean over ranks); medians over the
steps after ``--warmup``.

Usage::

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/measured_split.py
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/measured_split.py --scans 0 0 0 0 0 0 12 12 --microbatches 8
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from lightning_hybrid.observe.timeline import timeline_bubble  # noqa: E402

SCRIPT = ROOT / "tests" / "pipeline" / "measured_split.py"


def launch(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Both fits (measured, then FLOP-balanced) in one 2-rank launch; rank 0's results."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    command = [sys.executable, str(SCRIPT), "--splits", "measured", "flops", "--timeline", "--devices", "2",
               "--scans", *map(str, args.scans), "--dim", str(args.dim), "--seq", str(args.seq), "--batch",
               str(args.batch), "--steps", str(args.steps), "--microbatches", str(args.microbatches), "--out", str(out)]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT) for r in range(2)]
    if any(proc.wait() for proc in procs):
        raise RuntimeError(f"{' '.join(command)} failed")
    return torch.load(out, weights_only=False)


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
    with tempfile.TemporaryDirectory() as folder:
        results = launch(args, Path(folder) / "runs.pt")
    measured = results["measured"]["measured"]
    print(f"pp=2 1f1b, m={args.microbatches}, {args.steps - args.warmup} steps after {args.warmup} warm-up; block scans"
          f" {args.scans}, dim {args.dim}, {args.batch // args.microbatches}×{args.seq} tokens per microbatch")
    print(f"measured costs (ms): before {measured['times']['before'] * 1e3:.2f},"
          f" blocks {_ms(measured['times']['blocks'])}, after {measured['times']['after'] * 1e3:.2f}")
    print("| split | blocks per stage | predicted stage time (ms) | measured stage time (ms) | predicted bubble"
          " | measured bubble | step time |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = (("measured", "blocks_per_stage", "stage_seconds", "bubble"),
            ("flops", "flop_blocks_per_stage", "flop_stage_seconds", "flop_bubble"))
    for entry, counts, predicted, bubble in rows:
        run = results[entry]
        assert run["blocks_per_stage"][0] == measured[counts]  # the FLOP fit adopted the split predicted for it
        stages, measured_bubble, step_s = measured_figures(run, args.microbatches, args.warmup)
        name = "measured time" if entry == "measured" else "traced FLOPs"
        print(f"| {name} | {measured[counts]} | {_ms(measured[predicted])} | {_ms(stages)} | {measured[bubble]:.3f}"
              f" | {measured_bubble:.3f} | {step_s * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
