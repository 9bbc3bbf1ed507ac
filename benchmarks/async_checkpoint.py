"""Training stall per checkpoint save, synchronous vs ``HybridStrategy(async_checkpoint=True)``.

Two CPU ranks (dp2, FSDP2) train ``tests/models.py``'s GPT at ``--embed-dim`` × ``--layers`` (about 28 MiB of
fp32 parameters at the defaults; with AdamW's two moments the checkpoint is three times that) and call
``trainer.save_checkpoint`` every ``--every`` steps. Per mode and round it records rank 0's seconds inside
``save_checkpoint`` and the fit's wall time; a round without saves is the baseline, so the *stall per save* is
``(fit time - baseline fit time) / saves``: the time training lost per save, including the slowdown of the steps
that share the CPU with a background write. Modes alternate within each round (the order flips every round) so
drift falls on all of them. The last asynchronous save is waited for at the end of fit, which the fit time includes.

Usage::

    python benchmarks/async_checkpoint.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODES = ("none", "sync", "async")


def _fit(mode: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One fit of ``args.steps`` steps in ``mode``; returns rank 0's save seconds and the fit's wall seconds."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hybrid import HybridStrategy
    from tests.models import RandomTokenDataset, build_module

    config = {"embed_dim": args.embed_dim, "num_layers": args.layers, "seq_len": 64, "vocab_size": 256}
    save_seconds: list[float] = []

    class SaveEveryN(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *_: Any) -> None:
            if mode != "none" and trainer.global_step % args.every == 0:
                start = time.perf_counter()
                trainer.save_checkpoint(folder / f"step={trainer.global_step}.ckpt")
                save_seconds.append(time.perf_counter() - start)

    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, async_checkpoint=mode == "async"),
                         max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[SaveEveryN()])
    data = DataLoader(RandomTokenDataset(args.steps * 4, config["seq_len"], config["vocab_size"]), batch_size=2)
    start = time.perf_counter()
    trainer.fit(build_module("gpt", config=config), train_dataloaders=data)
    return {"save_s": save_seconds, "fit_s": time.perf_counter() - start}


def worker(rank: int, results: Any, args: argparse.Namespace, folder: str) -> None:
    """Every round's fits on this rank (started by :func:`tests.helpers.on_ranks`); rank 0 reports."""
    import os

    warnings.filterwarnings("ignore")
    # torchrun's variables: Lightning then joins the existing process group instead of launching processes.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0")
    from benchmarks.harness import alternating

    for round_index, mode in alternating(MODES, args.rounds):
        measured = _fit(mode, args, Path(folder) / f"{mode}-{round_index}")
        if rank == 0:
            results[f"{mode}-{round_index}"] = measured


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--every", type=int, default=6, help="save every N optimizer steps")
    parser.add_argument("--embed-dim", type=int, default=384)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from benchmarks.harness import markdown_table
    from tests.helpers import on_ranks

    with tempfile.TemporaryDirectory() as folder:
        results = on_ranks(2, worker, args, folder)
    saves = args.steps // args.every
    fit = {mode: statistics.median(results[f"{mode}-{i}"]["fit_s"] for i in range(args.rounds)) for mode in MODES}
    print(f"dp2 on 2 CPU processes, GPT embed {args.embed_dim} x {args.layers} blocks, {args.steps} steps, a save"
          f" every {args.every} ({saves} saves), {args.rounds} rounds; medians over rounds")
    rows = [["no saves", "-", f"{fit['none']:.2f}", "-"]]
    for mode in ("sync", "async"):
        inside = statistics.median(s for i in range(args.rounds) for s in results[f"{mode}-{i}"]["save_s"])
        rows.append([mode, f"{inside:.3f}", f"{fit[mode]:.2f}", f"{(fit[mode] - fit['none']) / saves:.3f}"])
    print(markdown_table(["mode", "seconds inside save_checkpoint (median of saves)", "fit seconds",
                          "stall per save, seconds"], rows))


if __name__ == "__main__":
    main()
