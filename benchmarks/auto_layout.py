"""What ``HybridStrategy(tp="auto", pp="auto")`` chooses on this machine, and whether measurement agrees.

Runs ``recipes/pretrain_gpt.py`` with its YAML defaults (GPT of 4 blocks, width 128, 16 sequences of 64 tokens per
data-parallel rank, fp32, CPU) on ``--devices`` processes: once with dp, tp and pp ``auto`` (the strategy
probes this machine — matmul FLOP/s, all-reduce latency and bandwidth — and chooses the degrees, and the schedule,
microbatches, ZeRO level and checkpointing left unset), then once per layout of that many processes with the
HybridStrategy defaults, and once per alternative of each option the choice took (the chosen layout with one option
changed). Each of those runs fixes dp, tp and every option and leaves pp ``auto``, so that the layout is the
planner's only candidate and its prediction is logged too. For each run: the layout and predicted memory and
tokens/s from the strategy's log line, and the tokens/s ``ParallelMonitor`` measured (median of its logging windows
after the first; each data-parallel replica's tokens counted once, as the planner counts them). A choice is good if
no other layout measured clearly faster.

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
from dataclasses import replace
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from benchmarks.harness import markdown_table
from lightning_hybrid.options.hybrid_options import default_zero_level
from lightning_hybrid.planner.layout import CHECKPOINTING, Layout, parse_layout

REPO = Path(__file__).resolve().parents[1]
WHY = re.compile(r"Why: (.+?)\. Hardware")
BATCH_PER_RANK = 16  # the recipe's data.batch_size
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
    why = WHY.search(output.stdout + output.stderr)
    return {"layout": match["layout"], "memory": match["memory"], "why": why[1] if why else "",
            "predicted": float(match["tokens"].replace(",", "")), "measured": statistics.median(measured)}


def strategy_options(layout: Layout) -> list[str]:
    """The recipe's options that make ``layout`` the planner's only candidate (pp stays ``auto``: it is logged)."""
    values = {"dp": layout.dp, "tp": layout.tp, "pp": "auto", "zero": layout.zero,
              "activation_checkpointing": layout.activation_checkpointing or "none"}
    if layout.pp > 1:  # each given, or the planner would choose them (pp is "auto")
        stages = layout.virtual_stages or (2 if layout.pp_schedule == "interleaved_1f1b" else 1)
        values.update(pp_schedule=layout.pp_schedule, virtual_stages=stages,
                      microbatches=layout.microbatches or layout.pp * stages)
    return [word for name, value in values.items() if value is not None
            for word in (f"--trainer.strategy.{name}", str(value))]


def default_layouts(devices: int) -> list[Layout]:
    """Every dp × tp × pp of ``devices`` with HybridStrategy's defaults for the rest."""
    return [Layout(dp=devices // (tp * pp), tp=tp, pp=pp, zero=default_zero_level(pp > 1))
            for tp in range(1, devices + 1) for pp in range(1, devices // tp + 1) if devices % (tp * pp) == 0]


def alternatives(chosen: Layout, per_rank_batch: int) -> list[Layout]:
    """``chosen`` with one option changed: the other ZeRO level, each other checkpointing mode, and under a
    pipeline each other microbatch count ≥ pp dividing the batch."""
    changed = [replace(chosen, zero=5 - chosen.zero)]
    changed += [replace(chosen, activation_checkpointing=mode) for mode in CHECKPOINTING
                if mode != chosen.activation_checkpointing]
    if chosen.pp > 1:
        changed += [replace(chosen, microbatches=count) for count in range(chosen.pp, per_rank_batch + 1)
                    if per_rank_batch % count == 0 and count != chosen.microbatches]
    return changed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=40, help="per run; the monitor logs every 10 steps")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="auto-layout-") as folder:
        auto = ["--trainer.strategy.dp", "auto", "--trainer.strategy.tp", "auto", "--trainer.strategy.pp", "auto"]
        chosen = run_recipe(auto, args.devices, args.max_steps, Path(folder) / "auto")
        layout = parse_layout(str(chosen["layout"]), args.devices)
        candidates = list(dict.fromkeys([*default_layouts(args.devices), *alternatives(layout, BATCH_PER_RANK)]))
        rows = [run_recipe(strategy_options(candidate), args.devices, args.max_steps, Path(folder) / str(index))
                for index, candidate in enumerate(candidates)]
    rows = [{**chosen, "chosen": True}, *(row for row in rows if row["layout"] != chosen["layout"])]
    fastest = max(rows, key=lambda row: row["measured"])
    print(f"## tp='auto', pp='auto' on {args.devices} CPU processes: chose {chosen['layout']}"
          f" (measured fastest: {fastest['layout']})\n\nWhy: {chosen['why'] or '(nothing but the degrees)'}\n")
    # Each run probes the machine again: compare the Why line's ratios (one probe) with the measured ones.
    cells = [[f"{row['layout']}{' (chosen, auto run)' if row.get('chosen') else ''}", row["memory"],
              f"{row['predicted']:,.0f}", f"{row['measured']:,.0f}", f"{row['predicted'] / row['measured']:.2f}",
              f"{row['measured'] / chosen['measured']:.2f}"] for row in sorted(rows, key=lambda row: -row["measured"])]
    print(markdown_table(["layout", "predicted memory per device", "predicted tokens/s (own probe)",
                          "measured tokens/s", "predicted / measured", "measured / chosen's"], cells))


if __name__ == "__main__":
    main()
