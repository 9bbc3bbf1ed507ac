"""``loss_parallel=True`` vs the default (logits gathered): collective bytes per batch, step time and peak memory.

By default the head's logits are all-gathered over the tensor-parallel ranks (batch × sequence × vocabulary per
micro-batch); with ``loss_parallel=True`` they stay sharded and torch's ``loss_parallel()`` all-reduces a few values
per token instead. This script trains ``tests/equivalence.py``'s GPT at tp2 (2 CPU processes) once per setting, in
one launch, and reads the strategy's monitor from TensorBoard (``comm/bytes_per_batch/*``: the busiest rank's bytes
of the measured batch; ``throughput/step_time_sec``; ``memory/peak_gib_max``, on CPU the peak resident memory).
The monitor sees the collectives the parallel styles issue around a module (the head's all-gather, the row-wise
layers' all-reduces) but not those DTensor issues inside an operator's handler, under its dispatch mode: the
``all_reduce`` column does not include ``loss_parallel()``'s (about three of batch × sequence values per forward).

Usage::

    python benchmarks/loss_parallel.py --steps 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import markdown_table  # noqa: E402
from tests.helpers import run_sweep, scalars  # noqa: E402  (the test launcher: one process per rank)

SETTINGS = ({"loss_parallel": False}, {"loss_parallel": True})


def measured(folder: Path) -> dict[str, float]:
    """The monitor's numbers of one run's TensorBoard folder."""
    logged = scalars(next(folder.glob("version_*")))
    comm = {tag.rsplit("/", 1)[1]: values[0][1] for tag, values in logged.items()
            if tag.startswith("comm/bytes_per_batch/")}
    return {**comm, "step_s": statistics.median(value for _, value in logged["throughput/step_time_sec"]),
            "peak_gib": max(value for _, value in logged["memory/peak_gib_max"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        run_sweep(["--model", "gpt", "--tp", 2, "--devices", 2, "--steps", args.steps, "--global-batch",
                   args.global_batch, "--tensorboard", folder / "tb", "--out", folder / "run.pt"], SETTINGS)
        runs = [measured(folder / "tb" / str(index)) for index in range(len(SETTINGS))]
    kinds = sorted({kind for run in runs for kind in run if kind not in ("step_s", "peak_gib")})
    print(f"tp2, GPT (vocabulary 64, sequence 16), {args.global_batch} sequences per batch, {args.steps} steps")
    rows = [[setting["loss_parallel"], *(f"{run.get(kind, 0.0) / 1024:.2f}" for kind in kinds),
             f"{1e3 * run['step_s']:.1f}", f"{1024 * run['peak_gib']:.1f}"] for setting, run in zip(SETTINGS, runs)]
    print(markdown_table(["loss_parallel", *(f"{kind} KiB per batch" for kind in kinds), "step time ms (median)",
                          "peak memory MiB"], rows))


if __name__ == "__main__":
    main()
