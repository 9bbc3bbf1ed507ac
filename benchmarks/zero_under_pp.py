"""ZeRO-2 vs ZeRO-3 under pipeline parallelism: all-gather bytes, step time and peak memory, side by side.

Under pp each step runs every microbatch's forward and backward through the stage. With ZeRO-3
(``reshard_after_forward=True``) FSDP2 reshards a block after each microbatch's forward and gathers it again for
the next forward and for each backward: 2·m all-gathers per block and step. With ZeRO-2 the stage's blocks stay
gathered from the first forward to the step's last backward: one all-gather per block and step, at the price of
holding the stage's gathered blocks (1/pp of the model, tp-sharded) through the step. This script measures both on
``tests/equivalence.py``'s GPT (dp2 × pp2 on 4 CPU processes, 1F1B, ``--microbatches`` per step) with the
strategy's monitor (``comm/bytes_per_batch/*``, ``throughput/step_time_sec``, ``memory/peak_gib_max`` in
TensorBoard; on CPU the latter is the process's peak resident memory), alternating the two levels over ``--rounds``.

Usage::

    python benchmarks/zero_under_pp.py --rounds 3 --microbatches 4 --steps 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import alternating, markdown_table  # noqa: E402
from tests.helpers import run_script, scalars  # noqa: E402  (the test launcher: one process per rank)


def measure(zero: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """One dp2 × pp2 fit at ``zero``: all-gather and reduce-scatter bytes of the measured batch, the median step
    time after it, the peak memory (max over ranks)."""
    kwargs = {"microbatches": args.microbatches, "pp_schedule": "1f1b"}
    run_script(["--model", "gpt", "--layers", args.layers, "--dp", 2, "--pp", 2, "--devices", 4, "--zero", zero,
                "--steps", args.steps, "--global-batch", 2 * args.microbatches * 2,
                "--strategy-kwargs", json.dumps(kwargs), "--tensorboard", folder / "tb", "--out", folder / "run.pt"])
    logged = scalars(next((folder / "tb").glob("version_*")))
    first = lambda tag: logged[tag][0][1] if tag in logged else 0.0  # noqa: E731  (constant per run)
    return {"all_gather": first("comm/bytes_per_batch/all_gather"),
            "reduce_scatter": first("comm/bytes_per_batch/reduce_scatter"),
            "step_s": statistics.median(value for _, value in logged["throughput/step_time_sec"]),
            "peak_gib": max(value for _, value in logged["memory/peak_gib_max"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    runs: dict[int, list[dict[str, float]]] = {2: [], 3: []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index, zero in alternating((2, 3), args.rounds):  # alternated: drift falls on both
            runs[zero].append(measure(zero, args, Path(tmp) / f"z{zero}-{round_index}"))
    print(f"dp2 x pp2, 1F1B, {args.microbatches} microbatches, {args.layers} blocks, {args.rounds} rounds")
    rows = [[zero, f"{measured[0]['all_gather'] / 1024:.1f}", f"{measured[0]['reduce_scatter'] / 1024:.1f}",
             f"{1e3 * statistics.median(m['step_s'] for m in measured):.1f}",
             f"{1024 * statistics.median(m['peak_gib'] for m in measured):.2f}"] for zero, measured in runs.items()]
    print(markdown_table(["zero", "all-gather KiB per step", "reduce-scatter KiB per step",
                          "step time ms (median of rounds)", "peak memory MiB"], rows))
    ratios = [three["step_s"] / two["step_s"] for two, three in zip(runs[2], runs[3])]
    print(f"step time ZeRO-3 / ZeRO-2: {statistics.median(ratios):.3f} (rounds {min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
