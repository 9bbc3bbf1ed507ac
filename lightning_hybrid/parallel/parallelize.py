"""The one driver: apply every parallelism to a LightningModule, in one fixed order.

:func:`parallelize` runs the steps below in this order; each is a small ``apply_*`` function that takes primitives
(a mesh, a plan, flags) and can run without a Trainer. Why the order:

0. **the setup probe** (:class:`~lightning_hybrid.probe.step_probe.StepProbe`): the user's step, run once on the
   unmodified model and recorded (:mod:`lightning_hybrid.probe.record`): what every block structure receives, where
   the vocabulary is used, what runs before and after the blocks and what each block costs. Every step below reads
   that record; only ``pp_split="measured"`` runs the step again, to time it;
0b. **context parallelism planned** (``cp > 1``, :mod:`lightning_hybrid.parallel.context_step`): each block
   structure checked on its recorded call, run whole and in parts, on the unmodified blocks;
1. **pipeline split** first: it cuts the unmodified model by the record, and keeps meta-device copies of every
   unit (the stand-ins other stages need) before any later step changes them; from here on this rank works on its
   own stages' blocks only;
2. **tensor parallelism**: replaces the blocks' parameters with DTensors on the tensor mesh, and the token
   embedding's and head's with shards over the vocabulary (:mod:`lightning_hybrid.tensor_parallel.vocab`; which they
   are was read from the record, of the unmodified model);
2b. **expert parallelism** (``ep > 1``, :mod:`lightning_hybrid.parallel.expert_step`): each mixture-of-experts
   layer's experts spread over the ep ranks, checked against the whole layer on the first batch; after tensor
   parallelism, which plans the blocks with the experts whole, and before anything wraps the blocks;
2c. **context parallelism installed**: this rank's planned blocks run on their part of the sequence, their
   attention exchanged; after 2 and 2b, whose checks run the blocks whole;
3. **activation checkpointing**: after tensor parallelism, so the recomputed forward runs the sharded layers and
   their collectives; inside the FSDP2 units applied next, so their hooks gather parameters for the recompute;
4. **torch.compile** per block, in place (``compile=``): after checkpointing, so the recompute is in the graph;
   before FSDP2, whose hooks then run eagerly around each block's graph (torchtitan's order); see
   :mod:`lightning_hybrid.parallel.compile`;
5. **FSDP2** last: it shards whatever parameters it finds, DTensors included, over the data mesh; with a pipeline
   each stage module is the root of its own units; experts spread by step 2b are units of their own over the ranks
   holding the same experts;
6. **materialization**: a meta-device model gets its values now that each rank holds only its shards;
7. **pipeline verification** (``verify_pipeline``): once every parallelism is applied, so that the pipelined step
   it runs on the first batch is the one training will run; compared with the unsplit step taken in step 1 on the
   same (initial) weights (:mod:`lightning_hybrid.pipeline.verify`) — before pretrained weights replace them;
8. **pretrained weights** (``weights=``): a Hugging Face checkpoint is read into the final shards, each rank
   reading only its slices of each tensor, so no rank ever holds the whole model;
9. **stand-in check** (``verify_pipeline``): the pipelined step once more with NaN in what stands in for other
   stages' units, which no correct split computes with; last, so that a model with no unsplit step (meta device,
   pretrained weights) is checked on real values.

Example::

    mesh, data_mesh = dims.build_mesh("cpu")
    probe = StepProbe(module, blocks, run_step=lambda microbatches: module.training_step(batch, 0),
                      device=torch.device("cpu"))
    result = parallelize(module, "model.blocks", blocks, mesh, dims, options, data_mesh=data_mesh, precision="32-true",
                         device=torch.device("cpu"), probe=probe)
    result.tp_plan        # {"model.blocks.*.attn.qkv": "colwise (strided x3)", ...}
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid.checkpoint.hf_load import load_pretrained, loaded_names
from lightning_hybrid.mesh import DATA_DIMS, DATA_SHARD, PIPELINE, TENSOR, ParallelDims
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.options.recompute import CheckpointPlan
from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing, refuse_updated_arguments
from lightning_hybrid.probe.blocks import BlockList, find_block_list
from lightning_hybrid.probe.step_probe import StepProbe
from lightning_hybrid.parallel.compile import compile_blocks
from lightning_hybrid.parallel.construction import recorded_values, recording_construction  # noqa: F401 (strategy's)
from lightning_hybrid.parallel.initialization import materialize_meta_module
from lightning_hybrid.tensor_parallel.loss_parallel import require_sharded_head
from lightning_hybrid.expert_parallel.apply import AppliedExperts
from lightning_hybrid.context_parallel.apply import AppliedContext
from lightning_hybrid.parallel.context_step import install_context, plan_context
from lightning_hybrid.parallel.expert_step import (apply_expert_parallelism, expert_units, experts_kept_whole_by_tp,
                                              spread_experts)
from lightning_hybrid.parallel.fsdp import ExpertUnits, FSDPOptions, apply_fsdp, mixed_precision_policy
from lightning_hybrid.tensor_parallel.apply import apply_tensor_parallel
from lightning_hybrid.tensor_parallel.fallback import AppliedPlan
from lightning_hybrid.tensor_parallel.vocab import VocabLayers, find_vocab_layers, shard_vocab_layers
from lightning_hybrid.pipeline.runtime import Pipeline, build_pipeline
from lightning_hybrid.pipeline.verify import check_pipeline, check_regrouped, check_stand_ins, checkable, tolerance
from lightning_hybrid.options.schedules import PipelineSchedule

@dataclass
class Parallelized:
    """What :func:`parallelize` did: this rank's pipeline (``None`` when pp = 1), the tensor-parallel plan applied
    (``{module pattern: style}``, with its report per block structure) and whether FSDP2 sharded the model."""

    pipeline: Optional[Pipeline] = None
    tp_plan: AppliedPlan = field(default_factory=AppliedPlan)
    sharded: bool = False
    experts: Optional[AppliedExperts] = None
    context: Optional[AppliedContext] = None


def parallelize(module: nn.Module, blocks_path: str, blocks: BlockList, mesh: DeviceMesh, dims: ParallelDims,
                options: HybridOptions, *, data_mesh: DeviceMesh, precision: str, device: torch.device,
                probe: StepProbe) -> Parallelized:
    """Apply ``options``' parallelisms to ``module`` in place (the module docstring gives the order); every rank calls
    it. ``mesh``, ``data_mesh``: :meth:`~lightning_hybrid.mesh.ParallelDims.build_mesh`'s; ``probe``: the first batch's step."""
    # 0b. context parallelism planned on the unmodified blocks (installed in step 2c)
    result = Parallelized(context=plan_context(blocks, dims, probe) if dims.cp > 1 else None)
    recorded = recorded_values(module)  # names and recipes of the values built on meta, before anything changes them
    owned = list(range(len(blocks)))
    vocab = find_vocab(module, blocks, dims, options, probe)  # on the unmodified model, before any step
    called_outside = modules_called_outside(module, probe) if fsdp_applies(dims, options, precision) and len(blocks) else []
    # 1. pipeline split
    if dims.pp > 1:
        assert options.pipeline_schedule is not None
        result.pipeline = apply_pipeline_split(module, blocks_path, blocks, options.pipeline_schedule, mesh, device,
                                               probe, options.pp_split, mixed_precision_policy(precision).param_dtype,
                                               options.verify_pipeline)
        owned = result.pipeline.owned_blocks
    # 2. tensor parallelism
    if dims.tp > 1 or options.tp_plan:
        whole = {**held_modules_whole(module, result.pipeline), **experts_kept_whole_by_tp(module, blocks, probe, owned, dims.ep)}
        result.tp_plan = apply_tensor_parallelism(module, blocks_path, blocks, mesh, dims, options, probe, vocab, owned, whole)
    # 2b. expert parallelism (its FSDP2 units in step 5)
    if dims.ep > 1:
        result.experts = apply_expert_parallelism(module, blocks, dims, probe, owned, options.verify_tp_plan, device.type)
    # 2c. context parallelism on this rank's blocks (after 2 and 2b, whose checks run the blocks whole)
    install_context(result.context, blocks, owned, dims, probe, precision)
    # 3. activation checkpointing
    if options.checkpointing is not None:
        apply_checkpointing(blocks, owned, options.checkpointing, probe)
    # 4. torch.compile per block
    if options.compile_arguments is not None:
        check_compile_layout(options, dims.tp, fsdp_applies(dims, options, precision))
        apply_compile(module, blocks, owned, options.compile_arguments, options.pipeline_schedule)
    # 5. FSDP2
    result.sharded = apply_data_parallel(module, blocks_path, blocks, mesh, data_mesh, dims, options, precision,
                                         result.pipeline, called_outside, result.experts)
    # 6. materialization
    skip = loaded_names(module, options.weights) if options.weights is not None else ()
    apply_materialization(module, torch.device("cpu") if options.offload else device, recorded, skip)
    # 7. pipeline verification against the unsplit step
    if result.pipeline is not None and result.pipeline.unsplit is not None:
        apply_pipeline_check(result.pipeline, probe, data_mesh if dims.data_parallel_size > 1 else None, precision)
    # 8. pretrained weights, read into the shards in place (needs the final layout: each rank reads its slices)
    if options.weights is not None:
        load_pretrained(module, options.weights)
    # 9. no stage computes with a stand-in (the check a model without an unsplit step still gets)
    if result.pipeline is not None and options.verify_pipeline and checkable(probe):
        apply_stand_in_check(result.pipeline, probe, precision)
    return result


def apply_pipeline_check(pipeline: Pipeline, probe: StepProbe, data_mesh: Optional[DeviceMesh], precision: str) -> None:
    """One pipelined step on the first batch against the unsplit step (:func:`check_pipeline`); its cost logged."""
    assert pipeline.unsplit is not None
    start = time.perf_counter()
    allowed = tolerance(precision)
    difference = check_pipeline(pipeline, probe, pipeline.unsplit, data_mesh.get_group() if data_mesh else None,
                                allowed)
    seconds = pipeline.unsplit.seconds + time.perf_counter() - start
    rank_zero_info(f"HybridStrategy: pipeline verified on the first batch against the unsplit step (largest relative"
                   f" difference {difference:.2g}, tolerance {allowed:g}) in {seconds:.2f} s"
                   " (verify_pipeline=False skips this)")


def apply_stand_in_check(pipeline: Pipeline, probe: StepProbe, precision: str) -> None:
    """One pipelined step with NaN standing in for other stages' units (:func:`check_stand_ins`), and, where no
    unsplit step checked what microbatching changes, one on the batch regrouped (:func:`check_regrouped`); the
    cost logged."""
    start = time.perf_counter()
    loss = check_stand_ins(pipeline, probe)
    regrouped = pipeline.unsplit is None and check_regrouped(pipeline, probe, loss, tolerance(precision))
    if pipeline.unsplit is None and not regrouped:
        rank_zero_warn("HybridStrategy: microbatches of one sample cannot be regrouped, so whether microbatching"
                       " changes this model's step (BatchNorm, a loss coupling a batch's samples) was not checked:"
                       " the unsplit model is not available at setup (meta device or weights=).")
    rank_zero_info("HybridStrategy: no pipeline stage computes with what stands in for another stage's blocks"
                   + (", and regrouping the batch's microbatches leaves the loss as it is" if regrouped else "")
                   + f" (checked in {time.perf_counter() - start:.2f} s; verify_pipeline=False skips this)")


def modules_called_outside(module: nn.Module, probe: StepProbe) -> list[nn.Module]:
    """The modules of the blocks that the step calls from outside their block (FSDP2 makes each its own unit)."""
    return [module.get_submodule(name) for name in probe.record().block_module_calls]


def held_modules_whole(module: nn.Module, pipeline: Optional[Pipeline]) -> dict[str, str]:
    """``tp_plan`` entries keeping whole, in every block of its structure, each module of a block that the pipeline
    also holds on a stage calling it from outside the block: its copies must share one layout (their gradients
    are summed), and only the block's stage applies the block's plan."""
    entries: dict[str, str] = {}
    for name in pipeline.split.held_inside if pipeline is not None else ():
        unit = pipeline.split.block_unit_of(name).name
        pattern = f"{unit.rpartition('.')[0]}.*.{name[len(unit) + 1:]}"
        for relative, inner in module.get_submodule(name).named_modules():
            if any(True for _ in inner.parameters(recurse=False)):
                entries[f"{pattern}.{relative}" if relative else pattern] = "replicate"
    return entries


def apply_tensor_parallelism(module: nn.Module, blocks_path: str, blocks: BlockList, mesh: DeviceMesh,
                             dims: ParallelDims, options: HybridOptions, probe: StepProbe,
                             vocab: Optional[VocabLayers], owned: Sequence[int],
                             implied: Mapping[str, str]) -> AppliedPlan:
    """Step 2: the blocks ``owned`` (this rank's) sharded by their plans, what the planner refuses kept whole
    (``tp_strict=True``: refused), the embedding and head by ``vocab``; the plan and its report per block structure
    (every stage's, gathered over the pipeline) logged once on rank 0. ``implied``: modules the layout itself
    keeps whole (:func:`held_modules_whole`), reported so."""
    applied = apply_tensor_parallel(module, blocks_path, blocks, probe.record().block_calls, mesh[TENSOR],
                                    tp_plan=options.tp_plan, verify=options.verify_tp_plan, apply_to=owned,
                                    strict=options.tp_strict, held=implied,
                                    outputs_used=probe.record().block_outputs_used)
    if vocab:
        applied.styles.update(shard_vocab_layers(module, vocab, mesh[TENSOR], options.loss_parallel))
        applied.vocab = vocab.reason
    if dims.pp > 1:  # a stage reports only the structures it holds: every stage's, so rank 0 tells them all
        stages: list[Any] = [None] * dims.pp
        dist.all_gather_object(stages, applied, group=mesh[PIPELINE].get_group())
        applied = applied.merged(stages)
    rank_zero_info(f"HybridStrategy: tensor-parallel plan (tp={dims.tp}): {dict(applied)}")
    for structure in applied.structures:
        rank_zero_info(f"HybridStrategy: {structure.describe(dims.tp)}")
    return applied


def find_vocab(module: nn.Module, blocks: BlockList, dims: ParallelDims, options: HybridOptions,
               probe: StepProbe) -> Optional[VocabLayers]:
    """The token embedding and head to shard over the vocabulary in step 2 (``None`` with tp = 1 or
    ``shard_vocab=False``), found from the probe's record; what stays whole, and why, is logged. ``loss_parallel``
    without a sharded head is refused here."""
    if dims.tp == 1 or not options.shard_vocab:
        require_sharded_head(options.loss_parallel, None)
        return None
    layers = find_vocab_layers(module, blocks, probe.record(), dims.tp, options.tp_plan)
    if layers.reason:
        kept = "the head" if layers.embedding else "the embedding and the head"
        rank_zero_info(f"HybridStrategy: {kept} stay whole over tp (shard_vocab): {layers.reason}.")
    require_sharded_head(options.loss_parallel, layers)
    return layers


def find_blocks(module: nn.Module, options: HybridOptions) -> BlockList:
    """The blocks the parallelisms work on (see :func:`~lightning_hybrid.probe.blocks.find_block_list`). Data
    parallelism alone needs none: a model without a recognizable block list is then sharded as one FSDP2 unit,
    with a warning; tensor and pipeline parallelism, checkpointing, compilation and an ``"auto"`` layout need
    them."""
    try:
        return find_block_list(module, options.blocks)[1]
    except ValueError as error:
        needs_blocks = (options.blocks is not None or options.chooses_layout or options.tp != 1 or options.pp != 1
                        or options.checkpointing is not None or options.compile_arguments is not None)
        if needs_blocks:
            raise
        rank_zero_warn(f"{error} With data parallelism alone the strategy shards the whole model as one FSDP2 unit"
                       " instead (more memory at the gather peak than sharding block by block).")
        return BlockList("", nn.ModuleList())


def apply_pipeline_split(module: nn.Module, blocks_path: str, blocks: BlockList, schedule: PipelineSchedule,
                         mesh: DeviceMesh, device: torch.device, probe: StepProbe,
                         pp_split: Union[None, str, Sequence[int]], compute_dtype: Optional[torch.dtype],
                         verify: bool = False) -> Pipeline:
    """Cut the blocks into the schedule's stages (by the probe's record; by timing the step on one microbatch with
    ``pp_split="measured"``); this rank's stages are installed with FSDP2 in step 5."""
    pipeline = build_pipeline(module, blocks_path, blocks, schedule, mesh, device, probe, pp_split, compute_dtype,
                              verify=verify)
    rank_zero_info(f"HybridStrategy: pipeline {schedule.name} over {schedule.num_stages} stages, blocks per stage"
                   f" {pipeline.split.blocks_per_stage}, {schedule.microbatches} microbatches")
    if pipeline.measured_split is not None:
        rank_zero_info(f"HybridStrategy: {pipeline.measured_split.describe()}")
    if verify and pipeline.unsplit is None:
        rank_zero_info("HybridStrategy: the pipeline is not verified against the unsplit step (the model is on the"
                       " meta device, or setup does not run a training step); a meta-device model's pipeline is"
                       " checked for stand-ins used, and for what microbatching changes, once its values exist")
    return pipeline


def apply_checkpointing(blocks: BlockList, owned: Sequence[int], plan: CheckpointPlan,
                        probe: Optional[StepProbe] = None) -> None:
    """Checkpoint the blocks of ``owned`` that ``plan`` covers (indices over the whole model); a block that updates
    what it is handed (a key/value cache) is refused (:func:`refuse_updated_arguments`, on the probe's record)."""
    if probe is not None and probe.can_run_on:
        refuse_updated_arguments(blocks, probe.record().block_calls, owned, plan)
    count = apply_activation_checkpointing(((i, blocks[i]) for i in owned), plan)
    rank_zero_info(f"HybridStrategy: activation checkpointing {plan} on {count} blocks")


def apply_compile(module: nn.Module, blocks: BlockList, owned: Sequence[int], arguments: dict[str, Any],
                  schedule: Optional[PipelineSchedule] = None) -> None:
    """Compile the blocks of ``owned`` in place with ``torch.compile`` ``arguments``, leaving those the module
    compiled itself (see :mod:`lightning_hybrid.parallel.compile`)."""
    twice = schedule is not None and schedule.splits_weight_gradients
    compiled, kept = compile_blocks(module, blocks.path, [blocks[i] for i in owned], arguments, backward_twice=twice)
    kept_note = f"; {kept} left as the LightningModule compiled them" if kept else ""
    rank_zero_info(f"HybridStrategy: torch.compile({arguments or ''}) on {compiled} blocks, each class compiled at"
                   f" its first call{kept_note}")


def check_compile_layout(options: HybridOptions, tp: int, sharded: bool) -> None:
    """Refuse, before training, the one combination torch 2.13 cannot compile."""
    if options.checkpointing is not None and tp > 1 and sharded:
        # Measured: dp2×tp2 (and dp2×tp2×pp2) with checkpointing fails in the first compiled forward, AOTAutograd
        # asserting that the checkpointed region saved a DeviceMesh for backward (parameters sharded over data
        # and tensor meshes at once); dp2 or tp2 alone with checkpointing compiles and trains equal.
        raise ValueError(
            "HybridStrategy(compile=..., activation_checkpointing=...) with tp > 1 and FSDP2 (data-parallel"
            " sharding, offload or bf16-mixed) cannot be compiled by torch 2.13: its checkpointed regions over"
            " parameters sharded on two meshes fail in AOTAutograd. Drop activation_checkpointing or compile, or"
            " use tp=1 or a single data-parallel rank."
        )


def fsdp_applies(dims: ParallelDims, options: HybridOptions, precision: str) -> bool:
    """Whether step 5 applies FSDP2."""
    # With one data-parallel rank FSDP2 would shard nothing yet make every parameter a DTensor and run its hooks
    # per block (measured: +15 % step time at tp=2, +20 % at pp=2, BENCHMARKS.md); it stays for what only it
    # provides here: bf16-mixed's policy and CPU offload.
    return dims.gradient_ranks > 1 or options.offload or precision == "bf16-mixed"


def apply_data_parallel(module: nn.Module, blocks_path: str, blocks: BlockList, mesh: DeviceMesh,
                        data_mesh: DeviceMesh, dims: ParallelDims, options: HybridOptions, precision: str,
                        pipeline: Optional[Pipeline], called_outside: Sequence[nn.Module] = (),
                        experts: Optional[AppliedExperts] = None) -> bool:
    """FSDP2 over the data mesh (HSDP with replicas), block by block then the root, or per pipeline stage; builds
    the pipeline's stage modules; ``experts`` (expert parallelism's) are units over the ranks holding them. Returns
    whether FSDP2 was applied. ``data_mesh`` is the flattened data-parallel
    mesh itself: slicing it out of ``mesh`` (``mesh["dp"]``) is deprecated by torch 2.13 and warns on every rank."""
    fsdp_mesh = mesh[DATA_DIMS] if dims.dp_replicate > 1 else mesh[DATA_SHARD]
    fsdp_options = FSDPOptions(zero=int(options.zero),
                               mixed_precision=mixed_precision_policy(precision, options.reduce_dtype),
                               offload=options.offload)
    sharded = fsdp_applies(dims, options, precision)
    units = expert_units(experts, dims, mesh.device_type)
    if pipeline is not None:
        install_stages(pipeline, blocks, fsdp_mesh, fsdp_options if sharded else None, data_mesh.get_group(),
                       called_outside, units)
    elif sharded:
        apply_fsdp(module, blocks, fsdp_mesh, fsdp_options, data_mesh.get_group(), called_outside, units)
    if experts is not None:  # their gradient norms add up over the ep ranks: the parameters FSDP2 made
        experts.spread_norms = spread_experts(experts, dims, mesh.device_type)
    mesh_shape = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
    if sharded:
        rank_zero_info(f"HybridStrategy: FSDP2 (ZeRO-{options.zero}) over {len(blocks)} blocks of '{blocks_path}',"
                       f" mesh {mesh_shape}")
    else:
        rank_zero_info(f"HybridStrategy: one data-parallel rank, no FSDP2 (mesh {mesh_shape})")
    return sharded


def install_stages(pipeline: Pipeline, blocks: BlockList, fsdp_mesh: DeviceMesh,
                   fsdp_options: Optional[FSDPOptions], data_group: Any = None,
                   called_outside: Sequence[nn.Module] = (), experts: Optional[ExpertUnits] = None) -> None:
    """Build this rank's stage modules; with ``fsdp_options``, FSDP2 per block of each local stage, each stage
    module the root of its own units (``data_group``, ``called_outside``: see :func:`apply_fsdp`)."""
    pipeline.install(sharded=fsdp_options is not None)
    if fsdp_options is not None:
        for stage, stage_module in pipeline.stage_modules.items():
            stage_blocks = [blocks[i] for i in pipeline.split.block_range(stage)]
            apply_fsdp(stage_module, stage_blocks, fsdp_mesh, fsdp_options, data_group, called_outside, experts)
    pipeline.route_units()


def apply_materialization(module: nn.Module, device: torch.device,
                          recorded: Optional[dict[str, Callable[[], torch.Tensor]]] = None,
                          skip: Collection[str] = ()) -> None:
    """Give a meta-device model its values, each rank only its shards (see
    :mod:`lightning_hybrid.parallel.initialization`): ``recorded`` ones from its construction
    (:mod:`lightning_hybrid.parallel.construction`), the others per module. The seed is rank 0's, so every rank
    draws the same values; every rank calls it."""
    seed = [torch.initial_seed()]
    if dist.is_initialized():
        dist.broadcast_object_list(seed, src=0)
    if materialize_meta_module(module, device, seed[0], recorded, skip):
        rank_zero_info(f"HybridStrategy: initialized the meta-device model per module from seed {seed[0]}.")
