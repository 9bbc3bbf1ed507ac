"""Data parallelism with FSDP2 (``fully_shard``), and how ZeRO levels map onto it.

FSDP2 keeps every parameter sharded over the data-parallel ranks at rest and reduce-scatters gradients, so
gradients and optimizer state are always sharded. What remains to choose is whether a block's parameters are
sharded again between its forward and its backward:

=========  =======================================================  ==========================================
ZeRO       what is sharded                                           FSDP2 setting
=========  =======================================================  ==========================================
``zero=3`` parameters, gradients, optimizer state                    ``reshard_after_forward=True``: all-gather
                                                                     in forward *and* again in backward
``zero=2`` gradients, optimizer state (parameters stay gathered      ``reshard_after_forward=False``: one
           from forward to backward)                                 all-gather per step, more memory
=========  =======================================================  ==========================================

Under pipeline parallelism ZeRO-2 is the default (``options.default_zero_level``): a stage runs every
microbatch's forward and backward within one step, and ZeRO-3 would gather each block again for each of them.

ZeRO-1 (only optimizer state sharded, full gradients all-reduced) is not offered: FSDP2 always reduce-scatters
gradients, which moves the same bytes as an all-reduce's reduce phase and holds less memory, so ZeRO-2 is never
worse than ZeRO-1 here.

Example::

    apply_fsdp(lightning_module, blocks, data_mesh, FSDPOptions(zero=3, mixed_precision=bf16_policy, offload=False))

With ``offload=True`` FSDP2's ``CPUOffloadPolicy`` keeps the sharded parameters, their gradients and (because the
optimizer is created on them) the optimizer state in CPU memory; each unit's parameters are copied to the device
for its all-gather and gradients copied back after the reduce-scatter, and the optimizer step runs on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_hybrid._compat import StridedShard
from lightning_hybrid.probe.blocks import shared_between_blocks
from lightning_hybrid.tensor_parallel.layers import replicate_fused_biases


#: ``HybridOptions.reduce_dtype`` (checked and canonical) → the dtype gradients are reduced in.
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def mixed_precision_policy(precision: str, reduce_dtype: Optional[str] = None) -> MixedPrecisionPolicy:
    """FSDP2 policy for a Lightning precision flag and a gradient reduction dtype.

    ``bf16-mixed`` gathers parameters and computes in bf16 but reduces gradients in fp32 into fp32 sharded
    parameters (the optimizer's master weights). Other flags keep the parameters' own dtype throughout.
    ``reduce_dtype="bf16"`` reduce-scatters (and, with replicas, all-reduces) gradients in bf16 instead: half the
    gradient traffic, each rank's gradient rounded to bf16 before the sum; the sharded result is stored in the
    parameters' dtype again.
    """
    reduce = REDUCE_DTYPES[reduce_dtype] if reduce_dtype is not None else None
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce or torch.float32)
    return MixedPrecisionPolicy(reduce_dtype=reduce)


@dataclass(frozen=True)
class ExpertUnits:
    """Expert modules each rank holds other ones of than its data-parallel neighbours (expert parallelism): each
    group of ``modules`` one FSDP2 unit over ``mesh`` (the ranks holding the same experts), its gradients divided by
    ``divide_factor`` (every data-parallel rank's tokens reached them: the whole data-parallel degree)."""

    modules: list[list[nn.Module]]
    mesh: DeviceMesh
    divide_factor: int


@dataclass(frozen=True)
class FSDPOptions:
    """How :func:`apply_fsdp` shards: ZeRO level (2 or 3), mixed precision, CPU offload."""

    zero: int
    mixed_precision: MixedPrecisionPolicy
    offload: bool = False

    def offload_policy(self, device_type: str) -> OffloadPolicy:
        # Pinned host memory lets copies overlap compute, but only an accelerator can use it.
        return CPUOffloadPolicy(pin_memory=device_type == "cuda") if self.offload else OffloadPolicy()


def apply_fsdp(root: nn.Module, blocks: Iterable[nn.Module], mesh: DeviceMesh, options: FSDPOptions,
               data_group: Any = None, called_outside: Iterable[nn.Module] = (),
               experts: Optional[ExpertUnits] = None) -> None:
    """Shard each block as one FSDP2 unit, then the root (embeddings, final norm, head and anything left).
    ``called_outside``: modules of the blocks that the step also calls from outside their block (diffusers' DiT
    calls ``transformer_blocks[0].norm1.emb``), each its own unit first, as is a module several blocks hold
    (:func:`~lightning_hybrid.probe.blocks.shared_between_blocks`).

    ``mesh`` is the data-parallel mesh: 1-D for plain sharding, 2-D ``(replicate, shard)`` for HSDP. FSDP2 refuses
    scalar (0-dimensional) parameters (a learned temperature, a logit scale): they stay whole on every rank and
    their gradients are averaged over ``data_group`` (all data-parallel ranks) as they are computed. ``experts``:
    modules expert parallelism spread over ranks, units of their own over the expert data mesh.
    """
    replicate_fused_biases(root)
    scalars = {p for p in root.parameters() if p.dim() == 0}
    common = dict(
        mesh=mesh,
        mp_policy=options.mixed_precision,
        offload_policy=options.offload_policy(mesh.device_type),
        shard_placement_fn=_shard_placement,
    )
    blocks = list(blocks)
    inside = {id(m) for block in blocks for m in block.modules()}
    for modules in experts.modules if experts is not None else ():
        if id(modules[0]) in inside:
            unit = fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=options.zero == 3,
                               **{**common, "mesh": experts.mesh, "shard_placement_fn": _expert_placement})
            unit = unit[0] if isinstance(unit, list) else unit
            unit.set_gradient_divide_factor(experts.divide_factor)
            if experts.mesh.size(experts.mesh.ndim - 1) > 1 and dist.get_backend() != "nccl":
                # FSDP2 divides by a factor other than its group's size in the reduce-scatter (PREMUL_SUM), which
                # only NCCL has; elsewhere (gloo) it must sum and divide afterwards. (With one shard rank it divides
                # while copying, without a collective: forcing the sum there divides twice.)
                unit.set_force_sum_reduction_for_comms(True)
    # Own units first: a block's unit gathers its parameters only around the block's own forward, and FSDP2 lets
    # one unit manage a parameter (a module several blocks hold is called by each of them).
    for modules in [*([m] for m in called_outside if id(m) in inside), *shared_between_blocks(blocks)]:
        fully_shard(modules if len(modules) > 1 else modules[0], reshard_after_forward=options.zero == 3,
                    ignored_params=scalars & {p for m in modules for p in m.parameters()}, **common)
    for block in blocks:
        fully_shard(block, reshard_after_forward=options.zero == 3, ignored_params=scalars & set(block.parameters()),
                    **common)
    # The root is gathered for the embedding at the start of forward and needed again at once by the head and
    # in backward, so resharding it after forward would only add an all-gather.
    fully_shard(root, reshard_after_forward=False, ignored_params=scalars, **common)
    for parameter in scalars:
        if parameter.requires_grad:
            parameter.register_hook(functools.partial(_average_over, data_group))


def _average_over(group: Any, grad: torch.Tensor) -> torch.Tensor:
    """A gradient's mean over the data-parallel ranks (what FSDP2 gives the parameters it shards)."""
    grad = grad.clone()
    dist.all_reduce(grad, group=group)
    return grad / dist.get_world_size(group)


def _shard_placement(parameter: nn.Parameter) -> Shard | None:
    # A fused projection's rows are already dealt to tensor-parallel ranks in strided pieces; sharding the same
    # dimension again over data-parallel ranks would nest two strided layouts, which DTensor cannot gather back
    # into the original order. Shard the other dimension instead (columns, or rows of a transposed Conv1D weight).
    if isinstance(parameter, DTensor):
        strided = [p for p in parameter.placements if isinstance(p, StridedShard)]
        if strided:
            return Shard(1 if strided[0].dim == 0 else 0)
    return None


def _expert_placement(parameter: nn.Parameter) -> Shard | None:
    # Stacked experts are already split along their first dimension over the ep ranks; a second split of it would
    # leave a rank no rows when the ranks outnumber the local experts (torchtitan shards the next dimension too).
    if isinstance(parameter, DTensor) and parameter.dim() >= 2 and Shard(0) in parameter.placements:
        return Shard(1)
    return None


def buffers_to_device(module: nn.Module, device: torch.device) -> None:
    """Move ``module``'s buffers to ``device``, leaving its parameters where they are: with CPU offload FSDP2 keeps
    the sharded parameters in CPU memory and copies them to the device per block itself."""
    for submodule in module.modules():
        for key, buffer in list(submodule.named_buffers(recurse=False)):
            setattr(submodule, key, buffer.to(device))

