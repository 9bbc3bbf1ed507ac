"""Choose a layout before launching: per-GPU memory and step time of HybridStrategy layouts, from a cost model.

Example::

    from lightning_hybrid.plan.cost import Layout, estimate
    from lightning_hybrid.plan.hardware import Cluster
    from lightning_hybrid.plan.model import ModelShape
    from lightning_hybrid.plan.search import plan

    llama7b = ModelShape(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    cluster = Cluster.preset("h100-sxm", nodes=4)                      # 4 × 8 GPUs
    best = plan(llama7b, cluster, global_batch=256)[0]                 # the fastest layout that fits
    print(best.layout, best.time.step, best.memory.total / 2**30)
    estimate(llama7b, cluster, Layout(dp=8, tp=4), global_batch=256)   # one layout's breakdown

or ``lightning-hybrid plan --params 7e9 --seq-len 4096 --gpu h100-sxm --nodes 4 --global-batch 256``, or inside a
run ``HybridStrategy(tp="auto", pp="auto")`` (:mod:`lightning_hybrid.plan.auto_layout`).

Symbols: b sequences per microbatch, s sequence, h hidden, a heads, V vocabulary, L layers; t, d, R, p, v, m =
tp, dp (shard), dp_replicate, pp, virtual stages, microbatches. The first and last pipeline ranks are computed
(middle ones hold no more than the first); the worst counts.

Gradient accumulation: with p = 1, ``Layout.microbatches`` = m is ``Trainer(accumulate_grad_batches=m)`` with a
DataLoader batch of b = global batch / (d·R·m): the m microbatches run one after another, forward and backward
each, so a rank holds one microbatch's activations; compute and TP bytes are those of the whole batch. FSDP2 is
not told to wait (Lightning's ``block_backward_sync`` only pauses DDP, HybridStrategy keeps it), so every
microbatch all-gathers and reduce-scatters as a whole step would. (With p > 1, m are the pipeline's microbatches.)

Memory per GPU
    Model states: parameters + gradients + AdamW moments per the README's dtype table (32-true 4+4+8 B,
    bf16-mixed 4+4+8 with fp32 master weights, bf16-true and 16-true 2+2+4) × the rank's tp-local parameters ÷ d.
    Blocks are tensor-parallel (matrices ÷ t, 1-D norms/biases whole), and so are the token embedding (V·h, first
    stage) and an untied head (V·h, last stage) when t divides V (``shard_vocab``, HybridStrategy's default); other
    embeddings and the final norm are whole on every tp rank. Gradients count at the activation peak (conservative:
    Lightning frees them between steps). Gathered parameters, compute dtype, plus the root unit, as FSDP2's peak
    was measured (BENCHMARKS.md, Planner): ZeRO-3 three blocks (a prefetched block's all-gather output and its copied-out
    parameters exist together), ZeRO-2 the stage and two blocks' all-gather buffers; none without FSDP2, which
    HybridStrategy leaves out on one data-parallel rank (d·R = 1) except for bf16-mixed (its casting policy).
    With pp > 1 torch's pipeline keeps
    parameters gathered after a backward and accumulates *unsharded* gradients (reduce dtype) until the last
    microbatch: both ZeRO levels hold the whole stage gathered, and its full gradients instead of the sharded
    ones. With p = 1 FSDP2 reduce-scatters each accumulation step and adds the result to the sharded gradients:
    no unsharded copy.
    Activations per block and microbatch: Korthikanti et al. 2022, Table 2, per tensor (so GQA, ``ffn_hidden``,
    gated MLPs fit): with kv_heads = a, ffn = 4h, dropout and materialized scores at 16 bits exactly their
    s·b·h·(10 + 24/t + 5·a·s/(h·t)), 34 + 5·a·s/h at t = 1 (no sequence parallelism). Defaults: no dropout masks
    (dropout 0, as in LLM pretraining) and flash SDPA (no a·s² scores; a 4-byte logsumexp per head and token);
    fp32 doubles tensors, not 1-byte masks. Full recomputation: s·b·h per block + one block's working set.
    Chunk-microbatches held on rank r: one with p = 1 (accumulation steps run in turn), GPipe m, 1F1B
    min(m, p − r), interleaved min(m·v, (v−1)·p + 2·(p−1−r) + 1) (torch's warm-up; rank 0: Korthikanti's
    L·(1 + (p−1)/(p·v)) layers).
    Receive buffers: one b·s·h per microbatch and chunk (both directions when v > 1), kept by torch's pipeline.
    Last stage: logits b·s·V and the loss's log-softmax per microbatch held (GPipe m, else 1). ⌈L/(p·v)⌉
    blocks per stage (HybridStrategy balances FLOPs, which may move one off the head's stage). A layout fits if
    its total is at most ``usable_memory_fraction`` of the GPU.

Time per step
    Compute: forward FLOPs per token 2·(L·P_block + V·h) + 4·L·s·h (embedding lookups are free), ×3 with
    backward, ×4 with recomputation; a rank runs its blocks ÷ t plus, last stage, the head (÷ t when sharded over
    the vocabulary); ÷ (peak × efficiency). TP: 4 all-reduces of b·s·h per block and microbatch (6 with
    recomputation), ring 2·(t−1)/t × bytes; a vocabulary-sharded embedding adds one (its output), the head one
    (its input gradient) and an all-gather of the logits b·s·V, (t−1)/t × bytes. PP: an activation and a
    gradient of b·s·h per microbatch and chunk. FSDP: all-gathers of the stage's
    tp-local parameters, compute dtype (ZeRO-3: forward and backward of every microbatch, 2·m, an upper bound;
    ZeRO-2: one per step with p > 1, where the pipeline keeps the stage gathered, but one per accumulation step,
    m, with p = 1, where FSDP2 reshards after each backward) and reduce-scatters, reduce dtype, (d−1)/d × bytes
    each (one per step with p > 1, m with p = 1); HSDP adds as many all-reduces of the shards over R. Links:
    mesh pp × dp_replicate × dp_shard × tp (tp innermost); a dimension uses NVLink iff each of its groups lies
    in one node. Every message also costs the cluster's ``latency`` α: TP one all-reduce per block, pass and
    microbatch, PP two messages per chunk-microbatch, FSDP one collective per unit (each block and the root) and
    pass. Overlap: TP and PP messages are exposed; FSDP/HSDP traffic hides behind compute and only the excess
    shows, but with pp > 1 the reduce-scatter/all-reduce follow the last backward (exposed); with
    ``overlap_communication=False`` (CPUs) all of it shows. Step = busiest rank's (compute + TP + PP) ×
    (m·v + p − 1)/(m·v), i.e. bubble (p−1)/(m·v+p−1), + exposed data-parallel time. MFU = 3 × forward FLOPs / (step × GPUs × peak).
    Checked with :class:`~lightning_hybrid.observe.counting.StepCounter` (recipes/gpt.py, 2 blocks of width 64, dp=2,
    m = 1 and 2): per optimizer step ZeRO-3 all-gathers 2·m × the parameters' bytes and both levels
    reduce-scatter m × them, exactly; ZeRO-2 gathers the root (embeddings, head) twice per microbatch, 1.09·m ×
    the parameters here, not m.
    Not modeled: accumulation on top of a pipeline (``accumulate_grad_batches`` with p > 1), smaller
    microbatches' lower efficiency (so at equal predicted time :func:`plan` ranks fewer accumulation steps
    first), "selective" or every-N checkpointing, zero-bubble schedules, CPU offload.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.options import check_precision
from lightning_hybrid.pipeline.schedules import PLANNED_SCHEDULES, PipelineSchedule
from lightning_hybrid.plan.hardware import GIB, Cluster
from lightning_hybrid.plan.layout import OUT_OF_MEMORY, Estimate, Layout, MemoryBreakdown, TimeBreakdown
from lightning_hybrid.plan.model import ModelShape


@dataclass(frozen=True)
class _Precision:
    """Bytes per element of each kind of tensor (the README's dtype table)."""

    parameter: int  # sharded parameter (master weight)
    gradient: int  # sharded gradient
    optimizer: int  # AdamW's two moments
    compute: int  # gathered parameters, activations, messages
    reduce: int  # gradient reduction, and unsharded accumulation with pp > 1


_PRECISIONS = {"32-true": _Precision(4, 4, 8, 4, 4), "bf16-mixed": _Precision(4, 4, 8, 2, 4),
               "bf16-true": _Precision(2, 2, 4, 2, 2), "16-true": _Precision(2, 2, 4, 2, 2)}


def layer_activation_bytes(model: ModelShape, micro_batch: float, tp: int, element_bytes: int) -> float:
    """Bytes one block saves for backward per microbatch (Korthikanti et al. 2022, Table 2, per tensor)."""
    s, h, a = model.seq_len, model.hidden, model.heads
    # q, k, v, attention output, MLP intermediates (fc, activation; gated: gate, up, activation, product)
    sharded = h + 2 * model.kv_heads * (h // a) + h + (4 if model.gated_mlp else 2) * model.ffn_hidden
    per_token = (4 * h + sharded / tp) * element_bytes  # + both norm inputs, attention and MLP inputs (whole)
    per_token += 4 * a / tp if model.flash_attention else a * s / tp * element_bytes  # logsumexp / softmax
    if model.dropout:  # 1-byte masks after attention and MLP (+ on the probabilities, and their dropped copy)
        per_token += 2 * h + (0 if model.flash_attention else a * s / tp * (1 + element_bytes))
    return s * micro_batch * per_token


@dataclass(frozen=True)
class _Step:
    """What every rank of one layout shares (see :func:`_step`)."""

    model: ModelShape
    cluster: Cluster
    layout: Layout
    schedule: Optional[PipelineSchedule]
    bytes: _Precision
    global_batch: int
    microbatches: int
    virtual_stages: int
    micro_batch: float  # b: sequences per microbatch
    residual_bytes: float  # one b·s·h tensor: a block's input, a pipeline receive buffer
    block_local_parameters: float  # one block's parameters on one tp rank
    vocab_shards: int  # t when the token embedding and head are sharded over the vocabulary, else 1
    checkpointed: bool
    fsdp: bool  # HybridStrategy applies FSDP2 (see _memory)


def _step(model: ModelShape, cluster: Cluster, layout: Layout, schedule: Optional[PipelineSchedule],
          precision: str, global_batch: int) -> _Step:
    bytes_ = _PRECISIONS[precision]
    m, v = (schedule.microbatches, schedule.virtual_stages) if schedule else (layout.accumulation_steps, 1)
    micro_batch = global_batch / (layout.dp * layout.dp_replicate * m)
    whole = model.whole_parameters_per_block
    return _Step(model, cluster, layout, schedule, bytes_, global_batch, m, v, micro_batch,
                 residual_bytes=micro_batch * model.seq_len * model.hidden * bytes_.compute,
                 block_local_parameters=(model.parameters_per_block - whole) / layout.tp + whole,
                 vocab_shards=layout.tp if layout.shard_vocab and model.vocab % layout.tp == 0 else 1,
                 checkpointed=layout.activation_checkpointing == "every",
                 fsdp=layout.dp * layout.dp_replicate > 1 or precision == "bf16-mixed")


@dataclass(frozen=True)
class _Rank:
    """A pipeline rank: its blocks, whether it holds the embeddings / the head, and how many chunk-microbatches'
    activations it holds at its peak."""

    stage: str
    blocks: int
    first: bool
    last: bool
    in_flight: int

    def local_parameters(self, step: _Step) -> float:
        model = step.model
        # A vocabulary-sharded table keeps 1/t of its V·h on each tp rank (a tied head is the embedding's).
        saved = min(model.vocab * model.hidden, model.first_stage_parameters) * (1 - 1 / step.vocab_shards)
        first = model.first_stage_parameters - saved
        last = model.last_stage_parameters - (0.0 if model.tied_embeddings else saved)
        return self.blocks * step.block_local_parameters + self.first * first + self.last * last


def _ranks(step: _Step) -> list[_Rank]:
    schedule = step.schedule
    if schedule is None:
        return [_Rank("only", step.model.layers, True, True, 1)]
    p, v, m = schedule.pp, schedule.virtual_stages, schedule.microbatches
    blocks = math.ceil(step.model.layers / (p * v)) * v

    def in_flight(rank: int) -> int:
        if schedule.name == "gpipe":
            return m
        if schedule.name == "1f1b":
            return min(m, p - rank)
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)

    return [_Rank("first", blocks, True, False, in_flight(0)), _Rank("last", blocks, False, True, in_flight(p - 1))]


def _memory(step: _Step, rank: _Rank) -> MemoryBreakdown:
    local = rank.local_parameters(step)
    sharded = local / step.layout.dp
    if step.schedule is not None:
        gathered_blocks = rank.blocks
    else:  # FSDP2's peak, measured: 3 blocks at ZeRO-3; the stage and 2 more blocks' buffers at ZeRO-2
        gathered_blocks = min(3, rank.blocks) if step.layout.zero == 3 else rank.blocks + min(2, rank.blocks)
    gathered = local - (rank.blocks - gathered_blocks) * step.block_local_parameters if step.fsdp else 0.0
    per_layer = layer_activation_bytes(step.model, step.micro_batch, step.layout.tp, step.bytes.compute)
    chunk_blocks = rank.blocks // step.virtual_stages
    activations = rank.in_flight * chunk_blocks * (step.residual_bytes if step.checkpointed else per_layer)
    activations += per_layer if step.checkpointed else 0.0  # the block being recomputed
    if step.schedule is not None:
        directions = 2 if step.virtual_stages > 1 else 1
        activations += step.microbatches * step.virtual_stages * directions * step.residual_bytes
    held_losses = step.microbatches if step.schedule and step.schedule.name == "gpipe" else 1
    logits = (held_losses + 1) * step.micro_batch * step.model.seq_len * step.model.vocab * step.bytes.compute
    gradients = local * step.bytes.reduce if step.schedule is not None else sharded * step.bytes.gradient
    return MemoryBreakdown(
        stage=rank.stage, parameters=sharded * step.bytes.parameter, gradients=gradients,
        optimizer_state=sharded * step.bytes.optimizer, gathered_parameters=gathered * step.bytes.compute,
        activations=activations, logits=logits if rank.last else 0.0)


def _ring(bytes_moved: float, size: int, bandwidth: float, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather or reduce-scatter ((n−1)/n × bytes) or all-reduce (twice that)."""
    return (2 if all_reduce else 1) * (size - 1) / size * bytes_moved / bandwidth if size > 1 else 0.0


def _times(step: _Step, rank: _Rank) -> tuple[float, float, float, float, float]:
    """(compute, TP, PP, data-parallel, exposed data-parallel) seconds of one rank per step."""
    model, cluster, layout, m = step.model, step.cluster, step.layout, step.microbatches
    t, d, r, p = layout.tp, layout.dp, layout.dp_replicate, layout.pp
    tokens = step.global_batch * model.seq_len / (d * r)
    # TP and PP move b·s·h per microbatch; summed from the replica's batch directly, so layouts that differ only in
    # m tie exactly (no rounding of m × b) and the tie-break in plan() decides.
    replica_activation_bytes = tokens * model.hidden * step.bytes.compute
    block_flops = 2 * model.parameters_per_block + 4 * model.seq_len * model.hidden  # forward, per token
    forward = tokens * (rank.blocks * block_flops / t + rank.last * 2 * model.vocab * model.hidden / step.vocab_shards)
    compute = (4 if step.checkpointed else 3) * forward / (cluster.peak_flops * cluster.efficiency)
    all_reduces = 6 if step.checkpointed else 4  # 2 in forward (+2 recomputed), 2 in backward
    alpha, chunk_microbatches = cluster.latency, m * step.virtual_stages
    tensor = rank.blocks * all_reduces * _ring(replica_activation_bytes, t, cluster.link_bandwidth(t, 1), True)
    tensor += rank.blocks * all_reduces * m * alpha if t > 1 else 0.0  # one all-reduce per microbatch each
    if step.vocab_shards > 1:  # the embedding's output and the head's input gradient all-reduced, logits gathered
        tensor += (rank.first + rank.last) * (_ring(replica_activation_bytes, t, cluster.link_bandwidth(t, 1), True)
                                              + m * alpha)
        tensor += rank.last * (_ring(tokens * model.vocab * step.bytes.compute, t, cluster.link_bandwidth(t, 1))
                               + m * alpha)
    pipe = 2 * step.virtual_stages * replica_activation_bytes / cluster.link_bandwidth(p, r * d * t) if p > 1 else 0.0
    pipe += 2 * chunk_microbatches * alpha if p > 1 else 0.0  # an activation out, a gradient back
    local, dp_link = rank.local_parameters(step), cluster.link_bandwidth(d, t)
    syncs = m if p == 1 else 1  # FSDP2 syncs every accumulation step; the pipeline once, after its last backward
    gather_passes = 2 * m if layout.zero == 3 else syncs
    units = rank.blocks + 1  # FSDP2 communicates per unit: each block, and the root's own parameters
    gathers = gather_passes * (_ring(local * step.bytes.compute, d, dp_link) + (units * alpha if d > 1 else 0.0))
    reductions = syncs * (_ring(local * step.bytes.reduce, d, dp_link) + (units * alpha if d > 1 else 0.0))
    reductions += syncs * (_ring(local / d * step.bytes.reduce, r, cluster.link_bandwidth(r, d * t), True)
                           + (units * alpha if r > 1 else 0.0))
    if not cluster.overlap_communication:
        exposed = gathers + reductions
    elif p > 1:
        exposed = max(0.0, gathers - compute) + reductions
    else:
        exposed = max(0.0, gathers + reductions - compute)
    return compute, tensor, pipe, gathers + reductions, exposed


def _schedule(layout: Layout) -> Optional[PipelineSchedule]:
    if layout.pp == 1:
        if (layout.virtual_stages or 1) != 1:
            raise ValueError("virtual_stages is a pipeline option: set pp > 1")
        return None
    if layout.pp_schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"the planner models pp_schedule {', '.join(PLANNED_SCHEDULES)}, not {layout.pp_schedule!r}")
    return PipelineSchedule.resolve(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.microbatches)


def _structural_reasons(step: _Step) -> list[str]:
    model, layout = step.model, step.layout
    sizes = {"heads": model.heads, "kv_heads": model.kv_heads, "hidden": model.hidden, "ffn_hidden": model.ffn_hidden}
    if model.kv_heads == model.heads:
        del sizes["kv_heads"]  # one reason is enough
    reasons = [f"tp={layout.tp} does not divide {name}={value}" for name, value in sizes.items() if value % layout.tp]
    stages = layout.pp * step.virtual_stages
    if stages > model.layers:
        reasons.append(f"{stages} pipeline stages for {model.layers} layers")
    if layout.pp > 1 and model.tied_embeddings:
        reasons.append("tied (shared) weights cannot be split across pipeline stages")
    splits = layout.dp * layout.dp_replicate * step.microbatches
    if step.global_batch % splits:
        reasons.append(f"global batch {step.global_batch} is not divisible by dp × dp_replicate × microbatches ="
                       f" {splits}")
    return reasons


def check_model_fits_cluster(model: ModelShape, cluster: Cluster, precision: str) -> None:
    """Refuse a model whose model states alone exceed the usable memory of all the cluster's GPUs together."""
    check_precision(precision)
    bytes_ = _PRECISIONS[precision]
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
    step = _step(model, cluster, layout, schedule, precision, global_batch)
    reasons += _structural_reasons(step)
    ranks = _ranks(step)
    memory = max((_memory(step, rank) for rank in ranks), key=lambda breakdown: breakdown.total)
    times = [_times(step, rank) for rank in ranks]
    compute, tensor, pipe, data, _ = max(times, key=lambda rank_times: sum(rank_times[:3]))
    busy, slots = compute + tensor + pipe, step.microbatches * step.virtual_stages
    pipelined = busy * (slots + layout.pp - 1) / slots  # the bubble is (p − 1) / (m·v + p − 1) of this
    seconds = pipelined + max(rank_times[4] for rank_times in times)
    if memory.total > cluster.usable_memory:
        where = "" if memory.stage == "only" else f" on the {memory.stage} pipeline stage"
        reasons.append(f"{OUT_OF_MEMORY}: {memory.total / GIB:.1f} GiB per GPU{where},"
                       f" {(memory.total - cluster.usable_memory) / GIB:.1f} GiB over the usable"
                       f" {cluster.usable_memory / GIB:.1f} GiB")
    model_flops = 3 * global_batch * model.seq_len * (
        2 * (model.layers * model.parameters_per_block + model.vocab * model.hidden)
        + 4 * model.layers * model.seq_len * model.hidden)
    if schedule is not None:
        layout = replace(layout, microbatches=schedule.microbatches, virtual_stages=schedule.virtual_stages)
    time = TimeBreakdown(compute, tensor, pipe, data, seconds - pipelined, pipelined - busy, seconds)
    return Estimate(layout, memory, time, tokens_per_second=global_batch * model.seq_len / seconds,
                    mfu=model_flops / (seconds * cluster.gpus * cluster.peak_flops), reasons=tuple(reasons))
