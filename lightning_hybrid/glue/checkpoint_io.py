"""Lightning's checkpoint hooks for the hybrid strategy, as module-level functions the strategy delegates to.

A sharded checkpoint is a folder Lightning recognizes as a distributed checkpoint: one DCP shard per rank holding
the module's parameters (``state_dict``) and each optimizer's state (``optimizer_<i>``), plus Lightning's metadata
file with everything else (epoch, loops, callbacks, hyperparameters). Tensors are stored under the unmodified
module's names and global shapes, so it loads under any other layout. It is written under ``<name>.partial`` and
renamed when complete: a crash mid-save leaves only the partial folder, which neither a path nor
``ckpt_path="last"`` (ModelCheckpoint's ``last*.ckpt``) ever resolves to. The shards' sizes and checksums are
recorded in Lightning's metadata file and checked before a load (``checkpoint/integrity.py``); the folder holds
Lightning's files and no other.

Example::

    save_checkpoint(checkpoint, Path("epoch=0-step=4.ckpt"), global_rank, barrier)   # every rank
    checkpoint = load_checkpoint(Path("epoch=0-step=4.ckpt"), model, optimizers, strict=True)
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim import Optimizer

from lightning_hybrid._compat import lightning_metadata_path
from lightning_hybrid.checkpoint.integrity import (
    CHECKSUMS_KEY,
    DamagedCheckpointError,
    damaged_files,
    damaged_message,
    gather_checksums,
    resume_hint,
)
from lightning_hybrid.checkpoint.dcp_io import (
    MODULE_STATE_KEY,
    key_mismatch_message,
    load_full,
    load_sharded,
    partial_checkpoint_path,
    publish_checkpoint,
    save_sharded,
    saved_module_keys,
)

if TYPE_CHECKING:  # the asynchronous writer is a Lightning callback; `lightning-hybrid export` needs no Lightning
    from lightning_hybrid.checkpoint.async_save import AsyncSaves

#: Optimizer state keyed per parameter name (``state.<name>.<key>``, ``param_groups.<name>.<key>``), not per group:
#: pipeline ranks hold different parameters, so one group's list of names differs between ranks and would be
#: saved from one rank only; per-name keys are unique and load under any other layout or stage split.
FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


def optimizer_state(model: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """This rank's part of ``optimizer``'s state, keyed per parameter name (see :data:`FLAT_OPTIMIZER_STATE`)."""
    return get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER_STATE)


def save_checkpoint(checkpoint: dict[str, Any], path: Path, global_rank: int, barrier: Callable[[], None],
                    saves: Optional[AsyncSaves] = None) -> None:
    """Write Lightning's ``checkpoint`` dict as a sharded checkpoint folder at ``path`` (the same on every rank;
    every rank calls). Returns once the folder is complete and has its final name, or with ``saves``, once the
    shards are copied to host memory: they are written and published in the background (:mod:`.async_save`)."""
    if saves is not None:
        saves.wait()  # the save in flight may be writing this very folder
    partial = partial_checkpoint_path(path)
    if global_rank == 0:
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier save that crashed
        partial.mkdir(parents=True)
    barrier()
    shards = {MODULE_STATE_KEY: checkpoint.pop("state_dict")}
    shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
    if saves is not None:
        saves.start(shards, partial, path, checkpoint if global_rank == 0 else None)
        return
    save_sharded(shards, partial)  # returns once every rank's shard and the DCP metadata are written
    records = gather_checksums(partial, global_rank)
    if global_rank == 0:
        # Lightning's metadata file, written last, carries the records: no file of our own in Lightning's folder.
        torch.save({**checkpoint, CHECKSUMS_KEY: records}, lightning_metadata_path(partial))
        publish_checkpoint(partial, path)
    barrier()


def load_checkpoint(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool,
                    weights_only: Optional[bool] = None) -> dict[str, Any]:
    """Load a sharded folder or a consolidated file into the sharded ``model`` and ``optimizers`` in place and
    return the rest of Lightning's checkpoint dict. A damaged checkpoint raises one ``RuntimeError`` on every
    rank (``DamagedCheckpointError`` naming the files when checksums show it); names that do not match the model
    raise ``KeyError`` (with ``strict``)."""
    if not path.exists():
        raise FileNotFoundError(f"Checkpoint {path} does not exist.")
    try:
        if path.is_dir():
            metadata = torch.load(lightning_metadata_path(path), weights_only=weights_only)
            damaged = damaged_files(path, metadata)
            if damaged:
                raise DamagedCheckpointError(damaged_message(path, damaged))
            _load_sharded(path, model, optimizers, strict)
            metadata.pop(CHECKSUMS_KEY, None)  # ours: Lightning gets its dict as it saved it
            return metadata
        # Memory-mapped: every rank reads only the slices it keeps, not a private copy of the whole file.
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
        load_full(model, list(optimizers), checkpoint, strict=strict, path=path)
        return checkpoint
    except (KeyError, DamagedCheckpointError):
        raise
    # DCP gathers every rank's read errors into a CheckpointException (a BaseException) raised on all ranks.
    except (Exception, CheckpointException) as error:
        lines = str(error).strip().splitlines() or [""]
        cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
        raise RuntimeError(
            f"Could not read the checkpoint {path}: {type(error).__name__}: {cause}. The checkpoint is incomplete"
            f" or corrupted (e.g. a save that was interrupted). Nothing was written. {resume_hint(path)}"
        ) from error


def _load_sharded(path: Path, model: nn.Module, optimizers: Sequence[Optimizer], strict: bool) -> None:
    saved = saved_module_keys(path)
    module_state = get_model_state_dict(model)
    # Pipeline ranks hold different parameters: compare the checkpoint with the whole model's names.
    held: list[set[str]] = [set() for _ in range(dist.get_world_size())]
    dist.all_gather_object(held, set(module_state))
    missing, unexpected = set().union(*held) - saved, saved - set().union(*held)
    if strict and (missing or unexpected):
        raise KeyError(key_mismatch_message(path, missing, unexpected))
    module_state = {name: value for name, value in module_state.items() if name in saved}
    load_sharded({MODULE_STATE_KEY: module_state}, path)
    model.load_state_dict(module_state, strict=False)
    for index, optimizer in enumerate(optimizers):
        key = f"optimizer_{index}"
        optimizer_state = {key: get_optimizer_state_dict(model, optimizer, options=FLAT_OPTIMIZER_STATE)}
        load_sharded(optimizer_state, path)
        set_optimizer_state_dict(model, optimizer, optimizer_state[key], options=FLAT_OPTIMIZER_STATE)
