"""Asynchronous checkpoint saves (``HybridStrategy(async_checkpoint=True)``): training continues while the shards
are written.

A save copies this rank's shards to host memory (DCP's staging, pinned on CUDA devices; the copy is what makes
it safe for training to change the parameters right after) and returns; a background thread then writes them into
``<name>.partial`` with ``torch.distributed.checkpoint.async_save`` over a gloo group of its own, so its
collectives never interleave with training's. DCP's coordinator (rank 0) finishes only after gathering every
rank's write results, so when rank 0's write completes every shard is on disk: only then does rank 0 record the
files' checksums, write Lightning's metadata file with them and rename the folder to its final name (the same atomic
publish as a synchronous save).
A crash mid-write leaves only ``<name>.partial``, which neither a path nor ``ckpt_path="last"`` resolves to.

At most one save is in flight: the next save, the removal of the checkpoint being written, the next
``setup`` (before a checkpoint is loaded) and the end of each ``fit``/``test`` wait for it, so a checkpoint saved
during ``fit`` is published on every rank when ``fit`` returns. A failed write is raised at that wait. After an
exception the pending save is waited for (a live job still publishes it) and its outcome logged, without raising.

With ``ModelCheckpoint(save_last=True)`` each checkpoint event is two saves, so the second (``last.ckpt``) waits
for the first's write. ``save_last="link"`` links ``last.ckpt`` to a checkpoint that is not yet published: a crash
before the publish leaves a dangling link, which ``ckpt_path="last"`` ignores (:func:`attach` warns).

Example::

    trainer = Trainer(strategy=HybridStrategy(dp=8, async_checkpoint=True),
                      callbacks=[ModelCheckpoint(every_n_train_steps=500, save_last=True)])
"""

from __future__ import annotations

import io
import logging
from concurrent.futures import Future
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from lightning_hybrid._compat import lightning_metadata_path
from lightning_hybrid.checkpoint.integrity import CHECKSUMS_KEY, all_checksums
from lightning_hybrid.checkpoint.dcp_io import checkpointable, publish_checkpoint
from lightning_hybrid.options.hybrid_options import HybridOptions

log = logging.getLogger(__name__)


class AsyncSaves(Callback):
    """This rank's asynchronous saves, at most one in flight; a Lightning callback so the end of ``fit``, the next
    ``setup`` and an exception wait for the pending one (see the module docstring).

    Arguments:
        group: A gloo process group over every rank, used only by the background writes.
        device: The training device; its shards are staged into pinned host memory when it is a CUDA device.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self._device = device
        self._stager: Optional[DefaultStager] = None
        self._pending: Optional[_PendingSave] = None

    @property
    def pending_path(self) -> Optional[Path]:
        """The final name of the checkpoint being written (``None`` when none is in flight)."""
        return self._pending.path if self._pending is not None else None

    def start(self, shards: dict[str, Any], partial: Path, path: Path, metadata: Optional[dict[str, Any]]) -> None:
        """Write ``shards`` into the folder ``partial`` in the background and publish it as ``path`` once every
        rank's write is complete. ``metadata`` (rank 0 only: Lightning's dict without the tensors) is serialized
        now and written at the publish. Returns once the shards are copied; waits first for the previous save."""
        self.wait()
        metadata_bytes = None
        if metadata is not None:
            buffer = io.BytesIO()
            torch.save(metadata, buffer)
            metadata_bytes = buffer.getvalue()
        with checkpointable(shards):  # staging copies the re-described views; the originals are restored after
            written = dcp.async_save(shards, checkpoint_id=partial, process_group=self.group,
                                     async_stager=self._staging())
        self._pending = _PendingSave(path, partial, written, metadata_bytes)

    def wait(self) -> None:
        """Block until the save in flight (if any) is written and, on rank 0, published; raise if it failed."""
        if self._pending is not None:
            try:
                self._pending.result()
            finally:
                self._pending = None

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._settle(trainer)  # a checkpoint loaded next may be the one in flight: published on every rank first

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._settle(trainer)
        if self._stager is not None:
            self._stager.close()  # releases the staged copy of the shards
            self._stager = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # No collective here: a peer may be gone. A dead peer fails the write's collectives at once (closed
        # connections), a silent one after the group's timeout; either way the folder stays `.partial`.
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result()
            log.warning(f"The asynchronous save of {pending.path} in flight when training failed completed.")
        except BaseException as error:  # DCP's CheckpointException is a BaseException
            log.error(_failed(pending, error))

    def _settle(self, trainer: Trainer) -> None:
        self.wait()
        trainer.strategy.barrier("async checkpoint published")  # rank 0 publishes after the other ranks' writes

    def _staging(self) -> DefaultStager:
        # One stager for the run: it keeps the host copy of each shard and refills it at the next save (the write
        # of the previous one has finished by then), instead of allocating and pinning host memory every time.
        if self._stager is None:
            cuda = self._device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager


class _PendingSave:
    """One save in flight: the background write and, on rank 0, the publish that follows it."""

    def __init__(self, path: Path, partial: Path, written: Future, metadata: Optional[bytes]) -> None:
        self.path, self.partial = path, partial
        self._published: Future = Future()
        # The publish runs in the writing thread right after the write, so it also happens when nothing waits
        # (a save after fit, completed while the interpreter exits).
        written.add_done_callback(lambda done: self._publish(done, metadata))

    def result(self) -> None:
        try:
            self._published.result()
        except BaseException as error:
            raise RuntimeError(_failed(self, error)) from error

    def _publish(self, written: Future, metadata: Optional[bytes]) -> None:
        try:
            written.result()
            if metadata is not None:
                _write_metadata(self.partial, metadata)
                publish_checkpoint(self.partial, self.path)
            self._published.set_result(None)
        except BaseException as error:
            self._published.set_exception(error)


def _write_metadata(folder: Path, serialized: bytes) -> None:
    """Lightning's metadata as serialized when the save started (what it held then) with the records of every
    written file, which exist only now: unpickled again (a private copy) to add them, so ``meta.pt`` is written once."""
    metadata = torch.load(io.BytesIO(serialized), weights_only=False)  # bytes this process pickled
    metadata[CHECKSUMS_KEY] = all_checksums(folder)
    torch.save(metadata, lightning_metadata_path(folder))


def _failed(pending: _PendingSave, error: BaseException) -> str:
    cause = (str(error).strip().splitlines() or [""])[0]
    return (f"The asynchronous save of {pending.path} did not complete ({type(error).__name__}: {cause}); it was not"
            f" published: only {pending.partial} is left, which is never loaded. Resume from the last complete"
            " checkpoint (ckpt_path='last').")


def attach(trainer: Trainer, options: HybridOptions, saves: Optional[AsyncSaves],
           timeout: timedelta) -> Optional[AsyncSaves]:
    """The strategy's :class:`AsyncSaves` when ``options.async_checkpoint`` is on (else ``None``), created on first use
    with its gloo group (every rank calls this, at setup) and registered as a callback of ``trainer``."""
    if not options.async_checkpoint:
        return None
    if saves is None:
        saves = AsyncSaves(dist.new_group(backend="gloo", timeout=timeout), trainer.strategy.root_device)
    if saves not in trainer.callbacks:
        trainer.callbacks.append(saves)
    if any(isinstance(c, ModelCheckpoint) and c.save_last == "link" for c in trainer.callbacks):
        rank_zero_warn("ModelCheckpoint(save_last='link') with HybridStrategy(async_checkpoint=True) links last.ckpt"
                       " to a checkpoint that is still being written: after a crash before its publish, last.ckpt"
                       " points nowhere and ckpt_path='last' finds no checkpoint. Use save_last=True.")
    return saves


def wait_if_writing(saves: Optional[AsyncSaves], path: Union[str, PathLike]) -> None:
    """Before ``path`` is removed: wait for the save in flight if it writes ``path`` (its publish would restore it)."""
    if saves is not None and saves.pending_path is not None and saves.pending_path.resolve() == Path(path).resolve():
        saves.wait()
