"""Measure the pipeline bubble of HybridStrategy's schedules and print it next to the theory.

The bubble is the idle share of the pipeline's device time in a step: ``1 - Σ busy / (p · T)``, where ``busy`` is
the time a rank spends in its stages' forward and backward compute, and ``T`` runs from the first rank entering
the schedule step to the last one leaving it (ranks start and finish a step at different times, so per-rank step
windows would hide the fill and drain). Theory for GPipe and 1F1B with equal stages: ``(p - 1) / (m + p - 1)``.

Stage compute is simulated by sleeping (forward 20 ms, backward 40 ms per microbatch and stage, plus a real
linear layer; ``BUBBLE_FORWARD_MS`` changes the forward time), so that 4 ranks on a 2-core machine do not compete for cores and the figure reflects the schedule,
torch's send/receive, and the strategy's per-stage work — not CPU contention. The schedule and the whole stack
(Lightning, HybridStrategy, ``torch.distributed.pipelining``, gloo) are the real ones.

Usage::

    python benchmarks/pipeline_bubble.py                  # the table: 1F1B and GPipe, p = 2, 4 and m = 4, 8
    python benchmarks/pipeline_bubble.py --pp 2 --microbatches 4 --schedule 1f1b --out result.json   # one run
    BUBBLE_FORWARD_MS=100 python benchmarks/pipeline_bubble.py         # longer stages: fixed overheads weigh less
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.utils.data import DataLoader, TensorDataset

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from lightning_hybrid import HybridStrategy  # noqa: E402
from lightning_hybrid.pipeline import PipelineSchedule  # noqa: E402

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


_busy: list[tuple[float, float]] = []
_steps: list[tuple[float, float]] = []


def _timed(method: Callable, into: list) -> Callable:
    """Record ``(start, end)`` wall-clock times (one clock for all processes of this machine)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            return method(*args, **kwargs)
        finally:
            into.append((start, time.time()))

    return wrapper


def _instrument() -> None:
    """Time each stage's compute calls and each schedule step (benchmark-only instrumentation)."""
    for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
        setattr(PipelineStage, name, _timed(getattr(PipelineStage, name), _busy))
    for cls in (PipelineScheduleSingle, PipelineScheduleMulti):
        cls.step = _timed(cls.step, _steps)


def run_one(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore")
    _instrument()
    schedule = PipelineSchedule.resolve(args.schedule, args.pp, microbatches=args.microbatches)
    batch = args.microbatches * MICROBATCH_SIZE
    data = TensorDataset(torch.randn(batch * STEPS, WIDTH))
    trainer = pl.Trainer(
        accelerator="cpu", devices=args.pp, max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=HybridStrategy(pp=args.pp, pp_schedule=args.schedule, microbatches=args.microbatches),
    )
    steps_before = len(_steps)
    busy_marks: list[int] = []

    class Mark(pl.Callback):
        def on_train_batch_start(self, *unused: Any) -> None:
            busy_marks.append(len(_busy))

    trainer.callbacks.append(Mark())
    trainer.fit(SleepModel(schedule.num_stages), DataLoader(data, batch_size=batch))
    busy_marks.append(len(_busy))
    windows = _steps[steps_before:]
    busy = [sum(end - start for start, end in _busy[a:b]) for a, b in zip(busy_marks, busy_marks[1:])]
    per_rank: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (windows, busy))
    if trainer.global_rank == 0:
        bubbles, step_times = [], []
        for step in range(WARMUP_STEPS, STEPS):
            start = min(windows[step][0] for windows, _ in per_rank)
            end = max(windows[step][1] for windows, _ in per_rank)
            busy_total = sum(busy[step] for _, busy in per_rank)
            bubbles.append(1 - busy_total / (args.pp * (end - start)))
            step_times.append(end - start)
        result = {
            "schedule": args.schedule, "pp": args.pp, "microbatches": args.microbatches,
            "measured": statistics.median(bubbles), "theory": schedule.theoretical_bubble(),
            "step_s": statistics.median(step_times),
        }
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()  # close gloo's connections together rather than at interpreter exit


def run_table() -> None:
    rows = []
    for schedule in ("1f1b", "gpipe"):
        for pp in (2, 4):
            for microbatches in (4, 8):
                with tempfile.TemporaryDirectory() as folder:
                    out = Path(folder) / "result.json"
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    command = [sys.executable, __file__, "--schedule", schedule, "--pp", str(pp),
                               "--microbatches", str(microbatches), "--out", str(out)]
                    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=REPO_ROOT)
                    if done.returncode != 0 or not out.exists():
                        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-3000:]}")
                    rows.append(json.loads(out.read_text()))
    print("| schedule | p | m | measured bubble (median of steps) | theory (p-1)/(m+p-1) | step time |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['schedule']} | {r['pp']} | {r['microbatches']} | {r['measured']:.3f} | {r['theory']:.3f}"
              f" | {r['step_s'] * 1e3:.0f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--pp", type=int)
    parser.add_argument("--microbatches", type=int)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.pp is None:
        run_table()
    else:
        run_one(args)


if __name__ == "__main__":
    main()
