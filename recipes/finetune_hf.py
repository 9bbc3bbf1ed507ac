"""Fine-tune a Hugging Face causal LM with ``HybridStrategy`` (tp × pp × dp), from a pretrained checkpoint directory
to a Hugging Face directory that ``from_pretrained`` loads, through ``LightningCLI`` (defaults:
``recipes/configs/finetune_llama_tiny.yaml``; ``fit`` when no subcommand is given, see :mod:`recipes.cli`).

1. The "pretrained" checkpoint: ``--pretrained DIR`` (any ``save_pretrained`` directory), or by default a small
   Llama created from the config's ``tiny_llama:`` section and saved under ``--out`` (no download).
2. The LightningModule builds the model on the meta device from ``config.json``; ``HybridStrategy(weights=DIR)``
   reads each rank's slices of the safetensors straight into the shards (no rank holds the whole model).
3. Fine-tuning on generated instruction pairs ("reverse these digits"), padded per batch to its longest sequence,
   the loss a token mean over the answers only; TensorBoard logs under ``--out/logs``.
4. A sharded checkpoint at the end, exported to ``--out/hf`` (sharded safetensors + config.json), reloaded with
   ``AutoModelForCausalLM.from_pretrained`` and evaluated next to the pretrained model.

``model.pretrained`` and ``trainer.strategy.init_args.weights`` are linked to ``--pretrained`` (or the created
checkpoint), the logger's ``save_dir`` to ``--out``. Usage (from the repository root)::

    python recipes/finetune_hf.py                                  # yaml defaults: 4 CPU procs, tp=2 x pp=2
    python recipes/finetune_hf.py --trainer.devices 2 --trainer.strategy.tp 1 --trainer.max_steps 30
    python recipes/finetune_hf.py --pretrained /ckpt/Llama-3.2-1B --out runs/llama --trainer.accelerator gpu \
        --trainer.devices 8 --trainer.precision bf16-mixed          # a real checkpoint on a GPU node (dp=2)
    python recipes/finetune_hf.py --print_config                   # every option and its value
    tensorboard --logdir out/finetune/logs
"""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # ``recipes.*`` importable when run as a script
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402
from torch import Tensor  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from recipes.cli import run_cli  # noqa: E402

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "finetune_llama_tiny.yaml"
PAD, BOS, SEP, EOS, DIGIT0 = 0, 1, 2, 3, 10  # token ids of the generated task
IGNORE = -100  # targets the loss skips: the prompt and the padding
Pairs = list[tuple[list[int], list[int]]]


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


def instruction_pairs(samples: int, seed: int) -> Pairs:
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


def collate(pad_to: int | None) -> Callable[[Pairs], tuple[Tensor, Tensor]]:
    """Pad each batch to its longest sequence (or to ``pad_to``): inputs with PAD, targets with IGNORE."""
    def pad(batch: Pairs) -> tuple[Tensor, Tensor]:
        length = pad_to or max(len(inputs) for inputs, _ in batch)
        inputs = torch.tensor([x + [PAD] * (length - len(x)) for x, _ in batch])
        targets = torch.tensor([y + [IGNORE] * (length - len(y)) for _, y in batch])
        return inputs, targets
    return pad


class InstructionData(LightningDataModule):
    """The generated instruction pairs, the first 90% for training and the rest for validation.

    Arguments:
        batch_size: Pairs per batch and data-parallel rank.
        samples: Pairs generated (2000: 1800 train + 200 validation, every batch full at 8).
        pad_to: ``None``: pad each batch to its longest sequence (dynamic padding); or a fixed length.
        seed: Seed of the generator.
    """

    def __init__(self, batch_size: int = 8, samples: int = 2000, pad_to: Optional[int] = None,
                 seed: int = 1234) -> None:
        super().__init__()
        self.batch_size, self.collate = batch_size, collate(pad_to)
        pairs = instruction_pairs(samples, seed)
        split = len(pairs) * 9 // 10
        self.train_pairs, self.val_pairs = pairs[:split], pairs[split:]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_pairs, batch_size=self.batch_size, shuffle=True, collate_fn=self.collate)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_pairs, batch_size=self.batch_size, collate_fn=self.collate)


def pretrained_folder(pretrained: Optional[str], out: Path) -> str:
    """The checkpoint fine-tuning starts from: ``pretrained``, or the tiny one created under ``out``."""
    return pretrained or str(Path(out) / "pretrained")


def create_pretrained(folder: Path, model_config: dict[str, Any], seed: int) -> None:
    """A stand-in for a published checkpoint: a Llama of ``model_config`` saved with ``save_pretrained``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if not (folder / "config.json").exists() and "LOCAL_RANK" not in os.environ:  # once, before ranks start
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**model_config)).save_pretrained(folder)


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


class FineTuneCLI(LightningCLI):
    """``LightningCLI`` with the recipe's own options (``--pretrained``, ``--out``, ``--tiny_llama``), their links,
    the stand-in checkpoint created before anything reads it, and the export and evaluation after ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--pretrained", type=Optional[str], default=None,
                            help="A Hugging Face checkpoint directory (config.json + *.safetensors); null: create"
                                 " the tiny Llama of tiny_llama under <out>/pretrained.")
        parser.add_argument("--out", type=Path, default=Path("out/finetune"),
                            help="Folder of the logs, the checkpoint and the exported model.")
        parser.add_argument("--tiny_llama", type=dict[str, Any], default={},
                            help="transformers.LlamaConfig fields of the checkpoint created when pretrained is null.")
        for target in ("model.pretrained", "trainer.strategy.init_args.weights"):
            parser.link_arguments(("pretrained", "out"), target, compute_fn=pretrained_folder)
        parser.link_arguments("out", "trainer.logger.init_args.save_dir")
        parser.link_arguments("seed_everything", "data.seed")

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if config.pretrained is None:
            create_pretrained(Path(config.model.pretrained), config.tiny_llama, config.seed_everything)

    def after_fit(self) -> None:
        out = Path(self.config[self.subcommand].out)
        checkpoint = out / "checkpoint.ckpt"
        self.trainer.save_checkpoint(checkpoint)  # sharded: every rank writes its own part
        if self.trainer.is_global_zero:
            from lightning_hybrid.checkpoint.hf_export import export_hugging_face

            exported = export_hugging_face(checkpoint, out / "hf")  # the class the checkpoint recorded
            val = self.datamodule.val_dataloader()
            before, after = evaluate(Path(self.model.hparams.pretrained), val), evaluate(exported, val)
            print(f"pretrained:  val loss {before[0]:.3f}, answer accuracy {before[1]:.1%}")
            print(f"fine-tuned:  val loss {after[0]:.3f}, answer accuracy {after[1]:.1%}"
                  f"  (from_pretrained({exported}))")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the recipe on ``args`` (default ``sys.argv[1:]``; see :mod:`recipes.cli`)."""
    return run_cli(FineTuneCLI, FineTune, InstructionData, DEFAULT_CONFIG, args)


if __name__ == "__main__":
    main()
