"""The setup probe's batch, taken from the loop Lightning is about to run without disturbing it: the dataloader
hook called once, one iterator, the loop's first batch the one it would have had.

:class:`SetupBatch` requests the loop's dataloaders as the loop does (the ``*_dataloader`` hook, once) and hands
the same objects to the loop's own request, so the hook runs as often as under single-device Lightning. From the
first loader it takes the first batch:

* a ``DataLoader`` is processed as the loop will process it (distributed sampler, the strategy's
  ``process_dataloader``, worker seeding: this rank's data), one iterator is started and its first batch taken;
  when the loop processes its own copy of that loader (:meth:`SetupBatch.substitute`, from the strategy's
  ``process_dataloader``) it is given the processed loader instead, whose first iteration continues that iterator
  and yields the taken batch first. Workers start once; an iterable dataset that cannot rewind loses nothing.
  A resumed run restores the loader's position after setup: the loop's first iteration then starts anew there;
* an iterator (a generator handed to ``fit``) is handed on with the taken batch put back in front;
* any other iterable (a list of batches) is iterated again by the loop: it starts over by itself.

:func:`setup_probe` runs the user's step on that batch as the loop would: the precision plugin's
``convert_input``, Lightning's batch hooks (``on_before_batch_transfer``, ``transfer_batch_to_device``,
``on_after_batch_transfer``, each from the DataModule where it overrides it), the precision plugin's step context,
``self.log`` muted; the batch on the meta device for a meta-device model. The probe converts a copy: the batch the
loop receives is the one the loader produced.

Example::

    batch, probe = setup_probe(trainer, module, blocks, torch.device("cpu"))  # the strategy keeps the batch

    probe.record()                              # the step ran once, on the loop's first batch
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Callable, Optional

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from lightning.pytorch.utilities.combined_loader import CombinedLoader
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_hybrid import _compat
from lightning_hybrid._compat import tree_flatten, tree_map, tree_unflatten
from lightning_hybrid.pipeline.semantics import muted_logs
from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.probe.step_probe import StepProbe

#: Per trainer function: the loop, its stage, the step the probe runs and the precision plugin's context for it.
_STAGES = {
    TrainerFn.FITTING: ("fit_loop", RunningStage.TRAINING, "training_step", "train_step_context"),
    TrainerFn.VALIDATING: ("validate_loop", RunningStage.VALIDATING, "validation_step", "val_step_context"),
    TrainerFn.TESTING: ("test_loop", RunningStage.TESTING, "test_step", "test_step_context"),
    TrainerFn.PREDICTING: ("predict_loop", RunningStage.PREDICTING, "predict_step", "predict_step_context"),
}


class SetupBatch:
    """The first batch of the trainer's current loop, fetched once (see the module docstring)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        loop_name, self.stage, self.step_name, self.context_name = _STAGES[trainer.state.fn]
        self._loop = getattr(trainer, loop_name)
        self._batch: Any = None
        self._fetched = False
        #: The processed loader whose started iterator the loop is to continue, until the loop processes its own.
        self._processed: Optional[DataLoader] = None

    @property
    def batch(self) -> Any:
        """The batch as the loader produced it (fetched on first use)."""
        if not self._fetched:
            self._batch, self._fetched = self._fetch(), True
        return self._batch

    def _fetch(self) -> Any:
        loaders = _compat.request_dataloaders(self._loop)
        leaves, rebuild = _loaders_of(loaders)
        first = leaves[0]
        if isinstance(first, DataLoader):
            batch = self._start(first)
        elif iter(first) is first:  # an iterator: what is taken from it is gone, so it is put back in front
            batch = next(first)
            leaves[0] = itertools.chain([batch], first)
            loaders = rebuild(leaves)
        else:
            batch = next(iter(first))
        _compat.hand_dataloaders_to_loop(self._loop, loaders)
        return batch

    def _start(self, loader: DataLoader) -> Any:
        processed = _compat.process_like_loop(self.trainer, self.stage, loader)
        iterator = _compat.start_iterator(processed)
        batch = next(iterator)
        # Not yet the first batch for a resumed run: its position is restored after setup, before the loop iterates.
        _compat.hand_iterator_to_loader(processed, iterator, batch, still_first=lambda: not self._loop.restarting)
        self._processed = processed
        return batch

    def substitute(self, dataloader: Any) -> Any:
        """What the loop should iterate for ``dataloader`` (the strategy's ``process_dataloader`` asks): the processed
        loader whose first batch the probe took, in place of the loop's own copy of it; any other loader as given."""
        processed = self._processed
        if processed is None or self.trainer.state.stage != self.stage:  # none, or not yet the loop it is for
            return dataloader
        self._processed = None  # the loop's first training (or evaluation) loader: taken over, or given up
        same = dataloader is processed or (isinstance(dataloader, DataLoader) and dataloader.dataset is processed.dataset)
        return processed if same else dataloader


def _loaders_of(loaders: Any) -> tuple[list[Any], Any]:
    """The loaders a hook returned, in Lightning's order (a ``CombinedLoader``'s, or the leaves of the lists and
    dicts it combines), and a function that rebuilds the returned object from changed leaves."""
    if isinstance(loaders, CombinedLoader):
        def rebuild_combined(leaves: list[Any]) -> Any:
            loaders.flattened = leaves
            return loaders

        return list(loaders.flattened), rebuild_combined
    leaves, spec = tree_flatten(loaders)
    return leaves, lambda changed: tree_unflatten(changed, spec)


def setup_probe(trainer: Trainer, module: nn.Module, blocks: BlockList,
                device: torch.device) -> tuple[SetupBatch, StepProbe]:
    """The :class:`SetupBatch` of the trainer's current loop (the strategy keeps it until the loop has processed its
    loaders) and the :class:`~lightning_hybrid.probe.step_probe.StepProbe` of the current step on its first batch,
    converted as Lightning's loop converts it (see the module docstring)."""
    batch = SetupBatch(trainer)
    prepared: dict[bool, Any] = {}  # on the meta device while the model is, on the device once it has values

    def run_on(work: Callable[[Any], Any]) -> Any:
        meta = any(p.is_meta for p in module.parameters())
        if meta not in prepared:
            prepared[meta] = _converted(trainer, module, batch.batch, device)
        context = getattr(trainer.strategy.precision_plugin, batch.context_name)
        with context(), muted_logs(module):
            return work(prepared[meta])

    def run_step(microbatches: int) -> Any:
        return run_on(lambda whole: getattr(module, batch.step_name)(
            first_microbatch(whole, microbatches) if microbatches > 1 else whole, 0))

    # Taking the batch starts the loop's own iterator, which draws its seed from the random stream as the loop would
    # have: done before the probe isolates its runs, so that the draw stays.
    return batch, StepProbe(module, blocks, run_step, device, prepare=lambda: batch.batch, run_on=run_on,
                            step_name=batch.step_name)


def first_microbatch(batch: Any, microbatches: int) -> Any:
    """The first of ``microbatches`` parts of ``batch``, split as torch's schedules split a step's inputs: every
    tensor along dimension 0."""
    return tree_map(lambda v: v.tensor_split(microbatches)[0] if isinstance(v, Tensor) and v.dim() > 0 else v, batch)


def _converted(trainer: Trainer, module: nn.Module, batch: Any, device: torch.device) -> Any:
    """A copy of ``batch`` as the step will receive it: the precision plugin's input conversion, then Lightning's
    three public batch hooks in order (on the meta device for a meta-device model instead)."""
    batch = trainer.strategy.precision_plugin.convert_input(copy.deepcopy(batch))
    if any(p.is_meta for p in module.parameters()):
        return tree_map(lambda v: v.to("meta") if isinstance(v, Tensor) else v, batch)
    return _on_device(trainer, module, batch, device)


def _on_device(trainer: Trainer, module: Any, batch: Any, device: torch.device) -> Any:
    """Lightning's three public batch hooks in order, each taken from the DataModule where it overrides it and from
    the LightningModule otherwise (Lightning's own rule)."""
    def owner(hook: str) -> Any:
        datamodule = trainer.datamodule
        return datamodule if datamodule is not None and is_overridden(hook, datamodule) else module

    batch = owner("on_before_batch_transfer").on_before_batch_transfer(batch, 0)
    batch = owner("transfer_batch_to_device").transfer_batch_to_device(batch, device, 0)
    return owner("on_after_batch_transfer").on_after_batch_transfer(batch, 0)
