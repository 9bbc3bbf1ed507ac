"""Pipeline stages balanced by measured time against the FLOP-balanced ones, on blocks whose time FLOPs do not see.

A SCRIPT (one process per rank), used by ``tests/pipeline/test_measured_split.py`` and
``benchmarks/measured_split.py``. The model's blocks are alike in their matrix products (one ``dim × dim`` linear
layer each) but block ``i`` also runs ``--scans[i]`` rounds of a cumulative sum over the sequence and a ``tanh``:
time that traced FLOPs (matrix products only) count as zero. Each ``--splits`` entry trains one fit in the same
processes: ``reference`` (plain single-device Lightning), ``measured`` (``HybridStrategy(pp=N,
pp_split="measured")``) or ``flops`` (the default FLOP-balanced split). Rank 0 saves ``{entry: {"losses", "params",
"blocks_per_stage" (per rank), "measured" (the measured split's figures), "timelines" (per step, every rank's
:class:`~lightning_hybrid.pipeline.step_recorder.StepTimeline` summary, with ``--timeline``)}}`` to ``--out``.

Usage::

    python tests/pipeline/measured_split.py --splits reference --out /tmp/ref.pt
    RANK=0 WORLD_SIZE=2 ... python tests/pipeline/measured_split.py --splits measured flops --devices 2 --out /tmp/pp.pt
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from tests.pipeline.varying_lengths import StepRecord  # noqa: E402

VOCAB = 64


class ScanBlock(nn.Module):
    """A residual linear layer, then ``scans`` rounds of smoothing along the sequence: its time grows with
    ``scans``, its FLOPs do not."""

    def __init__(self, dim: int, scans: int) -> None:
        super().__init__()
        self.linear, self.scans = nn.Linear(dim, dim), scans

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(self.linear(x))
        for _ in range(self.scans):
            h = torch.tanh(h + torch.cumsum(h, dim=1) / h.shape[1])
        return x + h


class ScanLM(pl.LightningModule):
    """Embedding, the blocks, a head to the vocabulary; a token-mean cross-entropy."""

    def __init__(self, scans: list[int], dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(ScanBlock(dim, count) for count in scans)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        x = self.embed(inputs)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5)


class TimelineRecord(pl.Callback):
    """Every training step's compute actions of this rank (the monitor's timeline), kept as summaries."""

    def __init__(self) -> None:
        self.timelines: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *unused: Any) -> None:
        trainer.strategy.pipeline.record_timeline = True

    def on_train_batch_end(self, trainer: pl.Trainer, *unused: Any) -> None:
        self.timelines.append(trainer.strategy.pipeline.last_timeline.summary())


def train(entry: str, args: argparse.Namespace) -> dict[str, Any]:
    """One fit: single-device Lightning for ``"reference"``, else ``HybridStrategy(pp=--devices)`` with the
    entry's split."""
    from lightning_hybrid import HybridStrategy

    callbacks: list[pl.Callback] = [StepRecord()]
    if entry == "reference":
        placement: dict[str, Any] = {"devices": 1}
    else:
        split = "measured" if entry == "measured" else None
        placement = {"devices": args.devices, "strategy": HybridStrategy(
            pp=args.devices, pp_schedule=args.schedule, microbatches=args.microbatches, pp_split=split, monitor=False)}
        callbacks += [TimelineRecord()] if args.timeline else []
    trainer = pl.Trainer(accelerator="cpu", max_steps=args.steps, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         callbacks=callbacks, **placement)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.batch * args.steps, args.seq + 1), generator=generator)
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    trainer.fit(ScanLM(args.scans, args.dim), data)
    return _result(trainer, callbacks)


def _result(trainer: pl.Trainer, callbacks: list[pl.Callback]) -> dict[str, Any]:
    record = callbacks[0]
    result: dict[str, Any] = {"losses": record.losses, "params": record.params, "step_s": record.step_s}
    pipeline = getattr(trainer.strategy, "pipeline", None)
    if pipeline is None:
        return result
    result["blocks_per_stage"] = _gathered(pipeline.split.blocks_per_stage)
    measured = pipeline.measured_split
    result["measured"] = None if measured is None else {
        **{f.name: getattr(measured, f.name) for f in dataclasses.fields(measured) if f.name != "schedule"},
        "times": dataclasses.asdict(measured.times), "describe": measured.describe()}
    if len(callbacks) > 1:
        result["timelines"] = list(zip(*_gathered(callbacks[1].timelines)))  # per step: every rank's
    return result


def _gathered(value: Any) -> list[Any]:
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--splits", nargs="+", required=True, choices=("reference", "measured", "flops"))
    parser.add_argument("--scans", type=int, nargs="+", default=[40, 0, 0, 0], help="scan rounds of each block")
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--timeline", action="store_true", help="record every step's compute actions")
    parser.add_argument("--devices", type=int, default=1, help="ranks started: the pipeline stages (not for reference)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = {entry: train(entry, args) for entry in args.splits}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
