"""A middle pipeline stage's peak memory against the number of microbatches m, at a fixed microbatch size: torch's
``PipelineStage`` next to the stage HybridStrategy builds (:func:`lightning_hybrid._compat.pipelining.pipeline_stage`).

torch's stage keeps one receive buffer per microbatch and direction for the whole run (a middle stage: 2·m b·s·h
tensors); HybridStrategy's allocates a buffer when its message is received and drops it once the forward or backward
that reads it has run, so only the microbatches in flight hold one (1F1B: at most p − rank). The model is four
stages of ``--blocks`` linear layers (width ``--hidden``) on four CPU processes (gloo), 1F1B or Interleaved1F1B (two
stages per rank, eight in all); each configuration runs in fresh processes and the second rank (a middle one)
reports its peak resident memory over two steps minus its resident memory before the first (tensors above 64 KiB are
mapped and unmapped on allocation and release, so the resident peak follows the live tensors).

Usage::

    python benchmarks/pipeline_memory.py --microbatches 4,16,64
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import markdown_table  # noqa: E402
from lightning_hybrid._compat.pipelining import pipeline_stage, release_sends_on_arrival  # noqa: E402

RANKS = 4
MIB = 2**20


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _stages(args: argparse.Namespace, rank: int, kind: str, stages_per_rank: int) -> list:
    from torch.distributed.pipelining import PipelineStage

    total = RANKS * stages_per_rank
    built = []
    for index in range(rank, total, RANKS):  # torch's loop placement
        torch.manual_seed(index)
        module = torch.nn.Sequential(*(torch.nn.Linear(args.hidden, args.hidden) for _ in range(args.blocks)))
        if kind == "torch":
            built.append(PipelineStage(module, index, total, torch.device("cpu"), group=dist.group.WORLD))
        else:
            release_sends_on_arrival()
            built.append(pipeline_stage(module, index, total, torch.device("cpu"), dist.group.WORLD))
    return built


def _run(rank: int, args: argparse.Namespace, kind: str, schedule: str, microbatches: int, port: int,
         results: dict) -> None:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    interleaved = schedule == "interleaved"
    stages = _stages(args, rank, kind, 2 if interleaved else 1)
    loss = lambda output, target: ((output - target) ** 2).mean()  # noqa: E731
    runner = (ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss) if interleaved
              else Schedule1F1B(stages[0], microbatches, loss_fn=loss))
    batch = torch.randn(microbatches * args.micro_batch, args.sequence, args.hidden)
    before = _resident_bytes()
    for _ in range(2):
        if rank == 0:
            runner.step(batch)
        elif rank == RANKS - 1:
            runner.step(target=batch)
        else:
            runner.step()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 1:
        results[(kind, schedule, microbatches)] = peak - before
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--microbatches", default="4,16,64")
    parser.add_argument("--schedules", default="1f1b,interleaved")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--sequence", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--blocks", type=int, default=2)
    args = parser.parse_args()
    counts = [int(m) for m in args.microbatches.split(",")]
    results = mp.Manager().dict()
    # A fixed threshold: glibc otherwise raises it after the first large free and serves later tensors from a heap
    # it does not give back, so the resident peak would follow the heap's high-water mark, not the live tensors.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**16)
    for schedule in args.schedules.split(","):
        for microbatches in counts:
            for kind in ("torch", "arrival"):
                mp.spawn(_run, (args, kind, schedule, microbatches, _free_port(), results), nprocs=RANKS)
    message = args.micro_batch * args.sequence * args.hidden * 4 / MIB
    print(f"{RANKS} ranks, middle rank's peak memory over two steps (MiB); one b·s·h message = {message:.1f} MiB")
    rows = [[schedule, m, f"{results[('torch', schedule, m)] / MIB:.1f}",
             f"{results[('arrival', schedule, m)] / MIB:.1f}",
             f"{results[('arrival', schedule, m)] / results[('torch', schedule, m)]:.2f}"]
            for schedule in args.schedules.split(",") for m in counts]
    print(markdown_table(["schedule", "m", "torch's stage", "HybridStrategy's stage", "ratio"], rows))


if __name__ == "__main__":
    main()
