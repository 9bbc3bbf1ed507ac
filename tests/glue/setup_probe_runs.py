"""What the setup probe leaves behind: random streams, BatchNorm statistics, the data, the inputs' dtype.

A SCRIPT (one process per rank), used by ``tests/glue/test_setup_batch.py``. Each ``--cases`` entry trains one fit
in the same processes; rank 0 saves ``{case: result}`` to ``--out``, each result holding every rank's figures
(``ranks``: a list by rank) and rank 0's losses and final state:

* ``losses``: ``train_loss`` of every step; ``state``: the full state dict after fit (tensor-parallel parameters
  gathered), buffers included (BatchNorm's running statistics);
* per rank: ``rng_first`` / ``rng_end``: the CPU generator's state when the first training batch starts and when
  fit ends; ``bn_at_start``: the BatchNorm buffers when training starts; ``dataloader_calls``: how often the
  ``train_dataloader`` hook ran; ``batch_ids``: the sample ids of every training batch, in order; ``dtypes``: the
  dtypes of the inputs every ``training_step`` call received (the setup probe's calls included).

The cases (``single*``: plain single-device Lightning, one process):

* ``single``, ``tp2``, ``pp2``: :class:`ProbeLM` on tokens, with dropout on activations every tensor-parallel rank
  holds whole (after the embedding, after each block's output projections) and a BatchNorm before the blocks, a
  TensorBoard logger (the monitor's prediction needs the probe too);
* ``single_stream``, ``tp2_stream``: the model without dropout and BatchNorm on :class:`OneShotStream`, an iterable
  dataset that cannot rewind;
* ``single_bf16``, ``tp2_bf16``, ``pp2_bf16``: the model without dropout and BatchNorm on float features under
  ``bf16-true``.

Usage::

    python tests/glue/setup_probe_runs.py --cases single single_bf16 --out /tmp/ref.pt
    RANK=0 WORLD_SIZE=2 ... python tests/glue/setup_probe_runs.py --cases tp2 pp2 --devices 2 --out /tmp/par.pt
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch import Tensor, nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset, TensorDataset  # noqa: E402

VOCAB, FEATURES, DIM, HEADS, SEQ, BATCH, SAMPLES = 64, 12, 32, 4, 8, 4, 16


class Block(nn.Module):
    """Pre-norm attention and MLP; dropout on each residual branch's output (whole on every tensor-parallel rank,
    after the row-parallel projection), none on the attention probabilities (sharded by heads)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.heads, self.head_dim = HEADS, DIM // HEADS
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm1(x)
        shape = (x.shape[0], x.shape[1], self.heads, self.head_dim)
        q, k, v = (layer(h).view(shape).transpose(1, 2) for layer in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + self.drop(self.o(attended))
        return x + self.drop(self.down(F.gelu(self.up(self.norm2(x)))))


class ProbeLM(pl.LightningModule):
    """Embedding (tokens) or input projection (float features), BatchNorm, dropout, the blocks, a head."""

    def __init__(self, features: bool = False, dropout: float = 0.1, batch_norm: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(FEATURES, DIM) if features else nn.Embedding(VOCAB, DIM)
        self.norm_in = nn.BatchNorm1d(DIM) if batch_norm else nn.Identity()
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dropout) for _ in range(4))
        self.head = nn.Linear(DIM, VOCAB)
        self.dtypes: set[str] = set()
        self.dataloader_calls = 0
        self.step_calls = 0  # the setup probe's included

    def training_step(self, batch: tuple[Tensor, ...], batch_idx: int) -> Tensor:
        inputs, targets = batch[0], batch[1]
        self.dtypes.add(str(inputs.dtype))
        self.step_calls += 1
        x = self.norm_in(self.embed(inputs).transpose(1, 2)).transpose(1, 2)
        x = self.drop(x)
        for block in self.blocks:
            x = block(x)
        loss = F.cross_entropy(self.head(x).flatten(0, 1).float(), targets.flatten())
        self.log("train_loss", loss, on_step=True)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=3e-3, eps=1e-5)


class LoaderHook:
    """A ``train_dataloader`` hook that counts its calls on the module."""

    def __init__(self, module: ProbeLM, make: Any) -> None:
        self.module, self.make = module, make

    def __call__(self) -> DataLoader:
        self.module.dataloader_calls += 1
        return self.make()


class OneShotStream(IterableDataset):
    """Samples ``(tokens, targets, id)`` from one stream shared by every iterator: a second iterator continues
    where the first stopped (a queue, a socket, a file read once), so nothing taken can be given back."""

    def __init__(self, tokens: Tensor) -> None:
        self.tokens = tokens
        self._stream = iter(range(len(tokens)))

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        for index in self._stream:
            row = self.tokens[index]
            yield row[:-1], row[1:], torch.tensor(index)


class Record(pl.Callback):
    """This rank's figures (see the module docstring)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.batch_ids: list[list[int]] = []
        self.rng_first: Tensor | None = None
        self.bn_at_start: dict[str, Tensor] = {}

    def on_train_start(self, trainer: pl.Trainer, module: ProbeLM) -> None:
        # A pipeline rank whose stages do not run the BatchNorm holds a stand-in without buffers.
        self.bn_at_start = {name: value.clone() for name, value in module.norm_in.named_buffers()}

    def on_train_batch_start(self, trainer: pl.Trainer, module: ProbeLM, batch: Any, batch_idx: int) -> None:
        if self.rng_first is None:
            self.rng_first = torch.get_rng_state()
        self.batch_ids.append(batch[2].tolist())

    def on_train_batch_end(self, trainer: pl.Trainer, module: ProbeLM, *unused: Any) -> None:
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _data(kind: str) -> Any:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=generator)
    ids = torch.arange(SAMPLES)
    if kind == "stream":  # one dataset, a new loader per hook call (a DataModule's usual pattern)
        stream = OneShotStream(tokens)
        return lambda: DataLoader(stream, batch_size=BATCH)
    inputs = torch.randn(SAMPLES, SEQ, FEATURES, generator=generator) if kind == "features" else tokens[:, :-1]
    return lambda: DataLoader(TensorDataset(inputs, tokens[:, 1:], ids), batch_size=BATCH)


def train(case: str, devices: int) -> dict[str, Any]:
    """One fit of ``case`` (see the module docstring); every rank's figures, rank 0's losses and state."""
    from lightning_hybrid import HybridStrategy

    layout, _, kind = case.partition("_")
    plain = kind in ("stream", "bf16")  # nothing random, no batch statistics: every layout computes as one device
    module = ProbeLM(features=kind == "bf16", dropout=0.0 if plain else 0.1, batch_norm=not plain)
    module.train_dataloader = LoaderHook(module, _data("features" if kind == "bf16" else kind))
    record = Record()
    # BatchNorm normalizes each microbatch by its own statistics: the pipeline's verification would refuse it.
    accepted = {"verify_pipeline": False} if layout == "pp2" and not plain else {}
    placement: dict[str, Any] = {"devices": 1} if layout == "single" else {
        "devices": devices, "strategy": HybridStrategy(**{layout[:2]: int(layout[2:])}, **accepted)}
    logger = TensorBoardLogger(tempfile.mkdtemp()) if kind == "" else False
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
                         precision="bf16-true" if kind == "bf16" else "32-true", callbacks=[record], **placement)
    trainer.fit(module)
    figures = {"rng_first": record.rng_first, "rng_end": torch.get_rng_state(), "bn_at_start": record.bn_at_start,
               "dataloader_calls": module.dataloader_calls, "batch_ids": record.batch_ids,
               "dtypes": sorted(module.dtypes)}
    ranks = [figures]
    if dist.is_initialized() and layout != "single":
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, figures)
    state = {} if layout.startswith("pp") else {
        name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().float().clone()
        for name, value in module.state_dict().items()}  # a pipeline rank holds its stages only
    return {"losses": record.losses, "state": state, "ranks": ranks}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", required=True)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    results = {case: train(case, args.devices) for case in args.cases}
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, args.out)


if __name__ == "__main__":
    main()
