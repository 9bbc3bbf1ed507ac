"""The cost model against hand computations for each HybridStrategy feature it prices: tied tables across pipeline
stages, the sharded vocabulary and ``loss_parallel``, ``compile=True``, ``reduce_dtype="bf16"``, selective and
every-N checkpointing, CPU offload, gradient accumulation on top of a pipeline, middle pipeline stages and their
receive buffers, and the memory-bound kernels timed at the GPU's memory bandwidth."""

from __future__ import annotations

from dataclasses import replace

import pytest

from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.planner.cost import estimate, stage_memory
from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.layout import Layout
from lightning_hybrid.planner.memory import selective_layer_bytes
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.step import describe_step, pipeline_ranks
from lightning_hybrid.planner.traffic import block_elementwise_bytes
from tests.planner.test_planner import TINY, TINY_LAYER_PER_SEQUENCE, TINY_TOTAL, two_gpus

#: 4 blocks of TINY's (49,280 parameters each): 106,752 FLOPs per token and block forward (2·49,280 + 4·32·64), the
#: head 2·128·64 = 16,384.
FOUR_LAYERS = ModelShape(layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
BLOCK, BLOCK_FLOPS, HEAD_FLOPS = 49_280, 106_752, 16_384


def gpus(count: int, **fields: float) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=count, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=1e9, **fields)


# ------------------------------------------------------------------------------------------------- tied tables
def test_a_tied_table_split_across_stages_is_copied_and_its_gradient_summed() -> None:
    tied = ModelShape(layers=4, hidden=64, heads=4, vocab=128, seq_len=32, tied_embeddings=True)
    layout = Layout(pp=2, microbatches=4)
    result = estimate(tied, two_gpus(), layout, 8, "32-true")
    assert result.feasible
    ranks = stage_memory(tied, two_gpus(), layout, 8, "32-true")
    # First stage: 2 blocks + the table 128·64; last: 2 blocks + final norm 64 + its copy of the table (an untied
    # head is as large). fp32, one data-parallel rank: 4 B per parameter.
    assert ranks["first"].parameters == 4 * (2 * BLOCK + 8192)
    assert ranks["last"].parameters == 4 * (2 * BLOCK + 64 + 8192)
    # After the backward the two copies' gradients are all-reduced between the two stages: a ring of 2 moves
    # 2 · (1/2) · 8192 · 4 B = 32,768 B at 1 GB/s, exposed; nothing else is data-parallel here.
    assert result.time.data_parallel == result.time.data_parallel_exposed == pytest.approx(32_768 / 1e9)


# --------------------------------------------------------------------------------------- vocabulary, loss
def test_loss_parallel_keeps_the_logits_sharded() -> None:
    plain = estimate(TINY, two_gpus(), Layout(tp=2), 8, "32-true")
    sharded = estimate(TINY, two_gpus(), Layout(tp=2, loss_parallel=True), 8, "32-true")
    # Logits and log-softmax of 8 · 32 tokens × 128, fp32: 262,144 B whole, half on each of 2 tp ranks.
    assert (plain.memory.logits, sharded.memory.logits) == (262_144, 131_072)
    # 256 tokens: no all-gather of the logits ((1/2) · 256 · 128 · 4 B = 65,536 B), two all-reduces of one fp32
    # value per token instead (2 · 2 · (1/2) · 1024 B = 2048 B), at 1 GB/s.
    assert sharded.time.tensor_parallel - plain.time.tensor_parallel == pytest.approx((2048 - 65_536) / 1e9)
    assert "needs the head sharded" in estimate(TINY, two_gpus(), Layout(dp=2, loss_parallel=True), 8).reasons[0]
    pipelined = estimate(FOUR_LAYERS, gpus(4), Layout(tp=2, pp=2, loss_parallel=True), 8)
    assert "loss_parallel=True does not run with pp > 1" in pipelined.reasons


# ----------------------------------------------------------------------------- memory-bound kernels, compile
GATED_DROPOUT = ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq_len=32, ffn_hidden=256, gated_mlp=True,
                           dropout=True)


def test_elementwise_bytes_per_block_and_token_by_hand() -> None:
    # TINY, fp32: norms 2 · 2 · 64 · 4 = 1024, residual adds 2 · 3 · 64 · 4 = 1536, GeLU 2 · 256 · 4 = 2048.
    assert block_elementwise_bytes(TINY, 1, 4, fused=False) == block_elementwise_bytes(TINY, 1, 4, True) == 4608
    # SwiGLU and dropout, bf16: norms 512; adds 768 and masks 2 · 64; eager dropout also reads and writes its
    # tensor (2 · 2 · 64 · 2 = 512); SwiGLU eager 5 · 256 · 2 = 2560, fused 3 · 256 · 2 = 1536.
    assert block_elementwise_bytes(GATED_DROPOUT, 1, 2, fused=False) == 512 + 768 + 128 + 512 + 2560 == 4480
    assert block_elementwise_bytes(GATED_DROPOUT, 1, 2, fused=True) == 512 + 768 + 128 + 1536 == 2944
    # Materialized scores, a·s = 128 per token: written and read by the two matmuls, softmax fused 2 passes (eager
    # 6), dropout 2 passes and a mask byte: fused 128 · (6 · 2 + 1), eager 128 · (10 · 2 + 1).
    scores = replace(TINY, flash_attention=False, dropout=True)
    assert block_elementwise_bytes(scores, 1, 2, True) - block_elementwise_bytes(replace(scores, flash_attention=True),
                                                                                 1, 2, True) == 128 * 13
    assert block_elementwise_bytes(scores, 1, 2, False) - block_elementwise_bytes(replace(scores, flash_attention=True),
                                                                                  1, 2, False) == 128 * 21


def test_memory_bound_kernels_cost_their_bytes_at_the_memory_bandwidth_and_compile_fuses_them() -> None:
    one = gpus(1, memory_bandwidth=1e9)
    eager = estimate(GATED_DROPOUT, one, Layout(), 4, "32-true").time
    compiled = estimate(GATED_DROPOUT, one, Layout(compile=True), 4, "32-true").time
    # fp32 per block and token: eager 1024 + 1536 + 2 · (64 + 512) + 5 · 256 · 4 = 8832, fused 1024 + 1536 + 128 +
    # 3 · 256 · 4 = 5760; forward + 1.5 × backward of 2 blocks; the loss 128 · (2 · 4 + 24) = 4096 per token; 128
    # tokens at 1 GB/s.
    assert eager.memory_bound == pytest.approx(128 * (2.5 * 2 * 8832 + 4096) / 1e9)
    assert compiled.memory_bound == pytest.approx(128 * (2.5 * 2 * 5760 + 4096) / 1e9)
    assert eager.compute - eager.memory_bound == compiled.compute - compiled.memory_bound  # matmuls unchanged
    # AdamW over 2 · 65,664 + 8192 + 8256 = 147,776 fp32 parameters: reads 4 + 4 + 8, writes 4 + 8 bytes each.
    assert eager.optimizer == pytest.approx(147_776 * 28 / 1e9)
    assert eager.step == pytest.approx(eager.compute + eager.optimizer)
    refused = estimate(TINY, gpus(4), Layout(dp=2, tp=2, compile=True, activation_checkpointing="every"), 8)
    assert any("compile=True with activation checkpointing" in reason for reason in refused.reasons)


# ------------------------------------------------------------------------------------------- reduce dtype
def test_bf16_gradient_reduction_halves_the_reduce_scatter_and_the_pipelines_gradients() -> None:
    fp32, bf16 = (estimate(TINY, two_gpus(), Layout(dp=2, zero=2, reduce_dtype=dtype), 8, "bf16-mixed").time
                  for dtype in (None, "bf16"))
    # ZeRO-2, one step: an all-gather of the bf16 parameters, (1/2) · 2 B · 115,008, and a reduce-scatter of the
    # gradients, (1/2) · 4 B (fp32) or 2 B (bf16) · 115,008, at 1 GB/s.
    assert fp32.data_parallel == pytest.approx((1 + 2) * TINY_TOTAL / 1e9)
    assert bf16.data_parallel == pytest.approx((1 + 1) * TINY_TOTAL / 1e9)
    # Under a pipeline FSDP2 accumulates the stage's unsharded gradients in its reduce dtype: 4 B → 2 B.
    pipelined = [estimate(FOUR_LAYERS, two_gpus(), Layout(pp=2, microbatches=2, reduce_dtype=dtype), 8,
                          "bf16-mixed").memory for dtype in ("fp32", "bf16")]
    assert pipelined[0].gradients == 2 * pipelined[1].gradients


# ------------------------------------------------------------------------------------------- checkpointing
def test_selective_checkpointing_keeps_matmul_attention_and_collective_outputs() -> None:
    # TINY, fp32, per token: block input, attention and MLP output projections 3 · 64 whole, + q 64, k and v 128,
    # attention output 64, MLP up 256 sharded = 704 elements · 4 B + logsumexp 4 B · 4 heads = 2832 (full: 4112).
    assert selective_layer_bytes(TINY, 1, 1, 4) == 32 * 2832
    # tp=2 adds the two all-reduces' outputs (2 · 64 whole) and halves the sharded 512: (320 + 256) · 4 + 8.
    assert selective_layer_bytes(TINY, 1, 2, 4) == 32 * 2312
    result = estimate(TINY, gpus(1, memory_bandwidth=1e9), Layout(activation_checkpointing="selective"), 4,
                      "32-true")
    # 2 blocks keep 4 sequences each; the block in backward rematerializes its rest (4112 − 2832 per token).
    assert result.memory.activations == 2 * 4 * 32 * 2832 + 4 * 32 * (4112 - 2832)
    plain = estimate(TINY, gpus(1, memory_bandwidth=1e9), Layout(), 4, "32-true").time
    assert result.time.compute - result.time.memory_bound == plain.compute - plain.memory_bound  # no matmul again
    # The element-wise kernels run a third time (4608 B per block and token): 128 tokens · 2 blocks · 4608 B more.
    assert result.time.memory_bound - plain.memory_bound == pytest.approx(128 * 2 * 4608 / 1e9)
    tp = [estimate(TINY, two_gpus(), Layout(tp=2, activation_checkpointing=mode), 8, "32-true").time.tensor_parallel
          for mode in (None, "selective")]
    assert tp[0] == tp[1]  # the collectives' outputs are kept: no all-reduce is repeated


def test_every_nth_block_checkpointing() -> None:
    result = estimate(FOUR_LAYERS, gpus(1), Layout(activation_checkpointing=2), 4, "32-true")
    # Blocks 1 and 3 (0-based) are checkpointed: 2 blocks keep everything, 2 their input (4 · 32 · 64 · 4 B), and
    # one block's working set is rebuilt in backward; 2 of 4 forwards run again, not the head's.
    full, block_input = 4 * TINY_LAYER_PER_SEQUENCE, 4 * 32 * 64 * 4
    assert result.memory.activations == 2 * full + 2 * block_input + full
    assert result.time.compute == pytest.approx(128 * ((3 * 4 + 2) * BLOCK_FLOPS + 3 * HEAD_FLOPS) / 0.5e12)
    # Counted over the whole model: with pp=2 and N=3 the first stage (blocks 0, 1) has none, the last (2, 3) one.
    layout = Layout(pp=2, microbatches=2, activation_checkpointing=3)
    schedule = PipelineSchedule.resolve("1f1b", 2, microbatches=2)
    step = describe_step(FOUR_LAYERS, two_gpus(), layout, schedule, "32-true", 4)
    assert [rank.recomputed_blocks for rank in pipeline_ranks(step)] == [0, 1]


# ------------------------------------------------------------------------------------------------- offload
def test_cpu_offload_moves_the_states_to_the_host_and_times_the_copies_and_the_cpu_optimizer() -> None:
    cluster = replace(two_gpus(), host_bandwidth=1e9, host_memory_bandwidth=2e9)
    on_gpu = estimate(TINY, cluster, Layout(dp=2), 8, "32-true")
    offloaded = estimate(TINY, cluster, Layout(dp=2, offload=True), 8, "32-true")
    assert offloaded.memory.model_states == 0 and offloaded.memory.offloaded == 16 * TINY_TOTAL / 2
    assert offloaded.memory.gathered_parameters == on_gpu.memory.gathered_parameters
    # ZeRO-3, one microbatch: 2 all-gathers and a reduce-scatter of (1/2) · 4 B · 115,008 each at 1 GB/s, and
    # with offload each also copies a shard of 4 B · 57,504 over the host link.
    assert on_gpu.time.data_parallel == pytest.approx(3 * 2 * TINY_TOTAL / 1e9)
    assert offloaded.time.data_parallel == pytest.approx(3 * 4 * TINY_TOTAL / 1e9)
    # AdamW on the CPU over the rank's 57,504 parameters: 28 B each at 2 GB/s.
    assert offloaded.time.optimizer == pytest.approx(TINY_TOTAL / 2 * 28 / 2e9)


# ---------------------------------------------------------------------------- accumulation with a pipeline
def test_accumulation_on_top_of_a_pipeline_repeats_its_step_and_bubble() -> None:
    once = estimate(FOUR_LAYERS, two_gpus(), Layout(pp=2, microbatches=4), 8, "32-true")
    twice = estimate(FOUR_LAYERS, two_gpus(), Layout(pp=2, microbatches=4, accumulate=2), 16, "32-true")
    assert str(twice.layout) == "dp1 tp1 pp2 acc2 1f1b m4 z3"
    # Each of the 2 accumulated batches is a pipeline step of 4 microbatches of 2 sequences: activations as one,
    # time twice (its bubble too: 1/(4 + 1) of each).
    assert twice.memory.activations == once.memory.activations
    assert twice.time.step == pytest.approx(2 * once.time.step)
    deeper = estimate(FOUR_LAYERS, two_gpus(), Layout(pp=2, microbatches=8), 16, "32-true")
    assert twice.time.step / deeper.time.step == pytest.approx((5 / 4) / (9 / 8))  # the bubble of 8 microbatches
    assert estimate(FOUR_LAYERS, two_gpus(), Layout(pp=2, microbatches=4, accumulate=2), 12).reasons == (
        "global batch 12 is not divisible by dp × dp_replicate × microbatches × accumulate = 8",)
    # With FSDP2 the sharded gradients the accumulation adds to exist beside the stage's unsharded ones.
    sharded = estimate(FOUR_LAYERS, gpus(4), Layout(dp=2, pp=2, microbatches=4, accumulate=2), 32, "32-true")
    local = 2 * BLOCK + 8192  # the first stage
    assert sharded.memory.stage == "first" and sharded.memory.gradients == 4 * local + 4 * local / 2


# ------------------------------------------------------------------------------- middle stages, receive buffers
def test_a_middle_stage_receives_both_ways_and_holds_the_most_buffers() -> None:
    eight = ModelShape(layers=8, hidden=64, heads=4, vocab=128, seq_len=32)
    layout = Layout(pp=4, microbatches=32, activation_checkpointing="every")
    ranks = stage_memory(eight, gpus(4), layout, 64, "32-true")
    residual = 2 * 32 * 64 * 4  # b = 2 sequences per microbatch
    # Buffers live from arrival to use, whatever m: two gradients on the first stage (one consumed, one posted
    # ahead), one activation posted ahead of its forward on the last, both in the middle.
    assert [ranks[stage].receive_buffers for stage in ("first", "middle", "last")] == [
        2 * residual, 3 * residual, residual]
    # Middle (pipeline rank 1): 1F1B holds 3 microbatches of its 2 blocks' inputs and one block's working set.
    assert ranks["middle"].activations == 3 * 2 * residual + 2 * TINY_LAYER_PER_SEQUENCE + 3 * residual
    assert ranks["middle"].total == 16 * 2 * BLOCK + ranks["middle"].activations == 1_987_584
    # The first stage holds one microbatch more (4) and the embedding: with m-independent buffers it is the fullest.
    assert ranks["first"].activations == 4 * 2 * residual + 2 * TINY_LAYER_PER_SEQUENCE + 2 * residual
    result = estimate(eight, gpus(4), layout, 64, "32-true")
    assert result.memory.stage == "first" and result.memory.total == ranks["first"].total == 2_135_040
