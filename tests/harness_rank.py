"""A SCRIPT (one process per rank) for ``tests/test_benchmark_harness.py``: the smallest worker a benchmark launches
through ``benchmarks/harness.py``. Joins the ranks' gloo group when there are several, sums the ranks over it, and
saves what it saw: ``--mode each`` every rank its own result, ``--mode once`` rank 0 one result for all, ``--mode
fail`` rank 1 raises (rank 0 saves and exits normally)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.harness import save_rank_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=("each", "once", "fail"), required=True)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    total = torch.tensor([rank + 1.0])
    if world > 1:
        dist.init_process_group("gloo")
        dist.all_reduce(total)
        dist.destroy_process_group()
    if args.mode == "fail" and rank == 1:
        raise RuntimeError("rank 1 failed on purpose")
    seen = {"rank": rank, "world": world, "devices": args.devices, "rank_sum": total.item(),
            "threads": torch.get_num_threads()}
    if args.mode == "once":
        if rank == 0:
            torch.save({**seen, "tensor": torch.arange(3)}, args.out)
    else:
        save_rank_result(args.out, seen if args.out.suffix == ".json" else {**seen, "tensor": torch.arange(3)})


if __name__ == "__main__":
    main()
