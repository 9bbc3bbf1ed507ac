"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), including fused projections.

DCP describes each rank's part of a tensor as rectangular chunks of the global tensor. A fused q|k|v projection
sharded so that every rank holds whole heads of q, k *and* v (``StridedShard``) is not one rectangle: a rank's
rows are one block inside each of the q, k and v pieces. DTensor reports it as a single chunk, which DCP rejects
as overlapping. :func:`checkpointable` re-describes such tensors as one chunk per piece, so the checkpoint holds
the unmodified module's layout (loadable under any other layout) and loading writes straight into the parameters.

Example::

    save_sharded({"state_dict": get_model_state_dict(model)}, path)
    state = {"state_dict": get_model_state_dict(model)}
    load_sharded(state, path)                 # fills the model's shards in place
    model.load_state_dict(state["state_dict"])
"""

from __future__ import annotations

import os
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate
from torch.optim import Optimizer

from lightning_hybrid._compat import StridedShard, compute_local_shape_and_global_offset, dtensor_around

from lightning_hybrid.mesh import TENSOR

#: The part of a sharded checkpoint holding the LightningModule's parameters and buffers (then ``optimizer_<i>``).
MODULE_STATE_KEY = "state_dict"


def partial_checkpoint_path(path: Path) -> Path:
    """Where a checkpoint is written before it is complete."""
    return path.with_name(f"{path.name}.partial")


def publish_checkpoint(partial: Path, path: Path) -> None:
    """Give a complete checkpoint folder its final name, replacing an older checkpoint of that name (file or
    folder). Renames are atomic, so ``path`` is always either the old complete checkpoint or the new one; only a
    crash between the two renames leaves the old one under ``<name>.replaced`` (and the new one complete)."""
    if path.exists():
        replaced = path.with_name(f"{path.name}.replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(path, replaced)
        os.replace(partial, path)
        if replaced.is_dir():
            shutil.rmtree(replaced)
        else:
            replaced.unlink()
    else:
        os.replace(partial, path)


def saved_module_keys(path: Path) -> set[str]:
    """The parameter and buffer names stored in a sharded checkpoint (from its metadata, reading no tensor)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    prefix = MODULE_STATE_KEY + "."
    return {key[len(prefix):] for key in metadata.state_dict_metadata if key.startswith(prefix)}


def key_mismatch_message(path: object, missing: set[str], unexpected: set[str]) -> str:
    return (
        f"The checkpoint {path} does not match the model: missing keys {sorted(missing)}, unexpected keys"
        f" {sorted(unexpected)}. Is it from another model? (Set `strict_loading = False` on the LightningModule"
        " to load the keys both have.)"
    )


def save_sharded(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` (nested dicts of tensors and objects) as a DCP checkpoint folder."""
    with checkpointable(state):
        dcp.save(state, checkpoint_id=path)


def load_sharded(state: dict[str, Any], path: Path) -> None:
    """Load a DCP checkpoint into ``state`` in place: tensors are filled, other values (step counts, learning
    rates) are replaced. Works for any layout the checkpoint was saved with."""
    with checkpointable(state):
        dcp.load(state, checkpoint_id=path)


@contextmanager
def checkpointable(state: Any) -> Iterator[None]:
    """Within the context, every tensor-parallel strided DTensor in ``state`` is swapped (in place, since DCP
    loads non-tensor values into the very dicts it is given) for a view that DCP describes piece by piece."""
    swapped = []
    for container, key in _strided_entries(state):
        swapped.append((container, key, container[key]))
        container[key] = _piecewise(container[key])
    try:
        yield
    finally:
        for container, key, original in swapped:
            container[key] = original


def _strided_entries(state: Any) -> Iterator[tuple[Any, Any]]:
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, list) else ()
    for key, value in items:
        if isinstance(value, DTensor) and _tensor_parallel_stride(value) is not None:
            yield state, key
        else:
            yield from _strided_entries(value)


def _tensor_parallel_stride(tensor: DTensor) -> tuple[int, StridedShard] | None:
    names = tensor.device_mesh.mesh_dim_names or ()
    if TENSOR not in names:
        return None
    index = names.index(TENSOR)
    placement = tensor.placements[index]
    return (index, placement) if isinstance(placement, StridedShard) else None


class _Pieces(torch.Tensor):
    """A strided DTensor's local shard, told to DCP as one chunk per piece (DTensor defers to these hooks)."""

    chunks: list[ChunkStorageMetadata]
    pieces: list[torch.Tensor]
    global_size: torch.Size

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.pieces[0])
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.global_size),
            )
            for chunk in self.chunks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return self.chunks

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for chunk, piece in zip(self.chunks, self.pieces):
            if chunk.offsets == index.offset:
                return piece
        raise ValueError(f"No local piece of {index.fqn} starts at {index.offset}.")


def _piecewise(tensor: DTensor) -> DTensor:
    return in_row_blocks(tensor, max_bytes=sys.maxsize)  # one block per piece


def in_row_blocks(tensor: torch.Tensor, max_bytes: int) -> torch.Tensor:
    """``tensor`` (a DTensor or a plain tensor) described to DCP as blocks of rows of at most ``max_bytes`` each, so
    a reader that materializes each requested box before copying it (the Hugging Face reader) never holds more
    than one block; the blocks are views of the local tensor, which loading fills in place."""
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    strided = _tensor_parallel_stride(tensor) if isinstance(tensor, DTensor) else None
    if local.dim() == 0 or (local.numel() * local.element_size() <= max_bytes and strided is None):
        return tensor  # one box, read at once (a strided tensor is never one box: described piece by piece)
    if isinstance(tensor, DTensor):
        boxes = local_chunks(tensor)
        parts = list(local.split(boxes[0].sizes[strided[1].dim], dim=strided[1].dim)) if strided else [local]
    else:
        boxes, parts = [ChunkStorageMetadata(offsets=torch.Size([0] * local.dim()), sizes=local.shape)], [local]
    chunks, pieces = [], []
    for box, part in zip(boxes, parts):
        rows = max(1, max_bytes // max(1, part[0].numel() * part.element_size()))
        for start in range(0, part.shape[0], rows):
            piece = part.narrow(0, start, min(rows, part.shape[0] - start))
            offsets = torch.Size([box.offsets[0] + start, *box.offsets[1:]])
            chunks.append(ChunkStorageMetadata(offsets=offsets, sizes=piece.shape))
            pieces.append(piece)
    view = local.as_subclass(_Pieces)
    view.chunks, view.pieces, view.global_size = chunks, pieces, tensor.shape
    return dtensor_around(view, tensor) if isinstance(tensor, DTensor) else view


def local_chunks(tensor: DTensor) -> list[ChunkStorageMetadata]:
    """The boxes of the global tensor that this rank's local tensor holds, in local order (one box unless the
    tensor-parallel placement is strided, then one per piece)."""
    strided = _tensor_parallel_stride(tensor)
    if strided is None:
        sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))]
    mesh_dim, stride = strided
    # The box this rank would hold if the tensor-parallel dimension were replicated (data sharding only) ...
    placements = list(tensor.placements)
    placements[mesh_dim] = Replicate()
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    # ... cut along the strided dimension into split_factor pieces, of which this rank holds its chunk in each.
    dim, factor = stride.dim, stride.split_factor
    ranks, rank = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
    piece_length = tensor.shape[dim] // factor
    local_length = piece_length // ranks
    chunks = []
    for piece in range(factor):
        chunk_offsets, chunk_sizes = list(offsets), list(sizes)
        chunk_offsets[dim] = piece * piece_length + rank * local_length
        chunk_sizes[dim] = local_length
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk_offsets), sizes=torch.Size(chunk_sizes)))
    return chunks


def copy_full_into(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of the global tensor ``full`` into ``target`` (a DTensor or a plain tensor).

    torch's full-state-dict loaders cut one box per rank, which is wrong for strided tensor-parallel placements.
    """
    if not isinstance(target, DTensor):
        target.copy_(full)
        return
    chunks = local_chunks(target)
    parts = [full[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes))] for c in chunks]
    strided = _tensor_parallel_stride(target)
    local = torch.cat(parts, dim=strided[1].dim) if strided else parts[0]
    target.to_local().copy_(local)


def load_full(
    model: nn.Module, optimizers: list[Optimizer], checkpoint: dict[str, Any], strict: bool, path: object = "the file"
) -> None:
    """Load a consolidated Lightning checkpoint (``save_distributed_checkpoint=False``) into the sharded model and
    optimizers, in place."""
    model_state = get_model_state_dict(model)
    saved = checkpoint.pop("state_dict")
    missing, unexpected = model_state.keys() - saved.keys(), saved.keys() - model_state.keys()
    if strict and (missing or unexpected):
        raise KeyError(key_mismatch_message(path, missing, unexpected))
    with torch.no_grad():
        for name in model_state.keys() & saved.keys():
            copy_full_into(model_state[name], saved[name].to(model_state[name].device))
    for optimizer, saved_state in zip(optimizers, checkpoint.pop("optimizer_states", [])):
        state = get_optimizer_state_dict(model, optimizer)
        _fill_optimizer_state(state, saved_state)
        set_optimizer_state_dict(model, optimizer, state)


def _fill_optimizer_state(state: dict[str, Any], saved: dict[str, Any]) -> None:
    """Copy an optimizer state saved with parameter indices (Lightning's full format) into a state keyed by
    parameter names; groups list their parameters in the same order in both."""
    for group, saved_group in zip(state["param_groups"], saved["param_groups"]):
        group.update({key: value for key, value in saved_group.items() if key != "params"})
        for name, index in zip(group["params"], saved_group["params"]):
            for key, value in saved["state"].get(index, {}).items():
                target = state["state"][name][key]
                if isinstance(target, torch.Tensor):
                    with torch.no_grad():
                        copy_full_into(target, value.to(target.device))
                else:
                    state["state"][name][key] = value
