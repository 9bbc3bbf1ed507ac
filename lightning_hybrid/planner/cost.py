"""Choose a layout before launching: per-GPU memory and step time of HybridStrategy layouts, from a cost model.

Example::

    from lightning_hybrid.planner.cost import Layout, estimate
    from lightning_hybrid.hardware import Cluster
    from lightning_hybrid.planner.model import ModelShape
    from lightning_hybrid.planner.search import plan

    llama7b = ModelShape(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    cluster = Cluster.preset("h100-sxm", nodes=4)                      # 4 × 8 GPUs
    best = plan(llama7b, cluster, global_batch=256)[0]                 # the fastest layout that fits
    print(best.layout, best.time.step, best.memory.total / 2**30)
    estimate(llama7b, cluster, Layout(dp=8, tp=4), global_batch=256)   # one layout's breakdown

or ``lightning-hybrid plan --params 7e9 --seq-len 4096 --gpu h100-sxm --nodes 4 --global-batch 256`` (with
``--layout "dp8 tp4"`` one layout's breakdown and rank), or inside a run ``HybridStrategy(tp="auto", pp="auto")``
(:mod:`lightning_hybrid.planner.auto_layout`).

Symbols: b sequences per microbatch, s sequence, h hidden, a heads, V vocabulary, L layers; t, d, R, p, v, m = tp,
dp (shard), dp_replicate, pp, virtual stages, microbatches. The formulas: memory in :mod:`~.memory`, time in
:mod:`~.step_time` (memory-bound kernels in :mod:`~.traffic`, GEMMs and attention in :mod:`~.kernels`), the ranks
computed in :mod:`~.step`; the fullest rank's memory and the busiest rank's time count.

Gradient accumulation: with p = 1, ``Layout.microbatches`` = m is ``Trainer(accumulate_grad_batches=m)`` with a
DataLoader batch of b = global batch / (d·R·m): the m microbatches run one after another, forward and backward
each, so a rank holds one microbatch's activations; compute and TP bytes are those of the whole batch. FSDP2 is
not told to wait (Lightning's ``block_backward_sync`` only pauses DDP, HybridStrategy keeps it), so every
microbatch all-gathers and reduce-scatters as a whole step would. With p > 1, m are the pipeline's microbatches and
``Layout.accumulate`` = k is ``accumulate_grad_batches``: k pipeline steps, each with its bubble and its
reduce-scatter (torch's stage reduces at the end of every ``step()``), one optimizer step.

Step = busiest rank's (compute + TP + PP) × (m·v + p − 1)/(m·v), i.e. bubble (p−1)/(m·v+p−1), + exposed
data-parallel time + the optimizer step. MFU = 3 × forward FLOPs / (step × GPUs × peak).
Checked with :class:`~lightning_hybrid.observe.counting.StepCounter` (recipes/gpt.py, 2 blocks of width 64, dp=2,
m = 1 and 2): per optimizer step ZeRO-3 all-gathers 2·m × the parameters' bytes and both levels reduce-scatter m ×
them, exactly; ZeRO-2 gathers the root (embeddings, head) twice per microbatch, 1.09·m × the parameters here, not m.

``compile=True``: element-wise chains fused (:mod:`~.traffic`: the planner's only effect of it; matmuls run the
same kernels, BENCHMARKS.md "torch.compile"); refused, as the strategy refuses it, with checkpointing under tp > 1
and FSDP2. Matmuls are timed from their shapes with the presets' kernel profile (:mod:`~.kernels`: a smaller
microbatch's partial tiles and waves cost in full; at equal predicted time :func:`plan` ranks fewer accumulation
steps first). Not modeled: zero-bubble schedules, the LoopedBFS/V placements, compute–communication
overlap inside tensor parallelism.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Optional

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.options.hybrid_options import check_precision
from lightning_hybrid.options.schedules import PLANNED_SCHEDULES, PipelineSchedule
from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.layout import OUT_OF_MEMORY, Estimate, Layout, MemoryBreakdown, TimeBreakdown
from lightning_hybrid.planner.memory import layer_activation_bytes, rank_memory
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.step import PRECISIONS, StepShape, describe_step, pipeline_ranks
from lightning_hybrid.planner.step_time import rank_times

__all__ = ["Layout", "check_model_fits_cluster", "describe_size", "estimate", "layer_activation_bytes", "stage_memory"]


def _schedule(layout: Layout) -> Optional[PipelineSchedule]:
    if layout.pp == 1:
        if (layout.virtual_stages or 1) != 1:
            raise ValueError("virtual_stages is a pipeline option: set pp > 1")
        return None
    if layout.pp_schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"the planner models pp_schedule {', '.join(PLANNED_SCHEDULES)}, not {layout.pp_schedule!r}")
    return PipelineSchedule.resolve(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.microbatches)


def _structural_reasons(step: StepShape) -> list[str]:
    model, layout = step.model, step.layout
    sizes = {"heads": model.heads, "kv_heads": model.kv_heads, "hidden": model.hidden, "ffn_hidden": model.ffn_hidden}
    if model.kv_heads == model.heads:
        del sizes["kv_heads"]  # one reason is enough
    reasons = [f"tp={layout.tp} does not divide {name}={value}" for name, value in sizes.items() if value % layout.tp]
    stages = layout.pp * step.virtual_stages
    if stages > model.layers:
        reasons.append(f"{stages} pipeline stages for {model.layers} layers")
    splits = layout.dp * layout.dp_replicate * step.microbatches * step.pipeline_steps
    if step.global_batch % splits:
        what = "microbatches × accumulate" if step.pipeline_steps > 1 else "microbatches"
        reasons.append(f"global batch {step.global_batch} is not divisible by dp × dp_replicate × {what} = {splits}")
    return reasons + _option_reasons(step) + _expert_reasons(step) + _context_reasons(step)


def _context_reasons(step: StepShape) -> list[str]:
    """What HybridStrategy cannot split over ``cp`` ranks (context_parallel/: equal parts, whole heads each)."""
    cp, model, tp = step.layout.cp, step.model, step.layout.tp
    if cp == 1:
        return []
    return [f"cp={cp} does not divide {name}={value}" for name, value in
            (("seq_len", model.seq_len), ("heads per tp rank", model.heads // tp)) if value % cp]


def _expert_reasons(step: StepShape) -> list[str]:
    """What HybridStrategy refuses about ``ep`` (mesh.py, expert_parallel/apply.py)."""
    ep, model = step.layout.ep, step.model
    if ep == 1:
        return []
    if not model.experts:
        return [f"ep={ep} needs a mixture-of-experts model (experts > 0)"]
    shards = "dp × cp" if step.layout.cp > 1 else "dp"
    return [f"ep={ep} does not divide {name}={value}" for name, value in
            ((shards, step.shard_ranks), ("experts", model.experts)) if value % ep]


def _option_reasons(step: StepShape) -> list[str]:
    """What HybridStrategy refuses at setup among the options a layout carries."""
    layout, reasons = step.layout, []
    if layout.loss_parallel and layout.pp > 1:
        reasons.append("loss_parallel=True does not run with pp > 1")
    if layout.loss_parallel and step.vocab_shards == 1:
        reasons.append("loss_parallel=True needs the head sharded over the vocabulary (tp > 1 dividing it,"
                       " shard_vocab)")
    if layout.compile and layout.activation_checkpointing is not None and layout.tp > 1 and step.fsdp:
        reasons.append("compile=True with activation checkpointing, tp > 1 and FSDP2 fails in torch 2.13's"
                       " AOTAutograd (parallelize.check_compile_layout)")
    return reasons


def check_model_fits_cluster(model: ModelShape, cluster: Cluster, precision: str) -> None:
    """Refuse a model whose model states alone exceed the usable memory of all the cluster's GPUs together."""
    check_precision(precision)
    bytes_ = PRECISIONS[precision]
    per_parameter = bytes_.parameter + bytes_.gradient + bytes_.optimizer
    needed = per_parameter * model.total_parameters
    if needed > cluster.gpus * cluster.usable_memory:
        raise ValueError(
            f"The model states alone need {needed:,} bytes ({per_parameter} B/param × {model.total_parameters:,}"
            f" parameters, {precision} with AdamW): at least {math.ceil(needed / cluster.usable_memory)} GPUs of"
            f" {cluster.memory_bytes / GIB:g} GiB ({cluster.usable_memory_fraction:.0%} usable), and the cluster"
            f" has {cluster.gpus}.")


def estimate(model: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
             precision: str = "bf16-mixed") -> Estimate:
    """Memory, time and feasibility of one layout. Bad input raises ``ValueError`` (degrees that do not multiply
    to the cluster's GPUs, a model larger than the cluster); what only rules out this layout is in ``reasons``."""
    check_positive_values("estimate", global_batch=global_batch)
    check_model_fits_cluster(model, cluster, precision)
    if layout.gpus != cluster.gpus:
        raise ValueError(f"Layout {layout} uses {layout.gpus} GPUs; the cluster has {cluster.gpus}.")
    reasons = []
    try:
        schedule = _schedule(layout)
    except ValueError as error:
        reasons.append(str(error))
        # Still sized, as GPipe (the most activation memory) with the requested microbatches.
        schedule = PipelineSchedule("gpipe", layout.pp, 1, layout.microbatches or layout.pp) if layout.pp > 1 else None
    step = describe_step(model, cluster, layout, schedule, precision, global_batch)
    reasons += _structural_reasons(step)
    ranks = pipeline_ranks(step)
    memory = max((rank_memory(step, rank) for rank in ranks), key=lambda breakdown: breakdown.total)
    if memory.total > cluster.usable_memory:
        where = "" if memory.stage == "only" else f" on the {memory.stage} pipeline stage"
        reasons.append(f"{OUT_OF_MEMORY}: {describe_size(memory.total)} per GPU{where},"
                       f" {describe_size(memory.total - cluster.usable_memory)} over the usable"
                       f" {describe_size(cluster.usable_memory)}")
    time = _step_time(step, ranks)
    model_flops = 3 * global_batch * model.seq_len * (
        2 * (model.layers * model.active_parameters_per_block + model.vocab * model.hidden)
        + 4 * model.layers * model.seq_len * model.hidden)
    if schedule is not None:
        layout = replace(layout, microbatches=schedule.microbatches, virtual_stages=schedule.virtual_stages)
    return Estimate(layout, memory, time, tokens_per_second=global_batch * model.seq_len / time.step,
                    mfu=model_flops / (time.step * cluster.gpus * cluster.peak_flops), reasons=tuple(reasons))


def describe_size(size_bytes: float) -> str:
    """A memory size in the largest unit that shows it as at least 0.1, never as zero: "0.0 GiB over" reads as if a
    layout fit, and a tiny cluster's usable memory would print as 0.0 GiB."""
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= 0.1 * scale:
            return f"{size_bytes / scale:.1f} {unit}"
    return f"{size_bytes:.0f} B"


def stage_memory(model: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
                 precision: str = "bf16-mixed") -> dict[str, MemoryBreakdown]:
    """The memory of every pipeline rank :func:`estimate` computes, by stage (``"only"``, or ``"first"``,
    ``"middle"``, ``"last"``); ``estimate`` reports the fullest."""
    step = describe_step(model, cluster, layout, _schedule(layout), precision, global_batch)
    return {rank.stage: rank_memory(step, rank) for rank in pipeline_ranks(step)}


def _step_time(step: StepShape, ranks: list) -> TimeBreakdown:
    """The busiest rank's pipelined time, its bubble, the most exposed data-parallel time and optimizer step."""
    times = [rank_times(step, rank) for rank in ranks]
    busiest = max(times, key=lambda t: t.compute + t.tensor + t.pipe + t.experts + t.context)
    busy = busiest.compute + busiest.tensor + busiest.pipe + busiest.experts + busiest.context
    slots = step.microbatches * step.virtual_stages
    pipelined = busy * (slots + step.layout.pp - 1) / slots  # the bubble is (p − 1) / (m·v + p − 1) of this
    exposed, optimizer = max(t.exposed for t in times), max(t.optimizer for t in times)
    return TimeBreakdown(busiest.compute, busiest.tensor, busiest.pipe, busiest.data, exposed, pipelined - busy,
                         pipelined + exposed + optimizer, memory_bound=busiest.memory_bound, optimizer=optimizer,
                         experts=busiest.experts, context=busiest.context)
