"""Run the user's step once at setup, outside Lightning's loops: what tracing sees of a model it must not change.

Tensor-parallel planning stops the step at the first block to see that block's inputs; the pipeline split runs it
to the end to see which modules run before and after the blocks; the auto layout reads the first block's
attention. The step gets the first batch of the loader Lightning is about to iterate, prepared by Lightning's
batch hooks as the real step will receive it (on the meta device for a meta-device model), and its ``self.log``
calls are ignored.

Example::

    capture_block_call(blocks[0], lambda: run_first_step(trainer, torch.device("cpu")))
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor

from lightning_hybrid._compat import first_loader, tree_map
from lightning_hybrid.pipeline.semantics import muted_logs

_STEPS = {
    TrainerFn.FITTING: ("fit_loop", "training_step"),
    TrainerFn.VALIDATING: ("validate_loop", "validation_step"),
    TrainerFn.TESTING: ("test_loop", "test_step"),
    TrainerFn.PREDICTING: ("predict_loop", "predict_step"),
}


def run_first_step(trainer: Trainer, device: torch.device, microbatches: int = 1) -> Any:
    """Run the step of the trainer's current stage (fit: ``training_step``, ...) on the first batch, ``self.log``
    muted; with ``microbatches`` > 1 on the first microbatch of it (the pipeline's unit of work). Returns the
    step's output (the measured split differentiates its loss)."""
    module = trainer.lightning_module
    loop_name, step_name = _STEPS[trainer.state.fn]
    batch = _first_batch(first_loader(getattr(trainer, loop_name)))
    if microbatches > 1:
        batch = first_microbatch(batch, microbatches)
    if any(p.is_meta for p in module.parameters()):
        batch = tree_map(lambda v: v.to("meta") if isinstance(v, Tensor) else v, batch)
    else:
        batch = _on_device(trainer, module, batch, device)
    with muted_logs(module):
        return getattr(module, step_name)(batch, 0)


def first_microbatch(batch: Any, microbatches: int) -> Any:
    """The first of ``microbatches`` parts of ``batch``, split as torch's schedules split a step's inputs: every
    tensor along dimension 0."""
    return tree_map(lambda v: v.tensor_split(microbatches)[0] if isinstance(v, Tensor) and v.dim() > 0 else v, batch)


def _first_batch(loaders: Any) -> Any:
    """The first batch of the first dataloader (Lightning allows lists and dicts of them)."""
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()))
    return next(iter(loader))


def _on_device(trainer: Trainer, module: Any, batch: Any, device: torch.device) -> Any:
    """The batch as the step will receive it: Lightning's three public batch hooks in order, each taken from the
    DataModule where it overrides it and from the LightningModule otherwise (Lightning's own rule)."""
    def owner(hook: str) -> Any:
        datamodule = trainer.datamodule
        return datamodule if datamodule is not None and is_overridden(hook, datamodule) else module

    batch = owner("on_before_batch_transfer").on_before_batch_transfer(batch, 0)
    batch = owner("transfer_batch_to_device").transfer_batch_to_device(batch, device, 0)
    return owner("on_after_batch_transfer").on_after_batch_transfer(batch, 0)
