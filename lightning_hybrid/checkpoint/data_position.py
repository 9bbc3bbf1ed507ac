"""Exact mid-epoch resume: the training data's position saved as the global number of samples consumed.

Pretraining checkpoints are nearly all taken inside an epoch. Lightning restores a loader's position only when the
loader has ``state_dict``/``load_state_dict`` (its stateful-loader support, e.g. torchdata's
``StatefulDataLoader``); a plain ``DataLoader`` restarts the epoch's data, so samples are seen twice and others
never. :func:`make_resumable` (called by ``HybridStrategy.process_dataloader`` on the training loader) gives the
``DistributedSampler`` Lightning injects that interface, and a plain loader too, so Lightning's own mechanism saves
and restores the position:

* The position is the **number of samples of the epoch's global order consumed** by every data-parallel rank
  together, not a per-rank offset. ``DistributedSampler`` deals the global order round-robin (rank ``r`` takes
  positions ``r, r + dp, …``), so after ``k`` batches of ``b`` samples per rank exactly the first ``k·b·dp``
  positions are consumed, whatever ``dp`` is. A resumed epoch deals the rest of the same order over the new ranks:
  a checkpoint written with dp=4 resumes under dp=2 (or another tp/pp) with no sample skipped or repeated.
* Batches are counted as training takes them (:meth:`ResumableDistributedSampler.note_batch`, from the
  ``on_train_batch_start`` hook), not as the loader's workers prefetch them.
* A resumed epoch under another data-parallel size has another number of batches left; Lightning's batch counters
  are moved to match (:func:`align_batch_progress`), so the epoch ends when the data does. Lightning itself keeps
  the epoch counter, global step, optimizer and LR scheduler state.

Without a resume the order is exactly ``DistributedSampler``'s. Samplers other than the plain
``DistributedSampler`` (a user's own, or one that already has a state) are left as they are.

Example::

    loader = make_resumable(loader, trainer)           # HybridStrategy.process_dataloader does this
    sampler = resumable_sampler(loader)
    sampler.note_batch()                               # each training batch (CheckpointRecords does this)
    state = loader.state_dict()                        # {"sampler": {"epoch": 1, "samples": 24, "replicas": 2}}
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler


class ResumableDistributedSampler(DistributedSampler):
    """A ``DistributedSampler`` (swapped in on Lightning's instance by :func:`make_resumable`) whose position in
    the epoch is saved and restored as the global number of samples consumed (see the module docstring)."""

    rank_batch_size: int = 1  # samples per batch on one rank (the loader's batch_size)
    drop_last_batch: bool = False  # the loader's drop_last: a short last batch is dropped
    _resume: Optional[dict[str, int]] = None  # a loaded position not yet applied to an epoch
    _resumed: Optional[dict[str, int]] = None  # the loaded position this iteration started from
    _skipped: int = 0  # samples of this epoch's global order consumed before this iteration started
    _batches: int = 0  # batches training took since this iteration started

    def __iter__(self) -> Iterator[int]:
        order = self._global_order()
        self._skipped, self._batches = self._take_resume(len(order)), 0
        return iter(_deal(order[self._skipped:], self.num_replicas, self.rank, self.drop_last))

    def note_batch(self) -> None:
        """Training took one more batch of this sampler's loader."""
        self._batches += 1

    def state_dict(self) -> dict[str, int]:
        consumed = self._skipped + self._batches * self.rank_batch_size * self.num_replicas
        return {"epoch": self.epoch, "samples": min(consumed, len(self.dataset)), "replicas": self.num_replicas}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self._resume = dict(state)
        # Loaders with workers draw the order when their iterator is made, before Lightning sets the epoch.
        self.set_epoch(state["epoch"])

    def batches_left(self) -> Optional[int]:
        """Batches this rank yields in the epoch a loaded position resumes (``None`` when none is pending)."""
        position = self._resume or self._resumed
        if position is None or position["epoch"] != self.epoch:
            return None
        left = len(_deal(range(len(self.dataset) - position["samples"]), self.num_replicas, self.rank,
                         self.drop_last))
        rounding = math.floor if self.drop_last_batch else math.ceil
        return rounding(left / self.rank_batch_size)

    def _global_order(self) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)  # DistributedSampler's seed per epoch
        return torch.randperm(len(self.dataset), generator=generator).tolist()

    def _take_resume(self, size: int) -> int:
        resume, self._resume = self._resume, None
        self._resumed = resume if resume is not None and resume["epoch"] == self.epoch else None
        return min(self._resumed["samples"], size) if self._resumed is not None else 0


def _deal(order: Any, replicas: int, rank: int, drop_last: bool) -> list[int]:
    """``DistributedSampler``'s split of ``order`` over ``replicas``: padded by repeating its start (or trimmed, with
    ``drop_last``) to a multiple of ``replicas``, then every ``replicas``-th element from ``rank``."""
    order = list(order)
    if drop_last:
        order = order[: len(order) // replicas * replicas]
    elif order:
        padding = -len(order) % replicas
        order += (order * math.ceil(padding / len(order)))[:padding]
    return order[rank::replicas]


class _ResumableLoader:
    """Mixin swapped onto a plain ``DataLoader``: Lightning saves and restores a loader that has these methods."""

    __slots__ = ()  # a base after the loader class adds nothing to its layout, so the class can be swapped

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": resumable_sampler(self).state_dict()}  # type: ignore[arg-type]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        resumable_sampler(self).load_state_dict(state["sampler"])  # type: ignore[arg-type]


_LOADER_CLASSES: dict[type, type] = {}


def make_resumable(loader: Any) -> Any:
    """Make the training ``loader``'s position resumable, in place, when it draws from a plain
    ``DistributedSampler`` in batches of a fixed size; returns ``loader``."""
    found = _distributed_sampler(loader)
    if found is None:
        return loader
    sampler, batch_size, drop_last = found
    sampler.__class__ = ResumableDistributedSampler
    sampler.rank_batch_size, sampler.drop_last_batch = batch_size, drop_last
    if not callable(getattr(loader, "state_dict", None)):  # torchdata's StatefulDataLoader saves its sampler itself
        cls = type(loader)
        if cls not in _LOADER_CLASSES:
            _LOADER_CLASSES[cls] = type(f"Resumable{cls.__name__}", (cls, _ResumableLoader), {})
        loader.__class__ = _LOADER_CLASSES[cls]
    return loader


def _distributed_sampler(loader: Any) -> Optional[tuple[DistributedSampler, int, bool]]:
    """The loader's sampler, its batch size and ``drop_last`` — the loader's own, or its batch sampler's (Lightning
    rebuilds torchdata's loader with a ``BatchSampler`` over the sampler it injects)."""
    if not isinstance(loader, DataLoader):
        return None
    if loader.batch_size is not None:
        sampler, batch_size, drop_last = loader.sampler, loader.batch_size, loader.drop_last
    else:
        batches = loader.batch_sampler
        sampler, batch_size = getattr(batches, "sampler", None), getattr(batches, "batch_size", None)
        drop_last = bool(getattr(batches, "drop_last", False))
    if type(sampler) not in (DistributedSampler, ResumableDistributedSampler) or not isinstance(batch_size, int):
        return None  # a sampler of the user's own, or batches of unknown size
    return sampler, batch_size, drop_last


def resumable_sampler(loader: Any) -> Optional[ResumableDistributedSampler]:
    """The loader's resumable sampler, or ``None``."""
    found = _distributed_sampler(loader)
    return found[0] if found is not None and isinstance(found[0], ResumableDistributedSampler) else None


def align_batch_progress(trainer: Any, sampler: ResumableDistributedSampler) -> None:
    """Move Lightning's batch counters of the epoch being resumed so that it ends when the sampler's data does
    (they count batches of the saving run's data-parallel size; unchanged when the size is the same)."""
    left = sampler.batches_left()
    if left is None or trainer.num_training_batches == float("inf"):
        return
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    shift = (trainer.num_training_batches - left) - progress.ready
    progress.ready += shift
    progress.started += shift
    progress.processed += shift
    progress.completed += shift
