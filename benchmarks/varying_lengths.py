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
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import launch_saved_once, markdown_table  # noqa: E402

SCRIPT = ROOT / "tests" / "pipeline" / "varying_lengths.py"


def run(schedule: str, lengths: tuple[int, int], args: argparse.Namespace) -> list[float]:
    """Seconds of every training step (rank 0) of one 2-rank fit."""
    result = launch_saved_once(SCRIPT, ["--schedules", schedule, "--samples", args.samples, "--epochs", args.epochs,
                                        "--lengths", *lengths], world=2)
    return result[schedule]["step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lengths", type=int, nargs=2, default=(4, 16), help="varying: shortest and longest")
    parser.add_argument("--fixed", type=int, default=16, help="fixed: every sequence this long")
    args = parser.parse_args()
    fixed = run(args.schedule, (args.fixed, args.fixed), args)
    varying = run(args.schedule, tuple(args.lengths), args)
    print(f"pp=2 {args.schedule}, {len(fixed)} steps each (the first 2 left out: setup and shape inference)")
    rows = [[name, f"{1e3 * reduce(fixed[2:]):.1f}", f"{1e3 * reduce(varying[2:]):.1f}"]
            for name, reduce in (("median step (ms)", statistics.median), ("mean step (ms)", statistics.mean),
                                 ("max step (ms)", max))]
    print(markdown_table(["", "fixed", "varying"], rows))


if __name__ == "__main__":
    main()
