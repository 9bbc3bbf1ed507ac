"""Exact resume: the data order after ``Trainer.fit(ckpt_path=...)`` must be the one the interrupted run would
have seen.

Lightning 2.6.6 sets the training sampler's epoch from its epoch-progress counter, and when a run trained by
``max_steps`` resumes from a checkpoint written at the end of an epoch, that counter is one ahead of
``trainer.current_epoch`` (measured: a resumed epoch 1 drew the permutation of epoch 2; runs bounded by
``max_epochs`` are not affected). The shuffled order then differs from the uninterrupted run's, and so do the
losses. :class:`SamplerEpochOnResume` sets every training sampler's epoch to ``trainer.current_epoch`` at the start
of each epoch, before the loader is iterated; in an uninterrupted run both numbers are equal and nothing changes.

Example::

    trainer = Trainer(max_steps=1000, callbacks=[SamplerEpochOnResume()])   # HybridStrategy adds it itself
"""

from __future__ import annotations

from lightning.pytorch import Callback, LightningModule, Trainer

from lightning_hybrid._compat import set_sampler_epoch, tree_leaves


class SamplerEpochOnResume(Callback):
    """Keep the training samplers' epoch equal to ``trainer.current_epoch`` (see the module docstring)."""

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loaders = trainer.train_dataloader  # one loader, or a list/dict of them; None before the data is set up
        for loader in tree_leaves(loaders) if loaders is not None else ():
            set_sampler_epoch(loader, trainer.current_epoch)
