"""Step time of a pipelined fine-tuning run with sequence lengths varying every step vs fixed, side by side.

Trains ``tests/pipeline/varying_lengths.py``'s padded decoder under ``HybridStrategy(pp=2)`` on 2 CPU processes
twice: every batch padded to the same length (``--fixed``), and every batch padded to its own longest sequence
(lengths drawn from ``--lengths``, so nearly every step has a new shape). Varying shapes cost a shape pass per new
microbatch shape (the step with every unit standing in) and refitted receive buffers, not a new schedule.

Usage::

    python benchmarks/varying_lengths.py --schedule 1f1b --samples 64 --epochs 2
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

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "pipeline" / "varying_lengths.py"


def run(schedule: str, lengths: tuple[int, int], args: argparse.Namespace, out: Path) -> list[float]:
    """Seconds of every training step (rank 0) of one 2-rank fit."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE="2", NODE_RANK="0")
    command = [sys.executable, str(SCRIPT), "--schedules", schedule, "--samples", str(args.samples), "--epochs",
               str(args.epochs), "--lengths", *map(str, lengths), "--out", str(out)]
    procs = [subprocess.Popen(command, env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.DEVNULL,
                              stderr=subprocess.STDOUT) for r in range(2)]
    if any(proc.wait() for proc in procs):
        raise RuntimeError(f"{' '.join(command)} failed")
    return torch.load(out, weights_only=False)[schedule]["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs=2, default=(4, 16), help="varying: shortest and longest")
    parser.add_argument("--fixed", type=int, default=16, help="fixed: every sequence this long")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        fixed = run(args.schedule, (args.fixed, args.fixed), args, Path(folder) / "fixed.pt")
        varying = run(args.schedule, tuple(args.lengths), args, Path(folder) / "varying.pt")
    print(f"pp=2 {args.schedule}, {len(fixed)} steps each (the first 2 left out: setup and shape inference)")
    print(f"{'':>28}{'fixed':>12}{'varying':>12}")
    for name, reduce in (("median step (ms)", statistics.median), ("mean step (ms)", statistics.mean),
                         ("max step (ms)", max)):
        print(f"{name:>28}{1e3 * reduce(fixed[2:]):>12.1f}{1e3 * reduce(varying[2:]):>12.1f}")


if __name__ == "__main__":
    main()
