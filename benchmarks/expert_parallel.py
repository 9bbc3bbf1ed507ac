"""Expert parallelism on CPU: expert weights per rank, all-to-all bytes against the minimum, step time vs ep=1.

Hugging Face Mixtral (``tests/zoo_hf.py``: 4 blocks of 4 experts, top-2) trains on 4 CPU processes (dp4) with ep = 1,
2 and 4, alternated over ``--rounds``; the strategy's monitor gives, per batch:

* the experts a rank computes with: ``experts / ep`` of each layer (``rank_local_shapes``: the stacked weights'
  expert dimension on the rank, before FSDP2 shards the rest over the ``dp / ep`` ranks holding them), against the
  theory ``experts / ep``; FSDP2's all-gather bytes per batch (``comm/bytes_per_batch/all_gather``), which shrink
  as each rank gathers only its experts;
* the all-to-all: ``comm/bytes_per_batch/all_to_all`` (every byte the collectives were handed, a rank's rows for its
  own experts and the counts exchanged included) against the minimum for the routed tokens,
  ``experts/all_to_all_bytes_per_batch`` (rows whose expert sits on another rank, there and back, forward and
  backward: what must cross a link);
* the median step time, as a ratio to ep = 1 in the same run.

Usage::

    python benchmarks/expert_parallel.py --rounds 2 --steps 8
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

EXPERT_WEIGHT = "model.model.layers.0.mlp.experts.gate_up_proj"
EXPERTS = 4


def measure(ep: int, args: argparse.Namespace, folder: Path) -> dict[str, float]:
    """One dp4 fit with ``ep``: the figures of its batches after the first (the monitor logs every batch)."""
    result = run_script(["--model", "hf_mixtral", "--dp", 4, "--devices", 4, "--steps", args.steps,
                         "--strategy-kwargs", json.dumps({"ep": ep}), "--tensorboard", folder / "tb",
                         "--out", folder / "run.pt"])
    logged = scalars(next((folder / "tb").glob("version_*")))
    measured = lambda tag: logged[tag][0][1] if tag in logged else 0.0  # noqa: E731  (the profiled second batch)
    local, full = result["rank_local_shapes"][0][EXPERT_WEIGHT]
    return {"experts_held": local[0] if ep > 1 else full[0], "all_gather": measured("comm/bytes_per_batch/all_gather"),
            "all_to_all": measured("comm/bytes_per_batch/all_to_all"),
            "minimum": statistics.median(v for _, v in logged.get("experts/all_to_all_bytes_per_batch", [(0, 0.0)])),
            "step_s": statistics.median(value for _, value in logged["throughput/step_time_sec"][1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    degrees = (1, 2, 4)
    runs: dict[int, list[dict[str, float]]] = {ep: [] for ep in degrees}
    with tempfile.TemporaryDirectory() as tmp:
        for round_index, ep in alternating(degrees, args.rounds):  # alternated: drift falls on all of them
            runs[ep].append(measure(ep, args, Path(tmp) / f"ep{ep}-{round_index}"))
    baseline = statistics.median(run["step_s"] for run in runs[1])
    rows = []
    for ep in degrees:
        first = runs[ep][0]
        step = statistics.median(run["step_s"] for run in runs[ep])
        rows.append([ep, f"{first['experts_held']:.0f} (theory {EXPERTS // ep})", f"{first['all_gather'] / 1024:.1f}",
                     f"{first['all_to_all'] / 1024:.1f}", f"{first['minimum'] / 1024:.1f}", f"{step * 1000:.1f}",
                     f"{step / baseline:.2f}"])
    print(f"Hugging Face Mixtral (4 blocks, 4 experts, top-2), dp4 on 4 CPU processes, {args.steps} steps,"
          f" {args.rounds} rounds")
    print(markdown_table(["ep", "experts computed per rank", "all-gather KiB/batch", "all-to-all KiB/batch (measured)",
                          "all-to-all KiB/batch (minimum)", "step ms", "vs ep=1"], rows))


if __name__ == "__main__":
    main()
