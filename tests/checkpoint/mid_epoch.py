"""Fits that save mid-epoch and resume, recording which samples every step saw (a SCRIPT: one process per rank).

Used by ``tests/checkpoint/test_data_position.py``. A tiny regression model on 48 numbered samples, 3 samples per
rank per batch, gradient accumulation 2, AdamW with a per-step LR schedule, shuffled by the ``DistributedSampler``
Lightning injects; ``ModelCheckpoint(every_n_train_steps=3)`` saves at steps 3, 6 and 9, all inside an epoch
(dp=2: 8 batches, 4 steps per epoch). Each ``--runs`` entry is one fit in these processes::

    {"name": "a", "loader": "plain" | "stateful", "save": true, "ckpt": null | "<name>/<file>", "steps": 10}

Rank 0 saves ``{name: {"losses", "ids" (per batch, every rank's), "epochs" (per batch), "learning_rate" (at the
end), "params", "global_step", "current_epoch"}}`` to ``--out``. ``"ckpt"`` is relative to ``--root``,
where every run's checkpoints go into the folder of its name.
"""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, Dataset

from lightning_hybrid import HybridStrategy

NUM_SAMPLES, RANK_BATCH = 48, 3


class NumberedSamples(Dataset):
    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(NUM_SAMPLES, 4, generator=generator)
        self.y = torch.randn(NUM_SAMPLES, 1, generator=generator)

    def __len__(self) -> int:
        return NUM_SAMPLES

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        return index, self.x[index], self.y[index]


class Regression(LightningModule):
    def __init__(self, loader: str) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
        self.loader, self.losses, self.ids, self.epochs = loader, [], [], []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        ids, x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.detach().clone())
        self.ids.append(ids.tolist())
        self.epochs.append(self.current_epoch)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.05)
        schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def train_dataloader(self) -> DataLoader:
        if self.loader == "stateful":
            from torchdata.stateful_dataloader import StatefulDataLoader

            return StatefulDataLoader(NumberedSamples(), batch_size=RANK_BATCH)
        return DataLoader(NumberedSamples(), batch_size=RANK_BATCH)


def fit(run: dict[str, Any], root: Path, devices: int) -> dict[str, Any]:
    module = Regression(run["loader"])
    callbacks = [ModelCheckpoint(dirpath=root / run["name"], every_n_train_steps=3, save_top_k=-1)] if run.get(
        "save") else []
    trainer = Trainer(accelerator="cpu", devices=devices, strategy=HybridStrategy(monitor=False),
                      max_steps=run.get("steps", 10), accumulate_grad_batches=2, callbacks=callbacks,
                      enable_checkpointing=bool(callbacks), logger=False, enable_progress_bar=False,
                      enable_model_summary=False)
    trainer.fit(module, ckpt_path=str(root / run["ckpt"]) if run.get("ckpt") else None)
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in module.net.named_parameters()}
    return {"losses": _over_ranks(module.losses), "ids": _over_ranks(module.ids), "epochs": module.epochs,
            "learning_rate": trainer.optimizers[0].param_groups[0]["lr"], "params": params, "global_step": trainer.global_step,
            "current_epoch": trainer.current_epoch}


def _over_ranks(per_batch: list[Any]) -> list[Any]:
    """Per batch, the list of every rank's value (rank order)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, per_batch)
    return [[rank[i] for rank in gathered] for i in range(len(per_batch))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--devices", type=int, required=True)
    parser.add_argument("--runs", type=json.loads, required=True)
    parser.add_argument("--root", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    results = {run["name"]: fit(run, args.root, args.devices) for run in args.runs}
    if dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
