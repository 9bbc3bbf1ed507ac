"""Fine-tuning data under pipeline parallelism: dynamically padded batches of varying lengths and a smaller last batch.

A SCRIPT (one process per rank), used by ``tests/pipeline/test_varying_lengths.py`` and
``benchmarks/varying_lengths.py``. Every batch is padded to its longest sequence (labels of padding ``-100``, so the
loss is a mean over real tokens); 23 samples in batches of 4 leave a last batch of 3, which two microbatches split
into 2 + 1 samples (two microbatches under every schedule). Each ``--schedules`` entry trains one fit in the same processes (``reference``: plain
single-device Lightning) and rank 0 saves ``{schedule: {"losses", "step_s", "params"}}`` to ``--out``.

Usage::

    python tests/pipeline/varying_lengths.py --schedules reference --out /tmp/ref.pt
    RANK=0 WORLD_SIZE=2 ... python tests/pipeline/varying_lengths.py --schedules 1f1b gpipe --out /tmp/pp.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tests.models import LlamaConfig, TinyLlama  # noqa: E402

IGNORE = -100


def make_samples(count: int, lengths: tuple[int, int], seed: int = 7) -> list[Tensor]:
    """``count`` token sequences of random lengths in ``lengths`` (inclusive), the same in every process."""
    generator = torch.Generator().manual_seed(seed)
    sizes = torch.randint(lengths[0], lengths[1] + 1, (count,), generator=generator)
    return [torch.randint(0, 64, (int(n) + 1,), generator=generator) for n in sizes]


def pad_collate(samples: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Inputs padded with 0 and labels with ``-100`` to the batch's longest sequence (dynamic padding)."""
    longest = max(len(s) for s in samples) - 1
    inputs = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE, dtype=torch.long)
    for row, sample in enumerate(samples):
        inputs[row, : len(sample) - 1], labels[row, : len(sample) - 1] = sample[:-1], sample[1:]
    return inputs, labels


class PaddedLM(pl.LightningModule):
    """A Llama-style decoder fine-tuned with a token-mean loss over non-padding labels."""

    def __init__(self, layers: int = 4, dim: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = TinyLlama(LlamaConfig(n_layers=layers, dim=dim, ffn_hidden=2 * dim))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        inputs, labels = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE)
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        # eps=1e-5 as in tests/models.py: with the default 1e-8, near-zero gradients turn rounding into steps.
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5)


class StepRecord(pl.Callback):
    """Logged loss and wall time of every step; the full parameters at the end (gathered over pipeline ranks)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.step_s: list[float] = []
        self.params: dict[str, Tensor] = {}
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.step_s.append(time.perf_counter() - self._start)
        self.losses.append(float(trainer.callback_metrics["train_loss"]))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(pl_module, options=options).items()}
        if trainer.world_size == 1:
            self.params = local
            return
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        self.params = {k: v for rank_dict in gathered for k, v in rank_dict.items()}


def train(schedule: str, samples: list[Tensor], epochs: int, batch_size: int, stages: int) -> dict[str, Any]:
    """One fit: single-device Lightning for ``"reference"``, else ``HybridStrategy(pp=stages)`` with ``schedule``."""
    from lightning_hybrid import HybridStrategy

    record = StepRecord()
    placement = {"devices": 1} if schedule == "reference" else {
        "devices": stages, "strategy": HybridStrategy(pp=stages, pp_schedule=schedule, microbatches=2)}
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, gradient_clip_val=0.1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, callbacks=[record],
        **placement,
    )
    trainer.fit(PaddedLM(), DataLoader(samples, batch_size=batch_size, collate_fn=pad_collate))
    return {"losses": record.losses, "step_s": record.step_s, "params": record.params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", required=True)
    parser.add_argument("--samples", type=int, default=23)
    parser.add_argument("--lengths", type=int, nargs=2, default=(4, 16), help="shortest and longest sequence")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--devices", type=int, default=1, help="ranks started: the pipeline stages (not for reference)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    samples = make_samples(args.samples, tuple(args.lengths))
    results = {schedule: train(schedule, samples, args.epochs, args.batch_size, args.devices) for schedule in args.schedules}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
