"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), including fused projections.

DCP describes each rank's part of a tensor as rectangular chunks of the global tensor. A fused q|k|v projection
sharded so that every rank holds whole heads of q, k *and* v (``_StridedShard``) is not one rectangle: a rank's
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

from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from lightning_hybrid.mesh import TENSOR


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


def _tensor_parallel_stride(tensor: DTensor) -> tuple[int, _StridedShard] | None:
    names = tensor.device_mesh.mesh_dim_names or ()
    if TENSOR not in names:
        return None
    index = names.index(TENSOR)
    placement = tensor.placements[index]
    return (index, placement) if isinstance(placement, _StridedShard) else None


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
    mesh_dim, stride = _tensor_parallel_stride(tensor)  # type: ignore[misc]
    # The box this rank would hold if the tensor-parallel dimension were replicated (data sharding only) ...
    placements = list(tensor.placements)
    placements[mesh_dim] = Replicate()
    sizes, offsets = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, placements)
    # ... cut along the strided dimension into split_factor pieces, of which this rank holds its chunk in each.
    dim, factor = stride.dim, stride.split_factor
    ranks, rank = tensor.device_mesh.size(mesh_dim), tensor.device_mesh.get_local_rank(mesh_dim)
    piece_length = tensor.shape[dim] // factor
    local_length = piece_length // ranks
    local = tensor.to_local()
    view = local.as_subclass(_Pieces)
    view.pieces = list(local.detach().split(local_length, dim=dim))
    view.chunks = []
    for piece in range(factor):
        chunk_offsets, chunk_sizes = list(offsets), list(sizes)
        chunk_offsets[dim] = piece * piece_length + rank * local_length
        chunk_sizes[dim] = local_length
        view.chunks.append(ChunkStorageMetadata(offsets=torch.Size(chunk_offsets), sizes=torch.Size(chunk_sizes)))
    view.global_size = tensor.shape
    return DTensor(view, tensor._spec, requires_grad=False)
