"""Seconds per optimizer step of one pipeline rank of a layout (:func:`rank_times`).

Compute: matmul FLOPs per token forward 2·(L·P_block + V·h) + 4·L·s·h (embedding lookups are free), ×3 with
backward; a checkpointed block's forward runs again (selective checkpointing repeats no matmul); a rank runs its
blocks ÷ t plus, last stage, the head (÷ t when sharded over the vocabulary; never recomputed: HybridStrategy
checkpoints blocks). With the GPU's kernel profile (the presets) the GEMMs run at peak × efficiency × their shapes'
factor and the attention cores by their kernel (:mod:`~lightning_hybrid.planner.kernels`); without it every FLOP
runs at peak × efficiency. Where the cluster gives ``memory_bandwidth``, the memory-bound kernels
(:mod:`~lightning_hybrid.planner.traffic`) add their bytes ÷ that bandwidth.

TP: 4 all-reduces of b·s·h per block and microbatch (6 when the block recomputes in full; selective keeps the
collectives' outputs), ring 2·(t−1)/t × bytes; a vocabulary-sharded embedding adds one (its output), the head one
(its input gradient) and an all-gather of the logits b·s·V, (t−1)/t × bytes (with ``loss_parallel`` instead two
all-reduces of one fp32 value per token). PP: an activation and a gradient of b·s·h per microbatch and chunk.
HybridStrategy's stages send the whole tensor from every tp rank to its peer (Megatron's scatter/gather sends 1/t
over the network and all-gathers it over NVLink: t times fewer network bytes). FSDP: all-gathers of the stage's
tp-local parameters, compute dtype (ZeRO-3: forward and backward of every microbatch, 2·m, an upper bound;
ZeRO-2: one per pipeline step with p > 1, where the pipeline keeps the stage gathered, but one per accumulation
step, m, with p = 1, where FSDP2 reshards after each backward) and reduce-scatters, reduce dtype, (d−1)/d × bytes
each (one per pipeline step with p > 1, m with p = 1); HSDP adds as many all-reduces of the shards over R; a tied
table split across stages adds an all-reduce of its gradient between the two stages holding it, per pipeline step.
Mixtures of experts: FLOPs follow the parameters a token computes with (its k routed experts); expert parallelism
moves a block's routed experts to units of their own, gathered and reduced over the d/ep ranks holding them
(ep·t apart), computes them whole on every tp rank, and adds the all-to-all exchanges (:func:`_all_to_all`, exposed
like TP messages). Context parallelism (cp): a rank's blocks compute and move ÷ cp (its positions; attention on
all positions for its heads' share), the head and loss whole; FSDP2 shards over dp × cp; the exchange
(:func:`_context`) is exposed like TP messages. ``offload=True`` adds the host copies (each gather's shard in, each reduced gradient shard out, over
``host_bandwidth``) and runs AdamW on the CPU (``host_memory_bandwidth``). Links: mesh pp × dp_replicate ×
dp_shard × tp (tp innermost); a dimension uses NVLink iff each of its groups lies in one node. Every message also
costs the cluster's ``latency`` α: TP one all-reduce per block, pass and microbatch, PP two messages per
chunk-microbatch, FSDP one collective per unit (each block and the root) and pass. Overlap: TP and PP messages are
exposed; FSDP/HSDP traffic hides behind compute as FSDP2 schedules it (each unit's all-gather prefetched behind the
unit before, each reduce-scatter behind the next backward) and only the excess shows, plus, per accumulation step,
what nothing precedes or follows (the root's and first block's all-gathers, their reduce-scatters and HSDP
all-reduces: :func:`_unprefetched`); with pp > 1 the reduce-scatter/all-reduce follow the last backward (exposed);
with ``overlap_communication=False`` (CPUs) all of it shows.
"""

from __future__ import annotations

from typing import NamedTuple

from lightning_hybrid.planner.kernels import attention_seconds, block_gemms, shape_factor
from lightning_hybrid.planner.step import PipelineRank, StepShape
from lightning_hybrid.planner.traffic import (BACKWARD_PER_FORWARD, accumulation_bytes, block_elementwise_bytes,
                                           float8_cast_bytes, loss_bytes_per_token, optimizer_bytes)


class RankTimes(NamedTuple):
    compute: float  # matmuls and memory-bound kernels
    memory_bound: float  # the memory-bound part of compute
    tensor: float
    pipe: float
    data: float  # all data-parallel traffic
    exposed: float  # the part of it that shows
    optimizer: float
    experts: float = 0.0  # expert parallelism's all-to-all exchanges
    context: float = 0.0  # context parallelism's all-to-all exchanges and gathers


def ring(bytes_moved: float, size: int, bandwidth: float, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather or reduce-scatter ((n−1)/n × bytes) or all-reduce (twice that)."""
    return (2 if all_reduce else 1) * (size - 1) / size * bytes_moved / bandwidth if size > 1 else 0.0


def _compute(step: StepShape, rank: PipelineRank) -> tuple[float, float]:
    """(matmul + memory-bound seconds, memory-bound seconds)."""
    model, cluster, t = step.model, step.cluster, step.layout.tp
    vocab_local = model.vocab / step.vocab_shards
    routed = model.moe_layers * model.experts_per_token * model.expert_parameters / model.layers  # per token
    # the routed experts' FLOPs are split over tp, or (expert parallelism) computed whole on every tp rank
    block_flops = 2 * (model.active_parameters_per_block - routed) / t + 2 * routed / (1 if step.layout.ep > 1 else t)
    passes = 3 * rank.blocks + rank.recomputed_blocks
    cp = step.layout.cp  # a rank's blocks compute its s/cp positions (its heads' share of attention); the head all
    head_flops = rank.last * 3 * 2 * vocab_local * model.hidden
    matmuls = _matmuls(step, rank, passes * block_flops / cp, head_flops)
    if cluster.memory_bandwidth is None:
        return matmuls, 0.0
    repeats = (1 + BACKWARD_PER_FORWARD) * rank.blocks + rank.recomputed_blocks + rank.selective_blocks
    per_token = repeats * block_elementwise_bytes(model, t, step.bytes.compute, step.fused) / cp
    per_token += rank.last * loss_bytes_per_token(vocab_local, step.bytes.compute)
    moved = step.tokens * per_token
    if step.schedule is not None:
        moved += step.all_microbatches * accumulation_bytes(rank.local_parameters(step), step.bytes)
    if model.float8_linears:  # each microbatch's casts to float8, a recomputed forward's again
        rows = step.micro_batch * model.seq_len / cp
        forward, backward = float8_cast_bytes(block_gemms(model, rows, t, step.layout.ep), step.fused)
        moved += step.all_microbatches * (forward * (rank.blocks + rank.recomputed_blocks) + backward * rank.blocks)
    memory_bound = moved / cluster.memory_bandwidth
    return matmuls + memory_bound, memory_bound


def _matmuls(step: StepShape, rank: PipelineRank, block_flops: float, head_flops: float) -> float:
    """Seconds of the rank's GEMMs (``block_flops`` and ``head_flops`` per token, forward and backward) and attention
    cores: from their shapes with the GPU's kernel profile (:mod:`~.kernels`), else all FLOPs at one efficiency."""
    model, cluster, layout = step.model, step.cluster, step.layout
    attention = 4 * model.seq_len * model.hidden / layout.tp * (3 * rank.blocks + rank.recomputed_blocks) / layout.cp
    rate = cluster.peak_flops * cluster.efficiency
    if cluster.streaming_multiprocessors is None:
        return step.tokens * (block_flops + attention + head_flops) / rate
    rows = step.micro_batch * model.seq_len  # one microbatch's tokens (its blocks' rows: ÷ cp)
    blocks = shape_factor(cluster, block_gemms(model, rows / layout.cp, layout.tp, layout.ep), model.float8_linears)
    head = shape_factor(cluster, [(rows, model.vocab / step.vocab_shards, model.hidden, 1, 1)])
    forward, backward = attention_seconds(cluster, model, step.micro_batch, layout.tp, layout.cp)
    cores = step.all_microbatches * (forward * (rank.blocks + rank.recomputed_blocks) + backward * rank.blocks)
    return step.tokens * (block_flops * blocks + head_flops * head) / rate + cores


def _tensor_parallel(step: StepShape, rank: PipelineRank, activation_bytes: float) -> float:
    model, cluster, t = step.model, step.cluster, step.layout.tp
    if t == 1:
        return 0.0
    link, alpha, microbatches = cluster.collective_bandwidth(t, 1), cluster.latency, step.all_microbatches
    all_reduces = 4 * rank.blocks + 2 * rank.recomputed_blocks  # 2 forward (+2 recomputed), 2 backward
    seconds = all_reduces * (ring(activation_bytes / step.layout.cp, t, link, True) + microbatches * alpha)
    if step.vocab_shards > 1:  # the embedding's output and the head's input gradient all-reduced
        seconds += (rank.first + rank.last) * (ring(activation_bytes, t, link, True) + microbatches * alpha)
        if step.layout.loss_parallel:  # the loss's maximum and sum per token over the vocabulary shards
            seconds += rank.last * 2 * (ring(step.tokens * 4, t, link, True) + microbatches * alpha)
        else:  # the logits all-gathered
            logits = step.tokens * model.vocab * step.bytes.compute
            seconds += rank.last * (ring(logits, t, link) + microbatches * alpha)
    return seconds


def _pipeline(step: StepShape, activation_bytes: float) -> float:
    layout, cluster = step.layout, step.cluster
    if layout.pp == 1:
        return 0.0
    link = cluster.link_bandwidth(layout.pp, layout.dp_replicate * layout.dp * layout.cp * layout.tp)
    chunk_microbatches = step.all_microbatches * step.virtual_stages
    return 2 * step.virtual_stages * activation_bytes / link + 2 * chunk_microbatches * cluster.latency


def _all_to_all(step: StepShape, rank: PipelineRank) -> float:
    """Expert parallelism: per MoE block and microbatch, each token's k rows sent to their experts' ranks and the
    results returned, and as much again in backward (a recomputed block repeats its forward's two), of which the
    (ep − 1)/ep share for other ranks crosses the ep group's links (ep ranks tp apart), balanced routing assumed."""
    layout, model, cluster = step.layout, step.model, step.cluster
    if layout.ep == 1 or not model.moe_layers:
        return 0.0
    moe_blocks = rank.blocks * model.moe_layers / model.layers
    exchanges = 4 * moe_blocks + 2 * rank.recomputed_blocks * model.moe_layers / model.layers
    rows = step.tokens * model.experts_per_token * model.hidden * step.bytes.compute
    link = cluster.link_bandwidth(layout.ep, layout.tp)
    return exchanges * (rows * (layout.ep - 1) / layout.ep / link + step.all_microbatches * cluster.latency)


def _context(step: StepShape, rank: PipelineRank) -> float:
    """Context parallelism, per block and microbatch: queries, keys, values and the attention output exchanged
    all-to-all (this rank's positions of its tp heads ↔ all positions of 1/cp of them), forward and backward (a
    recomputed block repeats its forward's four), (cp − 1)/cp of each crossing the cp group's links (ranks tp apart);
    the block's output all-gathered whole and its input's gradient in backward, (cp − 1)/cp × b·s·h each."""
    layout, model, cluster = step.layout, step.model, step.cluster
    cp = layout.cp
    if cp == 1:
        return 0.0
    link, alpha = cluster.link_bandwidth(cp, layout.tp), cluster.latency
    per_token = (2 * model.hidden + 2 * model.kv_heads * (model.hidden // model.heads)) / layout.tp
    exchanged = step.tokens / cp * per_token * step.bytes.compute * (cp - 1) / cp / link
    gathered = ring(step.tokens * model.hidden * step.bytes.compute, cp, cluster.collective_bandwidth(cp, layout.tp))
    passes = 2 * rank.blocks + rank.recomputed_blocks
    return (passes * exchanged + 2 * rank.blocks * gathered
            + (4 * passes + 2 * rank.blocks) * step.all_microbatches * alpha)


def _gathers_and_reductions(step: StepShape, local: float, ranks: int, stride: int, units: int) -> tuple[float, float]:
    """Seconds of FSDP2's all-gathers and reduce-scatters of ``local`` parameters over ``ranks`` ``stride`` apart."""
    layout, sizes, cluster = step.layout, step.bytes, step.cluster
    link, alpha = cluster.collective_bandwidth(ranks, stride), cluster.latency
    syncs = step.microbatches if layout.pp == 1 else step.pipeline_steps  # FSDP2 per accumulation step; pipeline per step
    gather_passes = 2 * step.all_microbatches if layout.zero == 3 else syncs
    gathers = gather_passes * (ring(local * sizes.compute, ranks, link) + (units * alpha if ranks > 1 else 0.0))
    reductions = syncs * (ring(local * sizes.reduce, ranks, link) + (units * alpha if ranks > 1 else 0.0))
    return gathers, reductions


def _data_parallel(step: StepShape, rank: PipelineRank, compute: float) -> tuple[float, float]:
    """(all data-parallel traffic, the exposed part) in seconds."""
    cluster, layout, sizes = step.cluster, step.layout, step.bytes
    d, r, t, p = step.shard_ranks, layout.dp_replicate, layout.tp, layout.pp  # FSDP2 shards over dp × cp
    local, alpha = rank.local_parameters(step), cluster.latency
    syncs = step.microbatches if p == 1 else step.pipeline_steps  # FSDP2 per accumulation step; pipeline per step
    gather_passes = 2 * step.all_microbatches if layout.zero == 3 else syncs
    units = rank.blocks + 1  # FSDP2 communicates per unit: each block, and the root's own parameters
    experts = rank.blocks * step.expert_local_parameters if layout.ep > 1 else 0.0  # their own units, over d/ep
    gathers, reductions = _gathers_and_reductions(step, local - experts, d, t, units)
    if experts:
        more = _gathers_and_reductions(step, experts, step.expert_data_ranks, t * layout.ep, rank.blocks)
        gathers, reductions = gathers + more[0], reductions + more[1]
    replicas = cluster.collective_bandwidth(r, d * t)
    reductions += syncs * (ring(step.sharded(local, rank) * sizes.reduce, r, replicas, True)
                           + (units * alpha if r > 1 else 0.0))
    if step.model.tied_embeddings and p > 1 and (rank.first or rank.last):  # the two copies' gradients summed
        table = min(step.model.vocab * step.model.hidden, step.model.first_stage_parameters) / step.vocab_shards
        table /= d if step.fsdp else 1
        reductions += syncs * (ring(table * sizes.reduce, 2, cluster.collective_bandwidth(p, r * d * t), True) + alpha)
    if layout.offload and cluster.host_bandwidth:  # each gather's shard copied in, each reduced shard out
        gathers += gather_passes * local / d * sizes.parameter / cluster.host_bandwidth
        reductions += syncs * local / d * sizes.reduce / cluster.host_bandwidth
    if not cluster.overlap_communication:
        return gathers + reductions, gathers + reductions
    if p > 1:
        return gathers + reductions, max(0.0, gathers - compute) + reductions
    edges = min(gathers + reductions, _unprefetched(step, rank))
    return gathers + reductions, edges + max(0.0, gathers + reductions - edges - compute)


def _unprefetched(step: StepShape, rank: PipelineRank) -> float:
    """What FSDP2's schedule cannot hide, per accumulation step: it prefetches each unit's all-gather behind the
    unit before and reduce-scatters each block's gradients behind the next block's backward, but the first
    all-gathers (the root unit's, the first block's) come before any compute and the last reduce-scatters (the first
    block's, the root's: the embedding's gradient is the backward's last) after it, and so do HSDP's all-reduces of
    those last shards."""
    d, t, r, sizes, cluster = step.shard_ranks, step.layout.tp, step.layout.dp_replicate, step.bytes, step.cluster
    link = cluster.collective_bandwidth(d, t)
    edge = rank.local_parameters(step) - (rank.blocks - 1) * step.block_local_parameters  # the root and one block
    replicas = ring(edge / d * sizes.reduce, r, cluster.collective_bandwidth(r, d * t), True)
    return step.microbatches * (ring(edge * sizes.compute, d, link) + ring(edge * sizes.reduce, d, link) + replicas)


def _optimizer(step: StepShape, rank: PipelineRank) -> float:
    cluster = step.cluster
    bandwidth = cluster.host_memory_bandwidth if step.layout.offload else cluster.memory_bandwidth
    if bandwidth is None:
        return 0.0
    return optimizer_bytes(step.sharded(rank.local_parameters(step), rank), step.bytes) / bandwidth


def rank_times(step: StepShape, rank: PipelineRank) -> RankTimes:
    # TP and PP move b·s·h per microbatch; summed from the replica's batch directly, so layouts that differ only in
    # m tie exactly (no rounding of m × b) and the tie-break in plan() decides.
    activation_bytes = step.tokens * step.model.hidden * step.bytes.compute
    compute, memory_bound = _compute(step, rank)
    data, exposed = _data_parallel(step, rank, compute)
    return RankTimes(compute, memory_bound, _tensor_parallel(step, rank, activation_bytes),
                     _pipeline(step, activation_bytes), data, exposed, _optimizer(step, rank), _all_to_all(step, rank),
                     _context(step, rank))
