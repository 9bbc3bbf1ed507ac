"""Tensor parallelism applied: a block's plan (:mod:`lightning_hybrid.tensor_parallel.block_plan`) settled by running the
block unsharded and sharded, then applied to every block with DTensor's ``parallelize_module``.

:func:`plan_tensor_parallel` plans on the first block's captured call and, with ``verify``, keeps for every pair
group the first candidate sharding whose block output matches the unsharded block, then checks the whole plan; a
plan no candidate satisfies is refused (:class:`~lightning_hybrid.tensor_parallel.refusal.PlanCheckFailed`) naming
the layers to keep whole. :func:`apply_tensor_parallel` applies the plan, keeping whole on every tp rank what the
planner refused (:mod:`lightning_hybrid.tensor_parallel.fallback`; ``strict=True`` raises the refusal instead).

Example::

    calls = probe.record().block_calls
    plan = apply_tensor_parallel(module, "model.blocks", blocks, calls, mesh["tp"], tp_plan={}, verify=True)
    dict(plan)       # {"model.blocks.*.attn.qkv": "colwise (strided x3)", "model.blocks.*.attn.proj": "rowwise", ...}
    plan.structures  # [StructureReport(blocks="model.blocks.*", ..., sharded=..., kept_whole=())]
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
from typing import Any, Collection, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_hybrid._compat import tree_flatten, tree_map
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.record import BlockCall, block_call
from lightning_hybrid.tensor_parallel.dataflow import trace_block
from lightning_hybrid.tensor_parallel.experts import shard_experts
from lightning_hybrid.tensor_parallel.fallback import (AppliedPlan, KeptWhole, plan_keeping_whole, structure_label,
                                                       structure_report)
from lightning_hybrid.tensor_parallel.layers import select_rows, shard_column, shard_row, sum_gradients
from lightning_hybrid.tensor_parallel.per_head import shard_per_head
from lightning_hybrid.tensor_parallel.plan_check import plan_error, tolerance_for
from lightning_hybrid.tensor_parallel.block_plan import (
    BlockPlan,
    ExpertGroup,
    Group,
    PairGroup,
    plan_block,
)
from lightning_hybrid.tensor_parallel.overrides import PlanEntry, block_tp_overrides, resolve_overrides
from lightning_hybrid.tensor_parallel.refusal import PlanCheckFailed
from lightning_hybrid.tensor_parallel.sharded_path import sharded_path_styles
from lightning_hybrid.tensor_parallel.tied import retie, sharded_before, tied_holders

log = logging.getLogger(__name__)

def apply_block_plan(block: nn.Module, plan: BlockPlan, mesh: DeviceMesh) -> None:
    """Shard ``block`` in place according to ``plan``; integer attributes are divided by the tensor size."""
    styles: dict[str, ParallelStyle] = dict(plan.custom)
    for group in plan.groups:
        _apply_group(block, group, mesh, styles)
    if styles:
        parallelize_module(block, mesh, styles)
    for name in {n for group in plan.groups if isinstance(group, PairGroup) for n in group.written_in_place} & set(styles):
        block.get_submodule(name).register_forward_hook(_writable_output)
    for name in {name for group in plan.groups if isinstance(group, PairGroup) for name in group.whole_inputs}:
        # after the styles' own hooks: the output is then the plain whole tensor the heads read
        block.get_submodule(name).register_forward_hook(functools.partial(_gradient_summed_over, mesh))


def _writable_output(module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """A copy of a torch style's output (a custom function's view, which autograd forbids changing in place)."""
    return output.clone()


def _gradient_summed_over(mesh: DeviceMesh, module: nn.Module, inputs: tuple, output: Tensor) -> Tensor:
    """The output as it is, its gradient (each rank's heads' part) summed over the tensor-parallel ranks."""
    return DTensor.from_local(output, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _apply_group(block: nn.Module, group: Group, mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> None:
    if isinstance(group, ExpertGroup):
        shard_experts(block.get_submodule(group.name), mesh, group.layout)
    else:
        _apply_pairs(block, group, mesh, styles)
    replaced: dict[int, Any] = {}
    for path, attr in group.scaled_attributes:
        owner = _resolve_owner(block, path, replaced)
        if type(getattr(owner, attr)) is int:  # a block of the structure may hold no size there (None)
            setattr(owner, attr, group.per_rank(getattr(owner, attr), mesh.size()))


def _apply_pairs(block: nn.Module, group: PairGroup, mesh: DeviceMesh, styles: dict[str, ParallelStyle]) -> None:
    if group.gathered:  # Hugging Face's colwise_rep / rowwise_rep
        styles.update({name: ColwiseParallel(output_layouts=Replicate()) for name in group.columns if name not in styles})
        styles.update({name: RowwiseParallel(input_layouts=Replicate()) for name in group.rows if name not in styles})
        return
    for name, shard in group.columns.items():
        if name in styles:
            continue  # the user's own ParallelStyle for this layer wins
        if shard.heads:
            spans = shard.spans(mesh.get_local_rank(), mesh.size())
            select_rows(block.get_submodule(name), mesh, spans, transposed=name in group.transposed)
        elif shard.split_factor > 1 or name in group.transposed or name in group.partial_inputs:
            shard_column(block.get_submodule(name), mesh, shard.split_factor, transposed=name in group.transposed,
                         reduce_input=name not in group.partial_inputs)
        else:
            styles[name] = ColwiseParallel()
    for name in group.summed_modules:
        sum_gradients(block.get_submodule(name), mesh)
    for holder in dict.fromkeys(holder for holder, _, _ in group.per_head):
        shard_per_head(block.get_submodule(holder), {n: d for h, n, d in group.per_head if h == holder}, mesh)
    for name in group.rows:
        if name in group.transposed and name not in styles:
            shard_row(block.get_submodule(name), mesh, transposed=True)
        else:
            styles.setdefault(name, RowwiseParallel())


def _resolve_owner(block: nn.Module, path: str, replaced: dict[int, Any]) -> Any:
    """The object holding an attribute; config objects are copied first so other modules keep the global value."""
    try:
        return block.get_submodule(path)
    except AttributeError:
        module_path, _, config_attr = path.rpartition(".")
        module = block.get_submodule(module_path)
        config = getattr(module, config_attr)
        if id(config) not in replaced:
            replaced[id(config)] = copy.copy(config)
            setattr(module, config_attr, replaced[id(config)])
        return replaced[id(config)]


def style_for(entry: PlanEntry) -> ParallelStyle | None:
    """The torch style for a plan entry outside the blocks (``None`` for ``"replicate"``)."""
    if isinstance(entry, ParallelStyle):
        return entry
    return {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}.get(entry)


def apply_tensor_parallel(
    root: nn.Module,
    blocks_path: str,
    blocks: BlockList,
    block_calls: Mapping[int, BlockCall],
    mesh: DeviceMesh,
    *,
    tp_plan: Mapping[str, PlanEntry],
    verify: bool,
    apply_to: Optional[Sequence[int]] = None,
    strict: bool = False,
    held: Optional[Mapping[str, PlanEntry]] = None,
    outputs_used: Optional[Mapping[int, Sequence[bool]]] = None,
) -> AppliedPlan:
    """Plan tensor parallelism once per block structure (blocks that differ — dense and mixture-of-experts
    layers, a first block owning a shared module — get a plan each, on their first block's call in
    ``block_calls``, the setup probe's record), check it, apply it to every block (or to the blocks ``apply_to``
    indexes, this rank's pipeline stages) and to ``tp_plan``'s other entries. What the planner refuses stays whole
    on every tp rank (:mod:`lightning_hybrid.tensor_parallel.fallback`); with ``strict`` the refusal is raised.
    ``held``: patterns of the blocks' modules the layout itself keeps whole (a pipeline holds them on another stage
    too), reported so. ``outputs_used``: for a block of ``block_calls``, which leaves of its output the step uses
    (the record's ``block_outputs_used``). Returns the applied plan: ``{module name pattern: style}`` and the
    report per block structure."""
    overrides = resolve_overrides(tp_plan, [name for name, _ in root.named_modules()])
    outside = {name: entry for name, entry in overrides.items() if not blocks.contains_name(name)}
    structures = block_structures(blocks)
    applied = AppliedPlan()
    ties, seen = tied_holders([blocks[i] for i in range(len(blocks)) if apply_to is None or i in apply_to]), set()
    for indices in structures:
        targets = [i for i in indices if apply_to is None or i in apply_to]
        if not targets:
            continue  # another pipeline stage's blocks
        plan, kept = _structure_plan(root, blocks_path, blocks, block_call(block_calls, indices[0]), mesh, indices,
                                     tp_plan=tp_plan, verify=verify, strict=strict, held=held or {},
                                     used=(outputs_used or {}).get(indices[0]))
        for block in (blocks[index] for index in targets):
            was_training = block.training
            apply_block_plan(block, plan.without(sharded_before(block, seen)), mesh)
            block.train(was_training)
        prefixes = [f"{blocks_path}.*"] if len(structures) == 1 and len(blocks.parts) == 1 else [blocks.name(i) for i in indices]
        applied.styles.update({k: v for prefix in prefixes for k, v in plan.describe(prefix).items()})
        keys = [blocks.keys[i] if len(blocks.parts) == 1 else blocks.name(i) for i in indices]
        label = structure_label(blocks_path, keys, len(structures))
        applied.structures.append(structure_report(blocks[targets[0]], plan, kept, label, len(indices), mesh.size()))
    retie(ties)  # weights several blocks hold stay one weight (tied.py)
    for name, style in ((name, style_for(entry)) for name, entry in outside.items()):
        if style is not None:
            parallelize_module(root.get_submodule(name), mesh, style)
    applied.styles.update({name: str(entry) for name, entry in outside.items()})
    return applied


def _structure_plan(root: nn.Module, blocks_path: str, blocks: BlockList, call: tuple[tuple, dict], mesh: DeviceMesh,
                    indices: Sequence[int], *, tp_plan: Mapping[str, PlanEntry], verify: bool, strict: bool,
                    held: Mapping[str, PlanEntry], used: Optional[Sequence[bool]]) -> tuple[BlockPlan, list[KeptWhole]]:
    """The plan of the blocks ``indices`` (one structure) and what it keeps whole: ``held``'s modules, then what
    the planner refuses."""
    explicit = block_tp_overrides(root, tp_plan, [blocks.name(i) for i in indices])
    whole = list(block_tp_overrides(root, held, [blocks.name(i) for i in indices]))
    plan, kept = plan_keeping_whole(
        lambda keep: plan_tensor_parallel(root, blocks_path, blocks, call, mesh, tp_plan=tp_plan, verify=verify,
                                          indices=indices, keep_whole=[*whole, *keep], used_outputs=used),
        explicit, strict)
    kept = [KeptWhole(tuple(whole), _HELD_REASON), *kept] if whole else kept
    if not plan.groups and not plan.custom and not kept:
        log.warning(f"Tensor parallelism found no layers to shard in {type(blocks[indices[0]]).__name__}.")
    return plan, kept


_HELD_REASON = ("the step calls them from outside their block, so a pipeline stage without the block holds them"
                " too: one layout for both copies")


def plan_tensor_parallel(
    root: nn.Module,
    blocks_path: str,
    blocks: BlockList,
    block_call: tuple[tuple, dict],
    mesh: DeviceMesh,
    *,
    tp_plan: Mapping[str, PlanEntry],
    verify: bool,
    indices: Optional[Sequence[int]] = None,
    keep_whole: Collection[str] = (),
    used_outputs: Optional[Sequence[bool]] = None,
) -> BlockPlan:
    """The plan for the blocks ``indices`` names (all blocks by default; they must share one structure), from
    the first one's data flow on ``block_call``, leaving the modules ``keep_whole`` names (relative to a block)
    whole; with ``verify``, each pair group's candidates and then the whole plan are checked against the unsharded
    block on ``mesh`` (collective over it; raises :class:`PlanCheckFailed` naming the layers to keep whole if no
    candidate computes the same). ``used_outputs``: which leaves of the block's output the step computes with;
    the others (attention probabilities a decoder layer returns and the model drops) are neither planned for nor
    checked. What the planner refuses raises a :class:`~lightning_hybrid.tensor_parallel.refusal.PlanRefusal`."""
    indices = list(range(len(blocks))) if indices is None else list(indices)
    in_block = block_tp_overrides(root, tp_plan, [blocks.name(i) for i in indices])
    in_block.update(dict.fromkeys(keep_whole, "replicate"))
    accelerator_rng = [torch.cuda.current_device()] if mesh.device_type == "cuda" else []
    with torch.random.fork_rng(devices=accelerator_rng):  # planning must not shift the user's random streams
        reference = _reference_copy(blocks[indices[0]], mesh)
        if used_outputs is not None and any(used_outputs):  # its sharded copies inherit the hook
            reference.register_forward_hook(functools.partial(_used_leaves, tuple(used_outputs)))
        args, kwargs = _check_inputs(block_call, reference, mesh)
        reference.eval()  # dropout would make the unsharded and sharded outputs differ
        trace = trace_block(reference, args, kwargs)
        custom, candidates = plan_block(reference, trace, mesh.size(), in_block)
        where = blocks_path  # messages suggest "<blocks_path>.*.<layer>" entries
        settled = [_settle_group(reference, options, args, kwargs, mesh, verify, where) for options in candidates]
        for _, repairs in settled:
            custom.update(repairs)
        plan = BlockPlan(groups=[group for group, _ in settled], custom=custom)
        if verify:
            _verify_whole_plan(reference, plan, args, kwargs, mesh, where)
    return plan


def _settle_group(
    reference: nn.Module, options: list[Group], args: tuple, kwargs: dict, mesh: DeviceMesh, verify: bool, where: str
) -> tuple[Group, dict[str, ParallelStyle]]:
    """The first candidate sharding of one pair group whose block output and gradients match the unsharded block,
    with the styles that make modules computing on its sharded activations right (:mod:`.sharded_path`)."""
    if not verify:
        return options[0], {}
    errors = []
    for group in options:
        error = _plan_error(reference, BlockPlan([group]), args, kwargs, mesh)
        if error <= tolerance_for(_dtype_of(reference)):
            return _fewest_attributes(reference, group, {}, args, kwargs, mesh), {}
        repairs = _sharded_path_repairs(reference, group, args, kwargs, mesh)
        if repairs and _computes_the_same(reference, BlockPlan([group], repairs), args, kwargs, mesh):
            return _fewest_attributes(reference, group, repairs, args, kwargs, mesh), repairs
        errors.append(error)
    layers = options[0].layers
    fix = ", ".join(f"'{where}.*.{name}': 'replicate'" for name in layers)
    attributes = sorted({f"{path}.{attr}".lstrip(".") for group in options for path, attr in group.scaled_attributes})
    raise PlanCheckFailed(
        f"Tensor parallel plan check failed for {type(reference).__name__} in '{where}': sharding layers"
        f" {layers} changes the block's output (relative error {min(errors):.2e} in the best of {len(options)}"
        f" candidate layouts; rescaled attributes tried: {attributes or 'none'}). The block's forward probably"
        " derives a shape from something the planner did not adjust (e.g. a head size computed from the input"
        " width) or mixes features across heads. Keep these layers whole with"
        f" HybridStrategy(tp_plan={{{fix}}}), or give explicit styles for them.",
        modules=layers, reason=f"the plan check: sharding them changes the block's output (relative error"
                               f" {min(errors):.1e})",
    )


def _fewest_attributes(reference: nn.Module, group: Group, repairs: dict[str, ParallelStyle], args: tuple,
                       kwargs: dict, mesh: DeviceMesh) -> Group:
    """``group`` without the rescaled attributes the check passes without: one whose value only matched a size
    (Gemma 3's ``sliding_window`` = its head count, read by no computation on this block) is left alone, also on
    the structure's other blocks, where it may hold something else (``None`` on a full-attention layer)."""
    for attribute in list(group.scaled_attributes):
        fewer = dataclasses.replace(group, scaled_attributes=[a for a in group.scaled_attributes if a != attribute])
        if _computes_the_same(reference, BlockPlan([fewer], dict(repairs)), args, kwargs, mesh):
            group = fewer
    return group


def _sharded_path_repairs(reference: nn.Module, group: Group, args: tuple, kwargs: dict,
                          mesh: DeviceMesh) -> dict[str, ParallelStyle]:
    """Styles for the modules computing on the group's sharded activations; the sharded block runs again after
    each round, since it may only have reached the first of them before failing (q's norm, then k's)."""
    repairs: dict[str, ParallelStyle] = {}
    for _ in range(_MAX_REPAIR_ROUNDS):
        sharded = copy.deepcopy(reference)
        apply_block_plan(sharded, BlockPlan([group], dict(repairs)), mesh)
        found = sharded_path_styles(reference, sharded, args, kwargs, {*group.layers, *repairs}, mesh.size())
        if not found:
            break
        repairs.update(found)
    return repairs


_MAX_REPAIR_ROUNDS = 8


def _verify_whole_plan(
    reference: nn.Module, plan: BlockPlan, args: tuple, kwargs: dict, mesh: DeviceMesh, where: str
) -> None:
    error = _plan_error(reference, plan, args, kwargs, mesh)
    if error > tolerance_for(_dtype_of(reference)):
        suspects = [*plan.custom, *(name for group in plan.groups for name in group.layers)]
        raise PlanCheckFailed(
            f"Tensor parallel plan check failed for {type(reference).__name__} in '{where}': the full plan changes"
            f" the block's output (relative error {error:.2e}) although each pair group passed alone. Suspect"
            f" layers: {suspects}. Check the explicit tp_plan entries for them.",
            reason=f"the plan check: the full plan changes the block's output (relative error {error:.1e}) though"
                   " each pair group passed alone",
        )


def _computes_the_same(reference: nn.Module, plan: BlockPlan, args: tuple, kwargs: dict, mesh: DeviceMesh) -> bool:
    return _plan_error(reference, plan, args, kwargs, mesh) <= tolerance_for(_dtype_of(reference))


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


def _used_leaves(used: tuple[bool, ...], module: nn.Module, inputs: tuple, output: Any) -> Any:
    """The output's leaves the step computes with (all of them where the output is not laid out as recorded)."""
    leaves, _ = tree_flatten(output)
    return output if len(leaves) != len(used) else tuple(leaf for leaf, kept in zip(leaves, used) if kept)


def _reference_copy(block: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """An unsharded copy of the block holding real numbers (materialized from the meta device if needed)."""
    reference = copy.deepcopy(block)
    if any(p.is_meta for p in reference.parameters()):
        reference = reference.to_empty(device=_collective_device(mesh))
        torch.manual_seed(0)  # identical weights on every rank: the sharded copy is scattered from rank 0's
        with torch.no_grad():  # finite numbers everywhere (to_empty leaves memory as it was: NaN, inf) ...
            for tensor in [*reference.parameters(), *reference.buffers()]:
                if tensor.is_floating_point():
                    tensor.normal_(0.0, 0.02)
        for module in reference.modules():  # ... and each module's own scheme where it has one
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
