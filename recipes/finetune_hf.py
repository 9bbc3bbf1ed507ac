"""Fine-tune a Hugging Face causal LM with ``HybridStrategy`` (tp × pp × dp), from a pretrained checkpoint directory
to a Hugging Face directory that ``from_pretrained`` loads, through ``LightningCLI`` (defaults:
``recipes/configs/finetune_llama_tiny.yaml``; ``fit`` when no subcommand is given, see :mod:`recipes.cli`).

1. The "pretrained" checkpoint: ``--pretrained DIR`` (any ``save_pretrained`` directory), or by default a small
   Llama created from the config's ``tiny_llama:`` section and saved under ``--out`` (no download) by global rank 0
   under any launcher (Lightning's, torchrun, srun), the other processes waiting for it.
2. The LightningModule builds the model on the meta device from ``config.json`` with ``model.attn_implementation``
   (``sdpa`` by default); ``HybridStrategy(weights=DIR)`` reads each rank's slices of the safetensors straight into
   the shards (no rank holds the whole model).
3. Fine-tuning on generated instruction pairs ("reverse these digits"), padded per batch to its longest sequence,
   the loss a token mean over the answers only; TensorBoard logs under ``--out/logs``.
4. A sharded checkpoint at the end, exported to ``--out/hf`` (sharded safetensors + config.json; ``--export false``
   skips it), reloaded with ``AutoModelForCausalLM.from_pretrained`` and evaluated next to the pretrained model on
   rank 0's CPU (``--evaluate false`` skips it: at billions of parameters it takes hours).

``model.pretrained`` and ``trainer.strategy.init_args.weights`` are linked to ``--pretrained`` (or the created
checkpoint), the logger's ``save_dir`` to ``--out``. Usage (from the repository root)::

    python recipes/finetune_hf.py                                  # yaml defaults: 4 CPU procs, tp=2 x pp=2
    python recipes/finetune_hf.py --trainer.devices 2 --trainer.strategy.tp 1 --trainer.max_steps 30
    python recipes/finetune_hf.py --pretrained /ckpt/Llama-3.2-1B --out runs/llama --trainer.accelerator gpu \
        --trainer.devices 8 --trainer.precision bf16-mixed          # a real checkpoint on a GPU node (dp=2)
    RECIPE=recipes/finetune_hf.py NPROC_PER_NODE=8 recipes/launch/torchrun.sh \
        --config recipes/configs/llama3_8b_1x8_h100.yaml --pretrained /ckpt/Meta-Llama-3-8B  # torchrun, restarts
    python recipes/finetune_hf.py --print_config                   # every option and its value
    tensorboard --logdir out/finetune/logs
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable, Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # ``recipes.*`` importable when run as a script
    sys.path.insert(0, str(REPO_ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import LightningDataModule, LightningModule  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
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
    strategy loads the weights after sharding).

    Arguments:
        attn_implementation: The transformers attention kernel (``"sdpa"``, its default; ``"eager"`` materializes
            the ``heads × length²`` attention scores, which at 8192 tokens dominate the activations; or any other
            name transformers accepts). The CPU evaluation after ``fit`` loads the models with the same one.
    """

    def __init__(self, pretrained: str, lr: float = 3e-3, weight_decay: float = 0.0,
                 attn_implementation: str = "sdpa") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Any = None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is None:
            config = AutoConfig.from_pretrained(self.hparams.pretrained)
            with torch.device("meta"):
                self.model = AutoModelForCausalLM.from_config(
                    config, attn_implementation=self.hparams.attn_implementation)

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


def checkpoint_folder(out: Path) -> str:
    """The periodic checkpoints' folder, shared by every attempt of the job."""
    return str(Path(out) / "checkpoints")


def pretrained_folder(pretrained: Optional[str], out: Path) -> str:
    """The checkpoint fine-tuning starts from: ``pretrained``, or the tiny one created under ``out``."""
    return pretrained or str(Path(out) / "pretrained")


#: How long the other processes wait for the rank writing the stand-in checkpoint (at Llama-3-70B's size, fp32 on one
#: CPU: 280 GB to initialize and write).
PRETRAINED_WAIT_S = 3 * 3600.0


def is_first_process(environ: Mapping[str, str]) -> bool:
    """Whether this process is global rank 0 by the variables launchers set before Lightning reads them: ``RANK``
    (torchrun), ``SLURM_PROCID`` (srun); with neither, Lightning's own launcher, whose first process on node 0 runs
    before it starts the others (they get ``LOCAL_RANK``, other nodes ``NODE_RANK``)."""
    for name in ("RANK", "SLURM_PROCID"):
        if name in environ:
            return int(environ[name]) == 0
    return int(environ.get("NODE_RANK", 0)) == 0 and int(environ.get("LOCAL_RANK", 0)) == 0


def is_complete_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def create_pretrained(folder: Path, model_config: dict[str, Any], seed: int,
                      environ: Mapping[str, str] = os.environ, timeout_s: float = PRETRAINED_WAIT_S) -> None:
    """A stand-in for a published checkpoint: a Llama of ``model_config`` saved with ``save_pretrained``, written by
    the first process (:func:`is_first_process`) under any launcher; the others wait for it up to ``timeout_s``."""
    if is_complete_checkpoint(folder):
        return
    if is_first_process(environ):
        write_pretrained(folder, model_config, seed)
        return
    deadline = time.monotonic() + timeout_s
    while not is_complete_checkpoint(folder):
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"waited {timeout_s:.0f} s for global rank 0 to create the stand-in checkpoint {folder} (config.json"
                " + *.safetensors). Is <out> on a file system every node shares? Or create it once beforehand, or"
                " pass --pretrained DIR.")
        time.sleep(min(5.0, timeout_s / 10))


def write_pretrained(folder: Path, model_config: dict[str, Any], seed: int) -> None:
    """Save into a folder of this process's own and rename it into place: ``folder`` appears complete or not at all,
    and a second writer (two launchers' first processes on a shared disk) loses the rename harmlessly."""
    from transformers import LlamaConfig, LlamaForCausalLM

    partial = folder.parent / f".{folder.name}.partial-{os.getpid()}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)
    try:
        torch.manual_seed(seed)
        LlamaForCausalLM(LlamaConfig(**model_config)).save_pretrained(partial)
        os.rename(partial, folder)  # atomic; fails when folder exists and is not empty
    except OSError:
        if not is_complete_checkpoint(folder):
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def evaluate(folder: Path, loader: DataLoader, attn_implementation: str) -> tuple[float, float]:
    """Token-mean loss and answer-token accuracy of ``from_pretrained(folder)`` on one process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation=attn_implementation).eval()
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
    """``LightningCLI`` with the recipe's own options (``--pretrained``, ``--out``, ``--tiny_llama``, ``--export``,
    ``--evaluate``), their links, the stand-in checkpoint created before anything reads it, and the export and
    evaluation after ``fit``."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument("--pretrained", type=Optional[str], default=None,
                            help="A Hugging Face checkpoint directory (config.json + *.safetensors); null: create"
                                 " the tiny Llama of tiny_llama under <out>/pretrained.")
        parser.add_argument("--out", type=Path, default=Path("out/finetune"),
                            help="Folder of the logs, the checkpoint and the exported model.")
        parser.add_argument("--tiny_llama", type=dict[str, Any], default={},
                            help="transformers.LlamaConfig fields of the checkpoint created when pretrained is null.")
        parser.add_argument("--export", type=bool, default=True,
                            help="After fit, export the sharded checkpoint to <out>/hf (rank 0 writes it).")
        parser.add_argument("--evaluate", type=bool, default=True,
                            help="After fit, load the pretrained and the exported model with from_pretrained on"
                                 " rank 0's CPU and compare them on the validation set (needs export; hours at 8B).")
        for target in ("model.pretrained", "trainer.strategy.init_args.weights"):
            parser.link_arguments(("pretrained", "out"), target, compute_fn=pretrained_folder)
        parser.link_arguments("out", "trainer.logger.init_args.save_dir")
        parser.link_arguments("seed_everything", "data.seed")
        # Periodic checkpoints in <out>/checkpoints (configured under `checkpoint:`), where a restarted job's
        # `ckpt_path: last` resumes: a launcher's restart continues the fine-tuning instead of starting it again.
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.link_arguments("out", "checkpoint.dirpath", compute_fn=checkpoint_folder)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand]
        if self.subcommand == "fit" and config.evaluate and not config.export:
            raise ValueError("--evaluate true compares the exported model with the pretrained one: it needs"
                             " --export true (or pass --evaluate false)")
        if config.pretrained is None:
            create_pretrained(Path(config.model.pretrained), config.tiny_llama, config.seed_everything)

    def after_fit(self) -> None:
        config = self.config[self.subcommand]
        out = Path(config.out)
        checkpoint = out / "checkpoint.ckpt"
        self.trainer.save_checkpoint(checkpoint)  # sharded: every rank writes its own part
        if not (self.trainer.is_global_zero and config.export):
            return
        from lightning_hybrid.checkpoint.hf_export import export_hugging_face

        # The class the checkpoint recorded; a restarted job's export replaces the one its earlier attempt wrote.
        exported = export_hugging_face(checkpoint, out / "hf", replace=True)
        if config.evaluate:
            self.compare_with_pretrained(exported)

    def compare_with_pretrained(self, exported: Path) -> None:
        val, hparams = self.datamodule.val_dataloader(), self.model.hparams
        before = evaluate(Path(hparams.pretrained), val, hparams.attn_implementation)
        after = evaluate(exported, val, hparams.attn_implementation)
        print(f"pretrained:  val loss {before[0]:.3f}, answer accuracy {before[1]:.1%}")
        print(f"fine-tuned:  val loss {after[0]:.3f}, answer accuracy {after[1]:.1%}  (from_pretrained({exported}))")


def main(args: list[str] | None = None) -> LightningCLI:
    """Run the recipe on ``args`` (default ``sys.argv[1:]``; see :mod:`recipes.cli`)."""
    return run_cli(FineTuneCLI, FineTune, InstructionData, DEFAULT_CONFIG, args)


if __name__ == "__main__":
    main()
