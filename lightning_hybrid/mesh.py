"""Parallel degrees and the named device mesh they describe.

One :class:`ParallelDims` owns the sizes of the four mesh dimensions, checks them against the world size and
builds the :class:`~torch.distributed.device_mesh.DeviceMesh`. Dimension order, outermost first, follows the
bandwidth each parallelism needs: pipeline stages exchange one activation per microbatch (slowest links),
data-parallel replicas all-reduce once per step, data-parallel shards gather and reduce-scatter every block,
and tensor-parallel ranks communicate inside every layer (fastest links, i.e. within one node).

Example::

    dims = ParallelDims(world_size=8, dp="auto", tp=2, pp=2)
    mesh, data_mesh = dims.build_mesh("cpu")   # mesh["tp"], mesh["dp_shard"], ...; data_mesh: replicas × shards
    lightning_view(mesh)                       # 2-D (data_parallel, tensor_parallel), as ModelParallelStrategy builds

:func:`lightning_view` is the 2-D mesh a LightningModule written for Lightning's
:class:`~lightning.pytorch.strategies.ModelParallelStrategy` receives (see :mod:`lightning_hybrid.glue.model_parallel_compat`);
it also gives ``mesh`` Lightning's names as flattened aliases: ``mesh["data_parallel"]`` (replicas × shards) and
``mesh["tensor_parallel"]`` (``tp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from lightning_hybrid._compat import concatenate_meshes, flatten_mesh
from lightning_hybrid.options.hybrid_options import AUTO, Degree, check_degrees

PIPELINE = "pp"
DATA_REPLICATE = "dp_replicate"
DATA_SHARD = "dp_shard"
TENSOR = "tp"
MESH_DIMS = (PIPELINE, DATA_REPLICATE, DATA_SHARD, TENSOR)
#: The experts' mesh splits the data-shard dimension into the ranks that share one expert's shards and the ranks
#: its experts are spread over (torchtitan's rule: ``dp_shard = efsdp × ep``; the world size does not change).
EXPERT_DATA = "efsdp"
EXPERT = "ep"
EXPERT_MESH_DIMS = (PIPELINE, DATA_REPLICATE, EXPERT_DATA, EXPERT, TENSOR)
#: Context parallelism splits each data-shard group the same way: ``dp_shard = dp × cp``, cp innermost. FSDP2 shards
#: and averages over all of ``dp_shard`` (torchtitan folds cp into its FSDP mesh), while the ranks of one ``cp``
#: group read the same samples, each computing its part of the sequence.
CONTEXT_DATA = "dp_batch"
CONTEXT = "cp"
CONTEXT_MESH_DIMS = (PIPELINE, DATA_REPLICATE, CONTEXT_DATA, CONTEXT, TENSOR)
#: The meshes built in this process: ``(device type, sizes) → (default group, mesh, data mesh)``. A later trainer
#: call (fit, then test or predict) or another strategy with the same layout reuses them instead of making a new set
#: of process groups, whose threads would stay for the life of the process (a 13-model sweep on 4 CPU ranks slowed
#: from 9 s to 120 s per model); torch's DTensor caches treat meshes of one layout as one anyway.
_BUILT: dict[tuple[str, tuple], tuple] = {}
#: The two data-parallel dimensions; FSDP2 shards over the last one and replicates over the first (HSDP).
DATA_DIMS = (DATA_REPLICATE, DATA_SHARD)
#: Lightning's names (``ModelParallelStrategy``): all data-parallel ranks, and the tensor-parallel ranks.
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"


@dataclass
class ParallelDims:
    """Sizes of the parallel dimensions for one run.

    Arguments:
        world_size: Number of processes in the job.
        dp: Data-parallel *sharding* degree (FSDP2 shards parameters over it), or ``"auto"`` for whatever the
            world size leaves after ``tp``, ``pp`` and ``dp_replicate``.
        tp: Tensor-parallel degree.
        pp: Pipeline-parallel degree.
        dp_replicate: Number of data-parallel replicas of the sharded model (HSDP when > 1).
        ep: Expert-parallel degree: each mixture-of-experts layer's experts spread over ``ep`` of the ``dp × cp``
            sharding ranks (it must divide ``dp × cp``); see :meth:`build_expert_mesh`.
        cp: Context-parallel degree: each sample's sequence split over ``cp`` ranks that read the same samples; the
            mesh's ``dp_shard`` dimension holds ``dp × cp`` ranks (see :meth:`build_context_mesh`).
    """

    world_size: int
    dp: Degree = AUTO
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        check_degrees(self.dp, self.tp, self.pp, self.dp_replicate)
        fixed = self.tp * self.pp * self.dp_replicate * self.cp
        cp_words = f" × cp={self.cp}" if self.cp > 1 else ""
        if self.dp == AUTO:
            if self.world_size % fixed:
                raise ValueError(
                    f"tp={self.tp} × pp={self.pp} × dp_replicate={self.dp_replicate}{cp_words} = {fixed} does not"
                    f" divide the world size {self.world_size} (devices × num_nodes). Choose degrees whose product"
                    " divides it."
                )
            self.dp = self.world_size // fixed
        if fixed * self.dp != self.world_size:
            raise ValueError(
                f"dp={self.dp} × tp={self.tp} × pp={self.pp} × dp_replicate={self.dp_replicate}{cp_words} ="
                f" {fixed * self.dp}, but the world size (devices × num_nodes) is {self.world_size}."
                f" Make the product equal the world size, or pass dp='auto'."
            )
        shards = self.dp * self.cp
        if shards % self.ep:
            valid = [size for size in range(1, shards + 1) if shards % size == 0]
            raise ValueError(
                f"HybridStrategy(ep={self.ep}) spreads experts over data-parallel sharding ranks, but dp × cp ="
                f" {shards} (per pipeline stage and replica) is not a multiple of it. Pass an ep that divides"
                f" {shards}: {valid}, or more devices."
            )

    @property
    def sizes(self) -> dict[str, int]:
        """Size of every mesh dimension, keyed by its name, outermost first (``dp_shard``: ``dp × cp`` ranks)."""
        assert isinstance(self.dp, int)
        return {PIPELINE: self.pp, DATA_REPLICATE: self.dp_replicate, DATA_SHARD: self.dp * self.cp, TENSOR: self.tp}

    @property
    def data_parallel_size(self) -> int:
        """Number of distinct batches processed per step (replicas × shards; a cp group reads one batch)."""
        assert isinstance(self.dp, int)
        return self.dp * self.dp_replicate

    @property
    def gradient_ranks(self) -> int:
        """The ranks of one stage and tensor rank whose gradients are averaged (``dp_replicate × dp × cp``): FSDP2's
        data mesh. Context parallelism scales its ranks' gradients so that their mean is the whole sequence's."""
        return self.data_parallel_size * self.cp

    def build_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        """Create the 4-D mesh (all dimensions kept, size-1 ones included, so names are always valid) and the
        flattened data-parallel mesh ``dp`` (replicas × shards: one group for the sampler and metric reduction),
        or return the ones built earlier in this process for the same sizes and default process group.
        """
        key = (device_type, (*self.sizes.values(), self.cp))
        if key not in _BUILT or _BUILT[key][0] is not dist.group.WORLD:
            _BUILT[key] = (dist.group.WORLD, *self._new_mesh(device_type))
        _, mesh, data_mesh = _BUILT[key]
        return mesh, data_mesh

    def build_expert_mesh(self, device_type: str) -> DeviceMesh:
        """The experts' 5-D mesh ``pp × dp_replicate × efsdp × ep × tp`` over the same ranks as :meth:`build_mesh`'s
        (``dp_shard`` = ``efsdp × ep``, ep innermost: a rank's ep group are data-parallel neighbours of one stage,
        tensor rank and replica); its ``ep`` dimension spreads the experts, ``efsdp`` (with ``dp_replicate``) shards
        and averages each expert's weights. Built once per process and layout."""
        assert isinstance(self.dp, int)
        sizes = (self.pp, self.dp_replicate, self.dp * self.cp // self.ep, self.ep, self.tp)
        key = (device_type, (EXPERT, *sizes))
        if key not in _BUILT or _BUILT[key][0] is not dist.group.WORLD:
            _BUILT[key] = (dist.group.WORLD, init_device_mesh(device_type, sizes, mesh_dim_names=EXPERT_MESH_DIMS))
        return _BUILT[key][1]

    def build_context_mesh(self, device_type: str) -> DeviceMesh:
        """The 5-D mesh ``pp × dp_replicate × dp_batch × cp × tp`` over the same ranks as :meth:`build_mesh`'s
        (``dp_shard = dp_batch × cp``, cp innermost: a cp group are neighbours of one stage, tensor rank and
        replica); its ``cp`` dimension splits the sequence, ``dp_replicate × dp_batch`` reads distinct batches."""
        assert isinstance(self.dp, int)
        sizes = (self.pp, self.dp_replicate, self.dp, self.cp, self.tp)
        key = (device_type, (CONTEXT, *sizes))
        if key not in _BUILT or _BUILT[key][0] is not dist.group.WORLD:
            _BUILT[key] = (dist.group.WORLD, init_device_mesh(device_type, sizes, mesh_dim_names=CONTEXT_MESH_DIMS))
        return _BUILT[key][1]

    def _new_mesh(self, device_type: str) -> tuple[DeviceMesh, DeviceMesh]:
        mesh = init_device_mesh(device_type, tuple(self.sizes.values()), mesh_dim_names=MESH_DIMS)
        if self.cp > 1:  # the sampler's ranks: one per cp group
            data_mesh = flatten_mesh(self.build_context_mesh(device_type)[(DATA_REPLICATE, CONTEXT_DATA)], "dp")
        else:
            data_mesh = flatten_mesh(mesh[DATA_DIMS], "dp")
        # Gradient norms of tensor-parallel parameters are partial over data and tensor ranks at once; with these
        # dimensions flattened DTensor reduces them in one all-reduce instead of one per dimension (which may
        # also round differently on different ranks).
        flatten_mesh(mesh[(DATA_SHARD, TENSOR)], "dp_shard_tp")
        flatten_mesh(mesh[(DATA_REPLICATE, DATA_SHARD, TENSOR)], "dp_tp")
        return mesh, data_mesh


def lightning_view(mesh: DeviceMesh) -> DeviceMesh:
    """The 2-D mesh ``(data_parallel, tensor_parallel)`` of :func:`ParallelDims.build_mesh`'s ``mesh``: Lightning's
    ``ModelParallelStrategy`` mesh, over this rank's pipeline stage (the whole job when pp = 1, with the same
    rank layout: rank = data-parallel index × tp + tensor-parallel index). Registers both names on ``mesh`` too."""
    data = flatten_mesh(mesh[DATA_DIMS], DATA_PARALLEL)
    tensor = flatten_mesh(mesh[TENSOR], TENSOR_PARALLEL)
    return concatenate_meshes([data, tensor])
