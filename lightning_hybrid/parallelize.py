"""Apply the parallelisms to a LightningModule, in one fixed order.

Order matters: tensor parallelism first, because it replaces parameters with DTensors on the tensor mesh; FSDP2
last, because it shards whatever parameters it finds (DTensors included) over the data mesh and must see the
final ones; activation checkpointing between the two, so the recomputed forward runs the sharded layers and
FSDP's hooks sit outside the checkpointed region. (Pipeline splitting comes first of all, see ``HybridStrategy``.)

Example::

    plan = apply_tensor_parallel(module, "model.blocks", blocks, block_call, mesh["tp"], tp_plan={}, verify=True)
    apply_activation_checkpointing(enumerate(blocks), CheckpointPlan.resolve("every"))
    apply_fsdp(module, blocks, data_mesh, FSDPOptions(zero=3, mixed_precision=policy))
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._pytree import tree_map

from lightning_hybrid.dataflow import trace_block
from lightning_hybrid.tensor_parallel import (
    BlockPlan,
    PairGroup,
    PlanEntry,
    apply_block_plan,
    plan_block,
    plan_error,
    resolve_overrides,
    style_for,
    tolerance_for,
)

log = logging.getLogger(__name__)


def apply_tensor_parallel(
    root: nn.Module,
    blocks_path: str,
    blocks: nn.Module,
    block_call: tuple[tuple, dict],
    mesh: DeviceMesh,
    *,
    tp_plan: Mapping[str, PlanEntry],
    verify: bool,
    apply_to: Optional[Sequence[nn.Module]] = None,
) -> dict[str, str]:
    """Plan tensor parallelism on the first block, check it, apply it to every block (or to ``apply_to``, the
    blocks of this rank's pipeline stages) and to ``tp_plan``'s other entries. Returns the applied plan as
    ``{module name pattern: style}``."""
    overrides = resolve_overrides(tp_plan, [name for name, _ in root.named_modules()])
    outside = {name: entry for name, entry in overrides.items() if not name.startswith(blocks_path + ".")}
    plan = plan_tensor_parallel(root, blocks_path, blocks, block_call, mesh, tp_plan=tp_plan, verify=verify)
    if not plan.groups and not plan.custom:
        log.warning(f"Tensor parallelism found no linear pairs to shard in {type(blocks[0]).__name__}; tp only replicates.")
    for block in blocks if apply_to is None else apply_to:
        was_training = block.training
        apply_block_plan(block, plan, mesh)
        block.train(was_training)
    for name, entry in outside.items():
        style = style_for(entry)
        if style is not None:
            parallelize_module(root.get_submodule(name), mesh, style)
    return {**plan.describe(f"{blocks_path}.*"), **{name: str(entry) for name, entry in outside.items()}}


def plan_tensor_parallel(
    root: nn.Module,
    blocks_path: str,
    blocks: nn.Module,
    block_call: tuple[tuple, dict],
    mesh: DeviceMesh,
    *,
    tp_plan: Mapping[str, PlanEntry],
    verify: bool,
) -> BlockPlan:
    """The plan for every block, from the first block's data flow on ``block_call``; with ``verify``, each pair
    group's candidates and then the whole plan are checked against the unsharded block on ``mesh`` (collective
    over it; raises ``RuntimeError`` naming the layers to keep whole if no candidate computes the same)."""
    in_block = block_tp_overrides(root, tp_plan, blocks_path, len(blocks))
    accelerator_rng = [torch.cuda.current_device()] if mesh.device_type == "cuda" else []
    with torch.random.fork_rng(devices=accelerator_rng):  # planning must not shift the user's random streams
        reference = _reference_copy(blocks[0], mesh)
        args, kwargs = _check_inputs(block_call, reference, mesh)
        reference.eval()  # dropout would make the unsharded and sharded outputs differ
        trace = trace_block(reference, args, kwargs)
        custom, candidates = plan_block(reference, trace, mesh.size(), in_block)
        groups = [_settle_group(reference, options, args, kwargs, mesh, verify, blocks_path) for options in candidates]
        plan = BlockPlan(groups=groups, custom=custom)
        if verify:
            _verify_whole_plan(reference, plan, args, kwargs, mesh, blocks_path)
    return plan


def block_tp_overrides(root: nn.Module, tp_plan: Mapping[str, PlanEntry], blocks_path: str,
                       count: int) -> dict[str, PlanEntry]:
    """``tp_plan``'s entries for the blocks, relative to one block (the plan every block gets)."""
    overrides = resolve_overrides(tp_plan, [name for name, _ in root.named_modules()])
    return _per_block_overrides(overrides, blocks_path, count)


def _per_block_overrides(overrides: Mapping[str, PlanEntry], blocks_path: str, count: int) -> dict[str, PlanEntry]:
    """``tp_plan`` entries inside the blocks, relative to one block; one plan serves every block."""
    per_block: list[dict[str, PlanEntry]] = [{} for _ in range(count)]
    for name, entry in overrides.items():
        if name.startswith(blocks_path + "."):
            index, _, relative = name[len(blocks_path) + 1:].partition(".")
            per_block[int(index)][relative] = entry
    if any(entries != per_block[0] for entries in per_block):
        raise ValueError(
            f"tp_plan entries inside '{blocks_path}' must treat every block alike (one plan is applied to all"
            f" blocks); write them with a wildcard, e.g. '{blocks_path}.*.attn.qkv'."
        )
    return per_block[0]


def _settle_group(
    reference: nn.Module, options: list[PairGroup], args: tuple, kwargs: dict, mesh: DeviceMesh, verify: bool, where: str
) -> PairGroup:
    """The first candidate sharding of one pair group whose block output matches the unsharded block."""
    if not verify:
        return options[0]
    errors = []
    for group in options:
        error = _plan_error(reference, BlockPlan([group]), args, kwargs, mesh)
        if error <= tolerance_for(_dtype_of(reference)):
            return group
        errors.append(error)
    layers = options[0].layers
    fix = ", ".join(f"'{where}.*.{name}': 'replicate'" for name in layers)
    attributes = sorted({f"{path}.{attr}".lstrip(".") for group in options for path, attr in group.scaled_attributes})
    raise RuntimeError(
        f"Tensor parallel plan check failed for {type(reference).__name__} in '{where}': sharding layers"
        f" {layers} changes the block's output (relative error {min(errors):.2e} in the best of {len(options)}"
        f" candidate layouts; rescaled attributes tried: {attributes or 'none'}). The block's forward probably"
        " derives a shape from something the planner did not adjust (e.g. a head size computed from the input"
        " width) or mixes features across heads. Keep these layers whole with"
        f" HybridStrategy(tp_plan={{{fix}}}), or give explicit styles for them."
    )


def _verify_whole_plan(
    reference: nn.Module, plan: BlockPlan, args: tuple, kwargs: dict, mesh: DeviceMesh, where: str
) -> None:
    error = _plan_error(reference, plan, args, kwargs, mesh)
    if error > tolerance_for(_dtype_of(reference)):
        suspects = [*plan.custom, *(name for group in plan.groups for name in group.layers)]
        raise RuntimeError(
            f"Tensor parallel plan check failed for {type(reference).__name__} in '{where}': the full plan changes"
            f" the block's output (relative error {error:.2e}) although each pair group passed alone. Suspect"
            f" layers: {suspects}. Check the explicit tp_plan entries for them."
        )


def _plan_error(reference: nn.Module, plan: BlockPlan, args: tuple, kwargs: dict, mesh: DeviceMesh) -> float:
    """The plan check's error, agreed over the tensor-parallel group so every rank takes the same decision."""
    sharded = copy.deepcopy(reference)
    apply_block_plan(sharded, plan, mesh)
    try:
        error = plan_error(reference, sharded, args, kwargs)
    except Exception as failure:  # a wrong layout often fails loudly (shape mismatch) rather than numerically
        log.debug(f"plan candidate raised {failure!r}")
        error = float("inf")
    agreed = torch.tensor(error, device=_collective_device(mesh))
    dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=mesh.get_group())
    return float(agreed)


def _collective_device(mesh: DeviceMesh) -> torch.device:
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _reference_copy(block: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """An unsharded copy of the block holding real numbers (materialized from the meta device if needed)."""
    reference = copy.deepcopy(block)
    if any(p.is_meta for p in reference.parameters()):
        reference = reference.to_empty(device=_collective_device(mesh))
        torch.manual_seed(0)  # identical weights on every rank: the sharded copy is scattered from rank 0's
        for module in reference.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return reference


def _check_inputs(block_call: tuple[tuple, dict], reference: nn.Module, mesh: DeviceMesh) -> tuple[tuple, dict]:
    """Make the captured block inputs real, in the block's dtype, and identical on all tensor-parallel ranks."""
    device = next(reference.parameters()).device
    dtype = _dtype_of(reference)
    source_rank = dist.get_global_rank(mesh.get_group(), 0)
    torch.manual_seed(0)

    def prepare(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if value.is_meta:
            real = torch.randn(value.shape, device=device) if value.is_floating_point() else torch.zeros(
                value.shape, dtype=value.dtype, device=device)
        else:
            real = value.to(device).clone()
            dist.broadcast(real, src=source_rank, group=mesh.get_group())
        return real.to(dtype) if real.is_floating_point() else real

    return tree_map(prepare, block_call)


def _dtype_of(module: nn.Module) -> torch.dtype:
    return next(module.parameters()).dtype
