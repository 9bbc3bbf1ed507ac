"""What ``HybridStrategy`` adds to Lightning's checkpoints and restores from them (:class:`CheckpointRecords`).

* **Exact resume**: the data order after ``Trainer.fit(ckpt_path=...)`` must be the one the interrupted run would
  have seen. Lightning 2.6.6 sets the training sampler's epoch from its epoch-progress counter, and when a run
  trained by ``max_steps`` resumes from a checkpoint written at the end of an epoch, that counter is one ahead of
  ``trainer.current_epoch`` (measured: a resumed epoch 1 drew the permutation of epoch 2; runs bounded by
  ``max_epochs`` are not affected). The shuffled order then differs from the uninterrupted run's, and so do the
  losses. Every training sampler's epoch is set to ``trainer.current_epoch`` at the start of each epoch, before the
  loader is iterated; in an uninterrupted run both numbers are equal and nothing changes.
* **Mid-epoch resume**: each training batch is counted on the training sampler, whose position Lightning saves
  and restores through the loader (:mod:`lightning_hybrid.checkpoint.data_position`); when a resumed epoch has
  another number of batches left (another data-parallel size), Lightning's batch counters are aligned to it.
* **The module's class** is recorded under :data:`MODULE_CLASS_KEY` as ``"package.module:ClassName"`` (or
  ``"/path/to/script.py:ClassName"`` for a class defined in the script that was run), so an export can rebuild the
  module from the checkpoint alone (``lightning-hybrid export CKPT OUT --hf``). Lightning itself records only the
  constructor's arguments (``hyper_parameters``).

Example::

    trainer = Trainer(max_steps=1000, callbacks=[CheckpointRecords()])   # HybridStrategy adds it itself
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

from lightning.pytorch import Callback, LightningModule, Trainer
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid._compat import set_sampler_epoch, tree_leaves
from lightning_hybrid.checkpoint.data_position import align_batch_progress, resumable_sampler
from lightning_hybrid.checkpoint.module_class import MODULE_CLASS_KEY



class CheckpointRecords(Callback):
    """Keep the training samplers' epoch equal to ``trainer.current_epoch`` and record the module's class in every
    checkpoint (see the module docstring)."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for sampler in _resumable_samplers(trainer):
            align_batch_progress(trainer, sampler)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for loader in _train_loaders(trainer):
            set_sampler_epoch(loader, trainer.current_epoch)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        for sampler in _resumable_samplers(trainer):
            sampler.note_batch()

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # fully_shard swaps the module's class for a subclass it makes (FSDP<Name>); the user's class is its base
        user_class = next(c for c in type(pl_module).__mro__ if not issubclass(c, FSDPModule))
        class_path = module_class_path(user_class)
        if class_path is not None:
            checkpoint[MODULE_CLASS_KEY] = class_path


def _train_loaders(trainer: Trainer) -> list[Any]:
    loaders = trainer.train_dataloader  # one loader, or a list/dict of them; None before the data is set up
    return tree_leaves(loaders) if loaders is not None else []


def _resumable_samplers(trainer: Trainer) -> list[Any]:
    return [s for s in map(resumable_sampler, _train_loaders(trainer)) if s is not None]


def module_class_path(module_class: type) -> Optional[str]:
    """Where ``module_class`` can be imported from by another process, or None (a class defined in a notebook or
    inside a function)."""
    if "<locals>" in module_class.__qualname__:
        return None
    if module_class.__module__ != "__main__":
        return f"{module_class.__module__}:{module_class.__qualname__}"
    script = getattr(sys.modules["__main__"], "__file__", None)
    return f"{Path(script).resolve()}:{module_class.__qualname__}" if script else None
