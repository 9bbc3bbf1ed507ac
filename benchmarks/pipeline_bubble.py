"""Measure the pipeline bubble of every HybridStrategy schedule and print it next to the theory.

The bubble is what ``ParallelMonitor`` logs as ``pipeline/bubble``: each rank records its stages' compute actions
during a step (``Pipeline.record_timeline``); all ranks leave a step together (its closing broadcast), so the
pipeline's step lasts the longest rank's duration, and a rank's bubble is ``1 - busy / step``. The table gives the
mean over ranks, median over steps after warm-up. Theory with equal stages: ``(p - 1) / (m·v + p - 1)`` for GPipe,
1F1B, interleaved 1F1B and looped BFS (``v`` stages per rank); zero-bubble schedules have no closed form (their idle
time depends on how long input- and weight-gradient passes take; here the weight pass is almost free).

Stage compute is simulated by sleeping (forward 20 ms, backward 40 ms per microbatch and stage, plus a real
linear layer; ``BUBBLE_FORWARD_MS`` changes the forward time), so that 4 ranks on a 2-core machine do not compete
for cores and the figure reflects the schedule, torch's send/receive, and the strategy's per-stage work — not CPU
contention. The schedule and the whole stack (Lightning, HybridStrategy, ``torch.distributed.pipelining``, gloo)
are the real ones.

Usage::

    python benchmarks/pipeline_bubble.py                  # the table: every schedule at p = 2, m = 4, 8; some at p = 4
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 4 --schedule 1f1b --out result.json   # one run
    BUBBLE_FORWARD_MS=100 python benchmarks/pipeline_bubble.py         # longer stages: fixed overheads weigh less
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import launch_saved_once, markdown_table  # noqa: E402
from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.options.schedules import SCHEDULES, PipelineSchedule  # noqa: E402
from lightning_hybrid.observe.timeline import timeline_bubble  # noqa: E402

FORWARD_S = float(os.environ.get("BUBBLE_FORWARD_MS", "20")) / 1e3  # backward takes twice as long
WIDTH, MICROBATCH_SIZE, STEPS, WARMUP_STEPS = 16, 2, 8, 2


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take a fixed wall time without using a core."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        if x.device.type != "meta":  # like real kernels: a stand-in for another stage's block costs nothing
            time.sleep(FORWARD_S)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        time.sleep(2 * FORWARD_S)
        return grad


class SleepBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(self.linear(x))


class SleepModel(pl.LightningModule):
    """One block per stage; a plain LightningModule, no pipeline code."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(SleepBlock() for _ in range(num_blocks))

    def training_step(self, batch: tuple[Tensor], batch_idx: int) -> Tensor:
        x = batch[0]
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class _RecordTimelines(pl.Callback):
    """Turn on the pipeline's action timing and keep each training step's timeline of this rank."""

    def __init__(self) -> None:
        self.timelines: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *unused: Any) -> None:
        trainer.strategy.pipeline.record_timeline = True

    def on_train_batch_end(self, trainer: pl.Trainer, *unused: Any) -> None:
        self.timelines.append(trainer.strategy.pipeline.last_timeline)


def run_one(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    schedule = PipelineSchedule.resolve(args.schedule, args.pp, microbatches=args.microbatches)
    batch = args.microbatches * MICROBATCH_SIZE
    data = TensorDataset(torch.randn(batch * STEPS, WIDTH))
    recorder = _RecordTimelines()
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.pp, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[recorder],
        strategy=HybridStrategy(pp=args.pp, pp_schedule=args.schedule, microbatches=args.microbatches, monitor=False),
    )
    trainer.fit(SleepModel(schedule.num_stages), DataLoader(data, batch_size=batch))
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, recorder.timelines)
    if trainer.global_rank == 0:
        steps = [[timelines[step] for timelines in per_rank] for step in range(WARMUP_STEPS, STEPS)]
        result = {
            "schedule": args.schedule, "pp": args.pp, "virtual_stages": schedule.virtual_stages,
            "microbatches": args.microbatches,
            "measured": statistics.median(timeline_bubble(step) for step in steps),
            "theory": schedule.theoretical_bubble(),
            "step_s": statistics.median(max(t.duration for t in step) for step in steps),
        }
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()  # close gloo's connections together rather than at interpreter exit


#: (schedule, p, m) rows of the table.
TABLE = [(name, 2, m) for name in SCHEDULES for m in (4, 8)] + [
    ("gpipe", 4, 8), ("1f1b", 4, 8), ("1f1b", 4, 16), ("interleaved_1f1b", 4, 8),
]


def run_table() -> None:
    rows = []
    for schedule, pp, microbatches in TABLE:
        r = launch_saved_once(Path(__file__), ["--schedule", schedule, "--pp", pp, "--microbatches", microbatches],
                              world=pp, suffix=".json")
        theory = "—" if r["theory"] is None else f"{r['theory']:.3f}"
        rows.append([r["schedule"], r["pp"], r["virtual_stages"], r["microbatches"], f"{r['measured']:.3f}", theory,
                     f"{r['step_s'] * 1e3:.0f} ms"])
    print(markdown_table(["schedule", "p", "v", "m", "measured bubble (median of steps)", "theory (p-1)/(m·v+p-1)",
                          "step time"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness: p
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.pp is None:
        run_table()
    else:
        run_one(args)


if __name__ == "__main__":
    main()
