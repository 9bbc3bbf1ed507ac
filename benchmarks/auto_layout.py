"""What ``HybridStrategy(tp="auto", pp="auto")`` chooses on this machine, and whether measurement agrees.

Runs ``recipes/pretrain_gpt.py`` with its YAML defaults (GPT of 4 blocks, width 128, 16 sequences of 64 tokens per
data-parallel rank, fp32, CPU) on ``--devices`` processes: once with dp, tp and pp ``auto`` (the strategy
probes this machine — matmul FLOP/s, all-reduce latency and bandwidth — and chooses), then once per layout of that
many processes, with dp and tp fixed and pp ``auto`` so that the layout is the planner's only candidate and its
prediction is logged too. For each run: the layout and predicted memory and tokens/s from the strategy's log line,
and the tokens/s ``ParallelMonitor`` measured (median of its logging windows after the first; each data-parallel
replica's tokens counted once, as the planner counts them). A layout is a good choice if no other measured faster.

Usage::

    python benchmarks/auto_layout.py                    # 2 processes, 40 steps per run (about 2 minutes on 2 cores)
    python benchmarks/auto_layout.py --devices 4 --max-steps 60
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO = Path(__file__).resolve().parents[1]
CHOICE = re.compile(r"chose (?P<layout>.+?) for \d+ devices: predicted (?P<memory>[\d.]+ [MG]iB) per device.*?\),"
                    r" (?P<tokens>[\d,]+) tokens/s")


def run_recipe(degrees: list[str], devices: int, max_steps: int, log_dir: Path) -> dict[str, str | float]:
    """One recipe run; its choice line and measured median tokens/s."""
    command = [sys.executable, str(REPO / "recipes" / "pretrain_gpt.py"), "--trainer.devices", str(devices), *degrees,
               "--trainer.max_steps", str(max_steps), "--trainer.logger.save_dir", str(log_dir)]
    output = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=900)
    match = CHOICE.search(output.stdout + output.stderr)
    if output.returncode or match is None:
        raise RuntimeError(f"{' '.join(command)} failed:\n{(output.stdout + output.stderr)[-4000:]}")
    events = EventAccumulator(str(next(log_dir.glob("version_*"))))
    events.Reload()
    measured = [event.value for event in events.Scalars("throughput/tokens_per_sec")][1:]
    return {"layout": match["layout"], "memory": match["memory"],
            "predicted": float(match["tokens"].replace(",", "")), "measured": statistics.median(measured)}


def strategy_degrees(dp: int | str, tp: int | str, pp: int | str) -> list[str]:
    """The recipe's options for these degrees."""
    return ["--trainer.strategy.dp", str(dp), "--trainer.strategy.tp", str(tp), "--trainer.strategy.pp", str(pp)]


def single_candidate_degrees(devices: int) -> list[list[str]]:
    """dp and tp fixed, pp left to the planner (so it is the only candidate and gets estimated)."""
    runs = []
    for tp in range(1, devices + 1):
        for pp in range(1, devices // tp + 1):
            if devices % (tp * pp) == 0:
                runs.append(strategy_degrees(devices // (tp * pp), tp, "auto"))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=40, help="per run; the monitor logs every 10 steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="auto-layout-") as folder:
        chosen = run_recipe(strategy_degrees("auto", "auto", "auto"), args.devices, args.max_steps,
                            Path(folder) / "auto")
        rows = [run_recipe(degrees, args.devices, args.max_steps, Path(folder) / str(index))
                for index, degrees in enumerate(single_candidate_degrees(args.devices))]
    fastest = max(rows, key=lambda row: row["measured"])
    print(f"## tp='auto', pp='auto' on {args.devices} CPU processes: chose {chosen['layout']}"
          f" (measured fastest: {fastest['layout']})\n")
    print("| layout | predicted memory per device | predicted tokens/s | measured tokens/s | predicted / measured |")
    print("| --- | --- | --- | --- | --- |")
    for row in sorted(rows, key=lambda row: -row["predicted"]):
        mark = " (chosen)" if row["layout"] == chosen["layout"] else ""
        print(f"| {row['layout']}{mark} | {row['memory']} | {row['predicted']:,.0f} | {row['measured']:,.0f} |"
              f" {row['predicted'] / row['measured']:.2f} |")


if __name__ == "__main__":
    main()
