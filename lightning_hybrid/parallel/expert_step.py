"""The driver's expert-parallel step (2b): every mixture-of-experts layer of this rank's blocks split over the ep
ranks, and the FSDP2 units its experts then need (step 5).

Example::

    applied = apply_expert_parallelism(module, blocks, dims, probe, owned, verify=True, device_type="cpu")
    units = expert_units(applied, dims, "cpu")     # passed to apply_fsdp
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from lightning.fabric.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.expert_parallel.apply import AppliedExperts, apply_expert_parallel
from lightning_hybrid.mesh import DATA_REPLICATE, EXPERT, EXPERT_DATA, ParallelDims
from lightning_hybrid.parallel.fsdp import ExpertUnits
from lightning_hybrid.expert_parallel.find import find_expert_layers
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.record import block_call
from lightning_hybrid.probe.step_probe import StepProbe


def apply_expert_parallelism(module: nn.Module, blocks: BlockList, dims: ParallelDims, probe: StepProbe,
                             owned: Sequence[int], verify: bool, device_type: str) -> AppliedExperts:
    """Split the expert layers of the blocks ``owned`` over the ep mesh, each checked against the whole layer on
    the first batch (``verify``); what was split and what stayed whole logged once."""
    start = time.perf_counter()
    mesh = dims.build_expert_mesh(device_type)[EXPERT]
    applied = apply_expert_parallel(module, blocks, probe.record().block_calls, mesh, owned, verify=verify)
    checked = (f"; checked against the whole layers on the first batch (largest relative difference"
               f" {applied.largest_difference:.2g}) in {time.perf_counter() - start:.2f} s" if applied.checked else "")
    rank_zero_info(f"HybridStrategy: {applied.describe(dims.ep)}{checked}")
    for name, why in applied.kept.items():
        rank_zero_info(f"HybridStrategy: '{name}' stays on every rank (ep): {why}.")
    return applied


def experts_kept_whole_by_tp(module: nn.Module, blocks: BlockList, probe: StepProbe, owned: Sequence[int],
                             ep: int) -> dict[str, str]:
    """``tp_plan`` entries keeping the expert layers step 2b will spread (with ``ep`` > 1) whole over the
    tensor-parallel ranks: the experts are split over ep instead (each tp rank routes the same tokens, over its
    own ep group)."""
    entries: dict[str, str] = {}
    for indices in block_structures(blocks) if ep > 1 else ():
        targets = [i for i in indices if i in owned]
        if not targets:
            continue
        args, kwargs = block_call(probe.record().block_calls, indices[0])
        found = find_expert_layers(blocks[targets[0]], args, kwargs)
        for path in [*found.stacks, *found.lists]:
            for index in targets:
                layer = blocks[index].get_submodule(path)
                entries.update({f"{blocks.name(index)}.{path}{'.' + name if name else ''}": "replicate"
                                for name, inner in layer.named_modules()
                                if any(True for _ in inner.parameters(recurse=False))})
    return entries


def expert_units(applied: Optional[AppliedExperts], dims: ParallelDims, device_type: str) -> Optional[ExpertUnits]:
    """The expert modules as FSDP2 units over the ranks that hold the same experts (replicas × efsdp)."""
    if applied is None or not applied.units:
        return None
    mesh = dims.build_expert_mesh(device_type)
    data = mesh[(DATA_REPLICATE, EXPERT_DATA)] if dims.dp_replicate > 1 else mesh[EXPERT_DATA]
    return ExpertUnits(applied.units, data, divide_factor=dims.gradient_ranks)


def spread_experts(applied: AppliedExperts, dims: ParallelDims, device_type: str) -> dict[int, Any]:
    """``id`` of each parameter of the experts spread whole over the ep ranks (a list of modules, not a stacked
    DTensor over the ep mesh) → the ep group its gradient norm adds up over (``spread`` of
    :func:`~lightning_hybrid.parallel.grad_norm.clip_grad_norm_`). After FSDP2, which replaces the parameters."""
    group = dims.build_expert_mesh(device_type)[EXPERT].get_group()
    spread = {}
    for parameter in (p for modules in applied.units for module in modules for p in module.parameters()):
        mesh_names = parameter.device_mesh.mesh_dim_names if isinstance(parameter, DTensor) else None
        if EXPERT not in (mesh_names or ()):
            spread[id(parameter)] = group
    return spread


def spread_norms(strategy: Any) -> dict[int, Any]:
    """The strategy's experts spread whole over ranks (``spread`` of the gradient norm): none without ep."""
    applied = getattr(strategy, "experts_applied", None)
    return applied.spread_norms if applied is not None else {}
