"""Memory per GPU of one pipeline rank of a layout (:func:`rank_memory`).

Model states: parameters + gradients + AdamW moments per the README's dtype table (32-true 4+4+8 B, bf16-mixed
4+4+8 with fp32 master weights, bf16-true and 16-true 2+2+4) × the rank's tp-local parameters ÷ d. Blocks are
tensor-parallel (matrices ÷ t, 1-D norms/biases whole), and so are the token embedding (V·h, first stage) and an
untied head (V·h, last stage) when t divides V (``shard_vocab``, HybridStrategy's default); other embeddings and the
final norm are whole on every tp rank. A tied table split across pipeline stages has a copy on the last stage (both
copies take the optimizer step: pipeline/shared.py). Gradients count at the activation peak (conservative:
Lightning frees them between steps). ``offload=True``: FSDP2 keeps the sharded states in CPU memory
(``MemoryBreakdown.offloaded``, not in the total); the GPU holds what is gathered, the activations and, under a
pipeline, the unsharded gradients.

Gathered parameters, compute dtype, as FSDP2's peak was measured (BENCHMARKS.md, Planner): ZeRO-3 three blocks
plus the root unit (a prefetched block's all-gather output and its copied-out parameters exist together), ZeRO-2
the stage and two blocks' all-gather buffers; none without FSDP2, which HybridStrategy leaves out on one
data-parallel rank (d·R = 1) except for bf16-mixed (its casting policy) and offload. With pp > 1 torch's pipeline
keeps parameters gathered after a backward and accumulates *unsharded* gradients (reduce dtype: fp32, or bf16 with
``reduce_dtype="bf16"``) until the last microbatch: both ZeRO levels hold the whole stage gathered, and its full
gradients instead of the sharded ones (and, under FSDP2, the sharded ones as well when ``accumulate`` > 1 adds to
them between pipeline steps). With p = 1 FSDP2 reduce-scatters each accumulation step and adds the result to the sharded
gradients: no unsharded copy.

Mixtures of experts: the dense parameters shard over d, each rank's routed experts (E/ep of them under expert
parallelism, whole over tp) over the d/ep ranks holding them; FSDP2 gathers a block's local experts only; a token's
activations span its k routed (and the shared) experts' widths, plus its k rows as dispatched and as returned.

Context parallelism (cp): each rank's blocks hold ``s / cp`` positions (attention's tensors, in the exchanged head
layout, as many elements: ÷ cp too), plus one block output gathered whole; the embedding's output, the logits and
the loss stay whole on every rank; FSDP2 shards over dp × cp.

Activations per block and microbatch: Korthikanti et al. 2022, Table 2, per tensor (so GQA, ``ffn_hidden``, gated
MLPs fit): with kv_heads = a, ffn = 4h, dropout and materialized scores at 16 bits exactly their
s·b·h·(10 + 24/t + 5·a·s/(h·t)), 34 + 5·a·s/h at t = 1 (no sequence parallelism). Defaults: no dropout masks
(dropout 0, as in LLM pretraining) and flash SDPA (no a·s² scores; a 4-byte logsumexp per head and token); fp32
doubles tensors, not 1-byte masks. Checkpointed blocks (``"every"``, or every N-th): s·b·h per block, and one
block's working set for the recompute. ``"selective"``: what the policy keeps (:func:`selective_layer_bytes`), and
one block's recomputed rest. Chunk-microbatches held on rank r: one with p = 1 (accumulation steps run in turn),
GPipe m, 1F1B min(m, p − r), interleaved min(m·v, (v−1)·p + 2·(p−1−r) + 1) (torch's warm-up). Receive
buffers (b·s·h each, independent of m): the pipeline runtime allocates a buffer when its message is about to be
received and releases it after use, as Megatron does. An activation buffer is the stage's input, which the
per-block count above already holds for every microbatch in flight: only one more, posted ahead of its forward, on
a rank with a stage that receives activations (all but the first); gradients live from arrival to the end of their
chunk's backward: two (one consumed, one posted ahead) on a rank with a stage that receives them (all but the
last). Last stage: logits b·s·V and the loss's log-softmax per microbatch held (GPipe m, else 1), ÷ t with
``loss_parallel``. A layout fits if its total is at most ``usable_memory_fraction`` of the GPU.
"""

from __future__ import annotations

from lightning_hybrid.planner.layout import MemoryBreakdown
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.step import PipelineRank, StepShape


def layer_activation_bytes(model: ModelShape, micro_batch: float, tp: int, element_bytes: int) -> float:
    """Bytes one block saves for backward per microbatch (Korthikanti et al. 2022, Table 2, per tensor)."""
    s, h, a = model.seq_len, model.hidden, model.heads
    # q, k, v, attention output, MLP intermediates (fc, activation; gated: gate, up, activation, product)
    sharded = h + 2 * model.kv_heads * (h // a) + h + (4 if model.gated_mlp else 2) * model.active_ffn_hidden
    per_token = (4 * h + sharded / tp) * element_bytes  # + both norm inputs, attention and MLP inputs (whole)
    per_token += _dispatched_rows(model) * element_bytes
    per_token += 4 * a / tp if model.flash_attention else a * s / tp * element_bytes  # logsumexp / softmax
    if model.dropout:  # 1-byte masks after attention and MLP (+ on the probabilities, and their dropped copy)
        per_token += 2 * h + (0 if model.flash_attention else a * s / tp * (1 + element_bytes))
    return s * micro_batch * per_token


def selective_layer_bytes(model: ModelShape, micro_batch: float, tp: int, element_bytes: int) -> float:
    """Bytes one block keeps per microbatch under ``activation_checkpointing="selective"``: the block's input (the
    checkpoint's) and the outputs of the operations its policy saves (parallel/activation_checkpointing.py) —
    matmuls (q, k, v; the MLP's up projection(s); the attention and MLP output projections, whole over tp as partial
    sums), the attention kernel (its output and logsumexp; materialized: the scores) and, with tp > 1, the two
    all-reduces' outputs. Norm and activation outputs and dropout masks are recomputed."""
    s, h, a = model.seq_len, model.hidden, model.heads
    sharded = h + 2 * model.kv_heads * (h // a) + h + (2 if model.gated_mlp else 1) * model.active_ffn_hidden
    whole = 3 * h + (2 * h if tp > 1 else 0) + _dispatched_rows(model)
    per_token = (whole + sharded / tp) * element_bytes
    per_token += 4 * a / tp if model.flash_attention else a * s / tp * element_bytes
    return s * micro_batch * per_token


def _dispatched_rows(model: ModelShape) -> float:
    """Elements per token an MoE block keeps for backward beyond a dense MLP's, averaged over the blocks: each
    token's k rows as sent to their experts and as returned (whoever computes them)."""
    return 2 * model.experts_per_token * model.hidden * model.moe_layers / model.layers


def _activations(step: StepShape, rank: PipelineRank) -> float:
    """Activations the rank holds at its peak, receive buffers excluded."""
    args = (step.model, step.micro_batch, step.layout.tp, step.bytes.compute)
    full = layer_activation_bytes(*args)
    selective = selective_layer_bytes(*args)
    stored = rank.blocks - rank.recomputed_blocks - rank.selective_blocks
    cp = step.layout.cp  # each rank's blocks hold their part of the sequence
    per_microbatch = (stored * full + rank.recomputed_blocks * step.residual_bytes
                      + rank.selective_blocks * selective) / cp
    activations = rank.in_flight * per_microbatch / step.virtual_stages  # per chunk-microbatch
    if rank.recomputed_blocks:
        activations += full / cp  # the block being recomputed
    elif rank.selective_blocks:
        activations += (full - selective) / cp  # its recomputed rest
    return activations + (step.residual_bytes if cp > 1 else 0.0)  # a block's output, gathered whole


def rank_memory(step: StepShape, rank: PipelineRank) -> MemoryBreakdown:
    local = rank.local_parameters(step)
    sharded = step.sharded(local, rank)
    if step.schedule is not None:
        gathered_blocks = rank.blocks
    else:  # FSDP2's peak, measured: 3 blocks at ZeRO-3; the stage and 2 more blocks' buffers at ZeRO-2
        gathered_blocks = min(3, rank.blocks) if step.layout.zero == 3 else rank.blocks + min(2, rank.blocks)
    gathered = local - (rank.blocks - gathered_blocks) * step.block_local_parameters if step.fsdp else 0.0
    buffers = rank.receive_buffers * step.residual_bytes
    held_losses = step.microbatches if step.schedule and step.schedule.name == "gpipe" else 1
    logits = (held_losses + 1) * step.micro_batch * step.model.seq_len * step.model.vocab * step.bytes.compute
    if step.layout.loss_parallel:
        logits /= step.vocab_shards  # the logits stay sharded over the vocabulary
    # Under a pipeline FSDP2's sharded gradients exist beside the unsharded ones once accumulation adds to them.
    keeps_sharded = step.schedule is None or (step.pipeline_steps > 1 and step.fsdp)
    states = {"parameters": sharded * step.bytes.parameter, "optimizer_state": sharded * step.bytes.optimizer,
              "gradients": sharded * step.bytes.gradient if keeps_sharded else 0.0}
    unsharded_gradients = local * step.bytes.reduce if step.schedule is not None else 0.0
    offloaded = sum(states.values()) if step.layout.offload else 0.0
    if step.layout.offload:
        states = dict.fromkeys(states, 0.0)
    return MemoryBreakdown(
        stage=rank.stage, parameters=states["parameters"], gradients=states["gradients"] + unsharded_gradients,
        optimizer_state=states["optimizer_state"], gathered_parameters=gathered * step.bytes.compute,
        activations=_activations(step, rank) + buffers, logits=logits if rank.last else 0.0,
        receive_buffers=buffers, offloaded=offloaded)
