"""Pretrain a tiny character-level GPT with ``HybridStrategy`` (FSDP2 x TP x PP).

The model and LightningModule (``recipes/gpt.py``) contain no parallelism code;
the layout is chosen entirely by the strategy arguments below.

Usage (from the repository root)::

    python recipes/pretrain_gpt.py                         # yaml defaults: 4 CPU procs, tp=2 x pp=2 (1F1B)
    python recipes/pretrain_gpt.py --devices 2 --dp 2 --tp 1 --pp 1 --max-steps 50
    python recipes/pretrain_gpt.py --devices 4 --tp 1 --pp 4 --pp-schedule interleaved_1f1b --microbatches 8
    python recipes/pretrain_gpt.py --accelerator gpu --devices 8 --dp 2 --tp 2 --pp 2 --precision bf16-mixed
    python recipes/pretrain_gpt.py --devices 4 --dp auto --tp auto --pp auto   # the planner chooses (logged)
    python recipes/pretrain_gpt.py --activation-checkpointing selective --offload   # less memory, more time
    python recipes/pretrain_gpt.py --peak-flops 5e10 --chrome-trace-dir traces   # MFU on a CPU; timeline traces
    tensorboard --logdir lightning_logs

A checkpoint is written every ``checkpoint.every_n_train_steps`` steps to ``<log-dir>/checkpoints`` and a run
resumes from the newest complete one there (``--ckpt-path last``, the default), so running the same command again
after a crash continues the training; ``recipes/launch/torchrun.sh`` and ``recipes/launch/slurm.sbatch`` do that
by themselves (torchrun's ``--max-restarts``, SLURM's ``--requeue``).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path
from typing import Any

# Make ``recipes.*`` importable when run as ``python recipes/pretrain_gpt.py``
# (Python only puts ``recipes/`` itself on sys.path in that case).
REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lightning_hybrid import HybridStrategy, ParallelMonitor  # noqa: E402
from recipes.data import GrammarDataModule  # noqa: E402
from recipes.gpt import GPTConfig, GPTLightning  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "gpt_tiny.yaml"

# (flag dest, config section, config key): flags left unset keep the yaml value.
OVERRIDES: list[tuple[str, str | None, str]] = [
    ("devices", "trainer", "devices"),
    ("num_nodes", "trainer", "num_nodes"),
    ("accelerator", "trainer", "accelerator"),
    ("precision", "trainer", "precision"),
    ("max_steps", "trainer", "max_steps"),
    ("dp", "parallel", "dp"),
    ("tp", "parallel", "tp"),
    ("pp", "parallel", "pp"),
    ("dp_replicate", "parallel", "dp_replicate"),
    ("zero", "parallel", "zero"),
    ("pp_schedule", "parallel", "pp_schedule"),
    ("microbatches", "parallel", "microbatches"),
    ("virtual_stages", "parallel", "virtual_stages"),
    ("activation_checkpointing", "parallel", "activation_checkpointing"),
    ("offload", "parallel", "offload"),
    ("batch_size", "data", "batch_size"),
    ("seed", None, "seed"),
    ("peak_flops", "monitor", "peak_flops"),
    ("timeline_every_n_steps", "monitor", "timeline_every_n_steps"),
    ("chrome_trace_dir", "monitor", "chrome_trace_dir"),
    ("checkpoint_every_n_steps", "checkpoint", "every_n_train_steps"),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML file with defaults")
    p.add_argument("--devices", type=int, help="processes (devices) per node")
    p.add_argument("--num-nodes", type=int)
    p.add_argument("--accelerator", help="cpu (yaml default) | gpu | cuda | auto")
    p.add_argument("--dp", type=_int_or_auto, help='sharded data-parallel degree, or "auto"')
    p.add_argument("--tp", type=_int_or_auto, help='tensor-parallel degree, or "auto" (chosen by the planner)')
    p.add_argument("--pp", type=_int_or_auto, help='pipeline-parallel degree, or "auto" (chosen by the planner)')
    p.add_argument("--pp-schedule", help="gpipe | 1f1b | interleaved_1f1b | looped_bfs | interleaved_zero_bubble |"
                   " zbv_zero_bubble | dualpipev")
    p.add_argument("--microbatches", type=int, help="pipeline microbatches per step (must divide --batch-size)")
    p.add_argument("--virtual-stages", type=int, help="pipeline stages per rank (interleaved and V schedules)")
    p.add_argument("--dp-replicate", type=int, help="replicated data-parallel degree (HSDP)")
    p.add_argument("--zero", type=int, choices=(2, 3), help="FSDP resharding: 3 (default) or 2")
    p.add_argument("--activation-checkpointing", type=_checkpointing_mode,
                   help='"none" | "every" | "selective" | N (every N-th block)')
    p.add_argument("--offload", action=argparse.BooleanOptionalAction,
                   help="keep sharded parameters, gradients and optimizer state in CPU memory")
    p.add_argument("--precision", help='e.g. "32-true", "bf16-mixed", "bf16-true"')
    p.add_argument("--max-steps", type=int)
    p.add_argument("--batch-size", type=int, help="per data-parallel rank")
    p.add_argument("--seed", type=int)
    p.add_argument("--log-dir", default="lightning_logs", help="TensorBoard save_dir")
    p.add_argument("--ckpt-path", default="last",
                   help='checkpoint to resume from; "last" (default): the newest complete one in <log-dir>/checkpoints'
                        ' if there is one, else start afresh')
    p.add_argument("--checkpoint-every-n-steps", type=int, help="training steps between checkpoints")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s of one device, for MFU (CPUs and unknown GPUs)")
    p.add_argument("--timeline-every-n-steps", type=int, help="steps between pipeline timeline images")
    p.add_argument("--chrome-trace-dir", help="also write the timeline steps as Chrome traces here")
    return p.parse_args(argv)


def _int_or_auto(value: str) -> int | str:
    return value if value == "auto" else int(value)


def _checkpointing_mode(value: str) -> int | str:
    return int(value) if value.lstrip("-").isdigit() else value


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    """Read the yaml file and apply the command-line overrides that were given."""
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    for dest, section, key in OVERRIDES:
        value = getattr(args, dest)
        if value is not None:
            (cfg[section] if section else cfg)[key] = value
    return cfg


def padded_vocab_size(vocab_size: int, multiple: int) -> int:
    """Round up so the LM head / embedding can be split evenly across tp ranks."""
    return math.ceil(vocab_size / multiple) * multiple


class LossHistory(Callback):
    """Record the (rank-synced) ``train_loss`` of every step for the final summary."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        loss = trainer.callback_metrics.get("train_loss")
        if loss is not None:
            self.losses.append(float(loss))


def build_trainer(cfg: dict[str, Any], log_dir: str, history: LossHistory) -> Trainer:
    t, par, mon = cfg["trainer"], cfg["parallel"], cfg["monitor"]
    pipeline = (
        dict(pp_schedule=par["pp_schedule"], microbatches=par["microbatches"], virtual_stages=par["virtual_stages"])
        if par["pp"] == "auto" or par["pp"] > 1
        else {}
    )
    strategy = HybridStrategy(
        dp=par["dp"], tp=par["tp"], pp=par["pp"], dp_replicate=par["dp_replicate"], zero=par["zero"],
        activation_checkpointing=par["activation_checkpointing"], offload=par["offload"], **pipeline,
        monitor=ParallelMonitor(
            peak_flops=mon["peak_flops"], timeline_every_n_steps=mon["timeline_every_n_steps"],
            chrome_trace_dir=mon["chrome_trace_dir"],
        ),
    )
    return Trainer(
        accelerator=t["accelerator"],
        devices=t["devices"],
        num_nodes=t["num_nodes"],
        strategy=strategy,
        logger=TensorBoardLogger(save_dir=log_dir, name=""),  # logs in <log_dir>/version_N
        callbacks=[history, LearningRateMonitor(logging_interval="step"), periodic_checkpoints(cfg, log_dir)],
        max_steps=t["max_steps"],
        precision=t["precision"],
        gradient_clip_val=t["gradient_clip_val"],
        val_check_interval=t["val_check_interval"],
        # Validate every `val_check_interval` steps regardless of epoch length,
        # so the schedule does not depend on how many ranks split the data.
        check_val_every_n_epoch=None,
        limit_val_batches=t["limit_val_batches"],
        log_every_n_steps=t["log_every_n_steps"],
    )


def periodic_checkpoints(cfg: dict[str, Any], log_dir: str) -> ModelCheckpoint:
    """Checkpoints every few steps in one folder shared by all attempts (not the logger's ``version_N``), where a
    restarted run's ``ckpt_path="last"`` finds them. The newest ``keep`` are kept (ordered by step), so a damaged
    newest one leaves an earlier one to resume from."""
    return ModelCheckpoint(
        dirpath=Path(log_dir) / "checkpoints", every_n_train_steps=cfg["checkpoint"]["every_n_train_steps"],
        save_last=True, monitor="step", mode="max", save_top_k=cfg["checkpoint"]["keep"],
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = load_config(args)
    m, d, o = cfg["model"], cfg["data"], cfg["optim"]

    # num_workers=0 is intentional: the corpus is an in-memory tensor.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")

    datamodule = GrammarDataModule(
        block_size=m["block_size"],
        batch_size=d["batch_size"],
        num_chars=d["num_chars"],
        num_workers=d["num_workers"],
        seed=cfg["seed"],
    )
    config = GPTConfig(
        vocab_size=padded_vocab_size(datamodule.tokenizer.vocab_size, m["vocab_multiple"]),
        block_size=m["block_size"],
        n_layer=m["n_layer"],
        n_head=m["n_head"],
        n_embd=m["n_embd"],
    )
    # Seed before building the model so every rank starts from identical weights.
    seed_everything(cfg["seed"], workers=True)
    model = GPTLightning(
        config,
        lr=o["lr"],
        weight_decay=o["weight_decay"],
        warmup_steps=o["warmup_steps"],
        max_steps=cfg["trainer"]["max_steps"],
    )

    history = LossHistory()
    trainer = build_trainer(cfg, args.log_dir, history)
    start = time.perf_counter()
    trainer.fit(model, datamodule=datamodule, ckpt_path=args.ckpt_path)
    elapsed = time.perf_counter() - start

    if trainer.is_global_zero:
        print_summary(trainer, history, elapsed)
    if torch.distributed.is_initialized():
        # Close gloo/NCCL connections on all ranks together rather than at interpreter exit.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def print_summary(trainer: Trainer, history: LossHistory, elapsed: float) -> None:
    print("\n=== pretrain_gpt summary ===")
    print(f"steps: {trainer.global_step}  time: {elapsed:.1f}s")
    if history.losses:
        print(f"train_loss: first {history.losses[0]:.4f}  last {history.losses[-1]:.4f}")
    val = trainer.callback_metrics.get("val_loss")
    if val is not None:
        print(f"val_loss (last validation): {float(val):.4f}")
    if trainer.logger is not None:
        print(f"TensorBoard logs: {trainer.logger.log_dir}  (tensorboard --logdir {trainer.logger.save_dir})")


if __name__ == "__main__":
    main()
