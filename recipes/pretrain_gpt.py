"""Pretrain a tiny character-level GPT with ``HybridStrategy`` (FSDP2 x TP x PP), through ``LightningCLI``.

The model and LightningModule (``recipes/gpt.py``) contain no parallelism code; the layout is chosen entirely by
the strategy's arguments, ``trainer.strategy.init_args`` in ``recipes/configs/gpt_tiny.yaml``. Every value of that
file can be changed on the command line (``--trainer.strategy.tp 4``) or by a file of your own (``--config``).

``gpt_tiny.yaml`` is the parser's default config file, and ``fit`` is the subcommand unless the arguments start
with another (``validate``, ...; see :mod:`recipes.cli`), so ``python recipes/pretrain_gpt.py`` alone trains with
the file's defaults (4 CPU processes, tp=2 x pp=2, 1F1B, 2 microbatches) and ``python recipes/pretrain_gpt.py
--trainer.max_steps 50`` is ``fit --trainer.max_steps 50``. Usage (from the repository root)::

    python recipes/pretrain_gpt.py                         # yaml defaults: 4 CPU procs, tp=2 x pp=2 (1F1B)
    python recipes/pretrain_gpt.py --trainer.devices 2 --trainer.strategy.tp 1 --trainer.strategy.pp 1 \\
        --trainer.max_steps 50                             # dp=2 (dp: auto takes what tp x pp leave)
    python recipes/pretrain_gpt.py --trainer.strategy.tp 1 --trainer.strategy.pp 4 \\
        --trainer.strategy.pp_schedule interleaved_1f1b --trainer.strategy.microbatches 8
    python recipes/pretrain_gpt.py --trainer.accelerator gpu --trainer.devices 8 --trainer.precision bf16-mixed
    python recipes/pretrain_gpt.py --trainer.strategy.tp auto --trainer.strategy.pp auto   # the planner chooses
    python recipes/pretrain_gpt.py --trainer.strategy.activation_checkpointing selective \\
        --trainer.strategy.offload true                    # less memory, more time
    python recipes/pretrain_gpt.py --trainer.strategy.monitor.peak_flops 5e10 \\
        --trainer.strategy.monitor.chrome_trace_dir traces  # MFU on a CPU; timeline traces
    python recipes/pretrain_gpt.py --print_config > my.yaml && python recipes/pretrain_gpt.py --config my.yaml
    python recipes/pretrain_gpt.py --help                  # every option, with its type and default
    tensorboard --logdir lightning_logs

Derived values are links, not flags: the model's vocabulary is the data's (``data.vocab_size``: the characters of
the corpus padded up to ``data.vocab_multiple``), the data's ``block_size`` the model's, the LR schedule's length
``trainer.max_steps``, and the checkpoint folder ``<trainer.logger.init_args.save_dir>/checkpoints``.

A checkpoint is written every ``checkpoint.every_n_train_steps`` steps to that folder and a run resumes from the
newest complete one there (``ckpt_path: last``, the default), so running the same command again after a crash
continues the training; ``recipes/launch/torchrun.sh`` and ``recipes/launch/slurm.sbatch`` do that by themselves
(torchrun's ``--max-restarts``, SLURM's ``--requeue``).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

# Make ``recipes.*`` importable when run as ``python recipes/pretrain_gpt.py``
# (Python only puts ``recipes/`` itself on sys.path in that case).
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

from recipes.cli import run_cli  # noqa: E402
from recipes.data import GrammarDataModule  # noqa: E402
from recipes.gpt import GPTLightning  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "gpt_tiny.yaml"


class LossHistory(Callback):
    """Record the (rank-synced) ``train_loss`` of every step for the final summary."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))


def checkpoint_folder(save_dir: str | Path) -> str:
    """The periodic checkpoints' folder: one per log directory, shared by all attempts (not the logger's
    ``version_N``), where a restarted run's ``ckpt_path: last`` finds them."""
    return str(Path(save_dir) / "checkpoints")


class PretrainCLI(LightningCLI):
    """``LightningCLI`` with the recipe's links, its checkpoint callback and a summary after ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # A forced callback, configured under `checkpoint:` (the newest `save_top_k` kept, ordered by step, so a
        # damaged newest checkpoint leaves an earlier one to resume from).
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.link_arguments("trainer.logger.init_args.save_dir", "checkpoint.dirpath", compute_fn=checkpoint_folder)
        parser.link_arguments("model.config.block_size", "data.block_size")
        parser.link_arguments("trainer.max_steps", "model.max_steps")  # the cosine schedule ends with training
        parser.link_arguments("seed_everything", "data.seed")
        # The corpus (and so its vocabulary) exists once the datamodule is built: linked at instantiation.
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")

    def before_fit(self) -> None:
        self.history = LossHistory()
        self.trainer.callbacks.append(self.history)
        self.start = time.perf_counter()

    def after_fit(self) -> None:
        if self.trainer.is_global_zero:
            print_summary(self.trainer, self.history, time.perf_counter() - self.start)
        if torch.distributed.is_initialized():
            # Close gloo/NCCL connections on all ranks together rather than at interpreter exit.
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def print_summary(trainer: Trainer, history: LossHistory, elapsed: float) -> None:
    print("\n=== pretrain_gpt summary ===")
    print(f"steps: {trainer.global_step}  time: {elapsed:.1f}s")
    checkpoints = trainer.checkpoint_callback.dirpath if trainer.checkpoint_callback is not None else None
    print(f"resumed from: {trainer.ckpt_path}" if trainer.ckpt_path else f"started fresh (no checkpoint in {checkpoints})")
    if history.losses:
        print(f"train_loss: first {history.losses[0]:.4f}  last {history.losses[-1]:.4f}")
    val = trainer.callback_metrics.get("val_loss")
    if val is not None:
        print(f"val_loss (last validation): {float(val):.4f}")
    if trainer.logger is not None:
        print(f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir})")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the recipe on ``args`` (default ``sys.argv[1:]``; see :mod:`recipes.cli`)."""
    return run_cli(PretrainCLI, GPTLightning, GrammarDataModule, DEFAULT_CONFIG, args)


if __name__ == "__main__":
    main()
