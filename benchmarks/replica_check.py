"""The cost of one replica check (``HybridStrategy(check_replicas_every_n_steps=N)``) next to a training step.

Model: ``tests/models.py``'s GPT widened (``--width``, ``--layers``; vocabulary 64, 16 tokens, fp32, AdamW), trained
for ``--steps`` steps with ``HybridStrategy(dp_replicate=2, tp=2)`` (HSDP over 2 replicas × tensor parallelism) on 4
CPU processes (gloo, one thread each), started by :func:`tests.helpers.on_ranks`. After the fit, each rank times
``--repeats`` calls of :func:`lightning_hybrid.resilience.replicas.check_replicas` (fingerprints of every replicated
local tensor, one all-gather per replication group, one all-reduce of the verdict) and the median ``step`` time of
the fit's last half (``on_train_batch_end`` to ``on_train_batch_end``). Printed: per rank the parameters checked,
the median check and step in ms, and the check's share of a step at N = 1 (divide by N for every N-th step).

Usage::

    OMP_NUM_THREADS=1 python benchmarks/replica_check.py --width 256 --layers 4 --steps 8 --repeats 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.helpers import on_ranks  # noqa: E402  (starts one process per rank, joined by a gloo group)
from tests.models import RandomTokenDataset, build_module  # noqa: E402


class StepClock(pl.Callback):
    """Seconds between consecutive ``on_train_batch_end`` calls."""

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self._last = 0.0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        if self._last:
            self.seconds.append(now - self._last)
        self._last = now


def _measure(rank: int, results: dict, args: argparse.Namespace, folder: str) -> None:
    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.resilience.replicas import check_replicas, plan_checks

    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="4", NODE_RANK="0")
    torch.set_num_threads(1)
    module = build_module("gpt", config={"embed_dim": args.width, "num_layers": args.layers})
    clock = StepClock()
    trainer = pl.Trainer(accelerator="cpu", devices=4, strategy=HybridStrategy(dp_replicate=2, tp=2, monitor=False),
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=folder, callbacks=[clock])
    trainer.fit(module, DataLoader(RandomTokenDataset(num_samples=8 * args.steps), batch_size=4))
    plan = plan_checks(module, trainer.strategy.device_mesh)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        check_replicas(plan, torch.device("cpu"), step=args.steps)
        seconds.append(time.perf_counter() - start)
    local = [t.parameter.to_local() if isinstance(t.parameter, DTensor) else t.parameter for t in plan.tensors]
    results[rank] = dict(tensors=len(plan.tensors), elements=sum(tensor.numel() for tensor in local),
                         check_ms=1e3 * statistics.median(seconds),
                         step_ms=1e3 * statistics.median(clock.seconds[len(clock.seconds) // 2:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        results = on_ranks(4, _measure, args, folder)
    print(f"GPT width {args.width}, {args.layers} layers, HSDP dp_replicate=2 × tp=2, 4 CPU ranks")
    for rank in range(4):
        r = results[rank]
        print(f"rank {rank}: {r['tensors']} tensors ({r['elements'] / 1e6:.2f} M local elements) checked:"
              f" {r['check_ms']:.2f} ms per check, step {r['step_ms']:.1f} ms"
              f" ({100 * r['check_ms'] / r['step_ms']:.1f} % of a step at N = 1)")


if __name__ == "__main__":
    main()
