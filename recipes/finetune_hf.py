"""Fine-tune a Hugging Face causal LM with ``HybridStrategy`` (tp × pp × dp), from a pretrained checkpoint directory
to a Hugging Face directory that ``from_pretrained`` loads.

1. The "pretrained" checkpoint: ``--pretrained DIR`` (any ``save_pretrained`` directory), or by default a small
   Llama created from the config's ``model:`` section and saved under ``--out`` (no download).
2. The LightningModule builds the model on the meta device from ``config.json``; ``HybridStrategy(weights=DIR)``
   reads each rank's slices of the safetensors straight into the shards (no rank holds the whole model).
3. Fine-tuning on generated instruction pairs ("reverse these digits"), padded per batch to its longest sequence,
   the loss a token mean over the answers only; TensorBoard logs under ``--out/logs``.
4. A sharded checkpoint at the end, exported to ``--out/hf`` (sharded safetensors + config.json), reloaded with
   ``AutoModelForCausalLM.from_pretrained`` and evaluated next to the pretrained model.

Usage (from the repository root)::

    python recipes/finetune_hf.py                                  # yaml defaults: 4 CPU procs, tp=2 x pp=2
    python recipes/finetune_hf.py --devices 2 --tp 1 --pp 2 --max-steps 30
    python recipes/finetune_hf.py --pretrained /ckpt/Llama-3.2-1B --accelerator gpu --devices 8 --tp 2 --pp 2 \\
        --dp 2 --precision bf16-mixed                               # a real checkpoint on a GPU node
    tensorboard --logdir out/finetune/logs
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # ``recipes.*`` importable when run as a script
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch import LightningModule, Trainer, seed_everything  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from lightning_hybrid import HybridStrategy  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "finetune_llama_tiny.yaml"
PAD, BOS, SEP, EOS, DIGIT0 = 0, 1, 2, 3, 10  # token ids of the generated task
IGNORE = -100  # targets the loss skips: the prompt and the padding


class FineTune(LightningModule):
    """Next-token fine-tuning of the ``AutoModelForCausalLM`` in ``pretrained`` (built on the meta device; the
    strategy loads the weights after sharding)."""

    def __init__(self, pretrained: str, lr: float = 3e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is None:
            config = AutoConfig.from_pretrained(self.hparams.pretrained)
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        logits = self.model(inputs).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)


def instruction_pairs(samples: int, seed: int) -> list[tuple[list[int], list[int]]]:
    """``(input ids, targets)`` of "BOS d1..dn SEP dn..d1 EOS" with 2–12 digits: lengths vary, only the answer
    (after SEP) is trained on."""
    rng = random.Random(seed)
    pairs = []
    for _ in range(samples):
        digits = [DIGIT0 + rng.randrange(10) for _ in range(rng.randint(2, 12))]
        sequence = [BOS, *digits, SEP, *reversed(digits), EOS]
        answer_from = len(digits) + 2
        targets = [IGNORE if i + 1 < answer_from else token for i, token in enumerate(sequence[1:])]
        pairs.append((sequence[:-1], targets))
    return pairs


def collate(pad_to: int | None) -> Any:
    """Pad each batch to its longest sequence (or to ``pad_to``): inputs with PAD, targets with IGNORE."""
    def pad(batch: list[tuple[list[int], list[int]]]) -> tuple[Tensor, Tensor]:
        length = pad_to or max(len(inputs) for inputs, _ in batch)
        inputs = torch.tensor([x + [PAD] * (length - len(x)) for x, _ in batch])
        targets = torch.tensor([y + [IGNORE] * (length - len(y)) for _, y in batch])
        return inputs, targets
    return pad


def create_pretrained(folder: Path, model_config: dict[str, Any], seed: int) -> Path:
    """A stand-in for a published checkpoint: a Llama of ``model_config`` saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").exists() and "LOCAL_RANK" not in os.environ:  # once, before ranks start
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**model_config)).save_pretrained(folder)
    return folder


def evaluate(folder: Path, loader: DataLoader) -> tuple[float, float]:
    """Token-mean loss and answer-token accuracy of ``from_pretrained(folder)`` on one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()
    losses, right, total = [], 0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            logits = model(inputs).logits
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                          ignore_index=IGNORE))
            answer = targets != IGNORE
            right += int((logits.argmax(-1)[answer] == targets[answer]).sum())
            total += int(answer.sum())
    return float(torch.stack(losses).mean()), right / total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="YAML file with defaults")
    p.add_argument("--pretrained", help="a Hugging Face checkpoint directory (default: create a tiny Llama)")
    p.add_argument("--out", type=Path, default=Path("out/finetune"), help="logs, checkpoint and the exported model")
    for flag in ("devices", "tp", "pp", "dp", "max_steps", "microbatches"):
        p.add_argument(f"--{flag.replace('_', '-')}", type=int)
    p.add_argument("--accelerator")
    p.add_argument("--precision")
    p.add_argument("--pp-schedule")
    return p.parse_args(argv)


def load_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg = yaml.safe_load(args.config.read_text())
    for flag, section in (("devices", "trainer"), ("accelerator", "trainer"), ("precision", "trainer"),
                          ("max_steps", "trainer"), ("tp", "parallel"), ("pp", "parallel"), ("dp", "parallel"),
                          ("microbatches", "parallel"), ("pp_schedule", "parallel")):
        if getattr(args, flag) is not None:
            cfg[section][flag] = getattr(args, flag)
    cfg["pretrained"] = args.pretrained or cfg["pretrained"]
    return cfg


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = load_config(args)
    seed_everything(cfg["seed"])
    pretrained = Path(cfg["pretrained"] or create_pretrained(args.out / "pretrained", cfg["model"], cfg["seed"]))
    data = cfg["data"]
    pairs = instruction_pairs(data["samples"], cfg["seed"])
    split = len(pairs) * 9 // 10
    train = DataLoader(pairs[:split], batch_size=data["batch_size"], shuffle=True, collate_fn=collate(data["pad_to"]))
    val = DataLoader(pairs[split:], batch_size=data["batch_size"], collate_fn=collate(data["pad_to"]))
    strategy = HybridStrategy(**cfg["parallel"], weights=str(pretrained))
    trainer = Trainer(strategy=strategy, logger=TensorBoardLogger(args.out, name="logs"), enable_checkpointing=False,
                      **cfg["trainer"])
    trainer.fit(FineTune(str(pretrained), **cfg["optim"]), train, val)
    checkpoint = args.out / "checkpoint.ckpt"
    trainer.save_checkpoint(checkpoint)  # sharded: every rank writes its own part
    if trainer.is_global_zero:
        from lightning_hybrid.checkpoint.hf_export import export_hugging_face

        exported = export_hugging_face(checkpoint, args.out / "hf")  # the class the checkpoint recorded
        before, after = evaluate(pretrained, val), evaluate(exported, val)
        print(f"pretrained:  val loss {before[0]:.3f}, answer accuracy {before[1]:.1%}")
        print(f"fine-tuned:  val loss {after[0]:.3f}, answer accuracy {after[1]:.1%}  (from_pretrained({exported}))")


if __name__ == "__main__":
    main()
