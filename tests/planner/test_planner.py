"""The layout planner (``lightning_hybrid.planner``) and ``lightning-hybrid plan``: every expected number below is
worked out by hand in the test (or taken from a paper), not read back from the planner."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import pytest
import torch

from lightning_hybrid.cli import main
from lightning_hybrid.planner.cost import describe_size, estimate, layer_activation_bytes
from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.layout import Layout
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.search import plan
from recipes.gpt import GPTConfig, GPTLightning
from tests.models import build_module

#: 2 blocks of width 64, 4 heads, ffn 256, vocabulary 128, sequence 32. Per block: q, o 64·64 each; k, v
#: 64·64 each; MLP 2·64·256; two norms of 64 → 8192 + 8192 + 32768 + 128 = 49,280. Embedding 128·64 = 8192;
#: final norm 64 + head 8192 = 8256. Total 2·49,280 + 8192 + 8256 = 115,008.
TINY = ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq_len=32)
TINY_BLOCK, TINY_TOTAL = 49_280, 115_008
#: Activations of one TINY block per sequence, fp32, flash attention, no dropout: per token (4·64 whole + (64 q +
#: 128 k,v + 64 attention output + 2·256 MLP) sharded) · 4 B + 4 B · 4 heads (logsumexp) = 4112 B; × 32 tokens.
TINY_LAYER_PER_SEQUENCE = 32 * 4112


def one_gpu(memory: float = GIB) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=1, memory_bytes=memory, peak_flops=1e12, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=1e9)


def two_nodes_of_four(memory: float = 80 * GIB) -> Cluster:
    return Cluster(nodes=2, gpus_per_node=4, memory_bytes=memory, peak_flops=100e12, intra_node_bandwidth=100e9,
                   inter_node_bandwidth=10e9)


# ------------------------------------------------------------------------------------------ parameter counts
def test_parameter_counts_from_dimensions() -> None:
    assert (TINY.parameters_per_block, TINY.whole_parameters_per_block) == (TINY_BLOCK, 128)
    assert (TINY.first_stage_parameters, TINY.last_stage_parameters, TINY.total_parameters) == (8192, 8256, TINY_TOTAL)
    # Llama 2 7B: attention 4·4096² = 67,108,864; SwiGLU 3·4096·11008 = 135,266,304; norms 8192 → 202,383,360 per
    # block; 32 blocks + embedding and head 2·32000·4096 + final norm 4096: its published 6,738,415,616.
    llama = ModelShape(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    assert llama.parameters_per_block == 202_383_360 and llama.total_parameters == 6_738_415_616
    # GQA with 8 kv heads (k and v 4096·1024 each instead of 4096²) and tied embeddings (no head matrix).
    gqa = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=11008, gated_mlp=True, vocab=32000,
                     seq_len=4096, tied_embeddings=True)
    assert gqa.parameters_per_block == 202_383_360 - 2 * 4096 * (4096 - 1024)
    assert gqa.last_stage_parameters == 4096


def test_parameter_count_alone_follows_gpt3_aspect_ratio() -> None:
    # 32 layers → hidden 128·32 = 4096, 32 heads of 128: 32·(12·4096² + 2·4096) + 2·32000·4096 + 4096.
    # Neighbours are further from 7e9: 28 layers (hidden 3584 → 4096) 5.9e9, 36 layers (hidden 4608 → 5120) 11.6e9.
    shape = ModelShape.from_parameter_count(7e9, seq_len=2048)
    assert (shape.layers, shape.hidden, shape.heads, shape.ffn_hidden) == (32, 4096, 32, 16384)
    assert shape.total_parameters == 32 * (12 * 4096**2 + 2 * 4096) + 2 * 32000 * 4096 + 4096 == 6_704_861_184


def test_from_module_counts_the_recipe_gpt_exactly() -> None:
    config = {"vocab_size": 64, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
    shape = ModelShape.from_module("recipes.gpt:GPTLightning", {"config": config}, seq_len=64, heads=4)
    # Per block: ln_1 256, c_attn 128·384 + 384, attn.c_proj 128·128 + 128, ln_2 256, c_fc 128·512 + 512,
    # mlp.c_proj 512·128 + 128 = 198,272, of which 1-D (norms, biases) 256 + 384 + 128 + 256 + 512 + 128 = 1664.
    # Embeddings wte + wpe 2·64·128 = 16,384; ln_f 256 + lm_head 64·128 = 8448. Total 4·198,272 + 24,832.
    assert (shape.parameters_per_block, shape.whole_parameters_per_block) == (198_272, 1664)
    assert (shape.first_stage_parameters, shape.last_stage_parameters) == (16_384, 8448)
    real = GPTLightning(GPTConfig(**config))
    assert shape.total_parameters == 817_920 == sum(p.numel() for p in real.parameters())
    assert (shape.layers, shape.hidden, shape.vocab, shape.ffn_hidden, shape.gated_mlp) == (4, 128, 64, 512, False)
    assert (shape.kv_heads, shape.tied_embeddings) == (4, False)


def test_from_module_reads_gqa_and_swiglu_and_runs_configure_model() -> None:
    # TinyLlama (built in configure_model with init="meta"): width 32, 4 heads, 2 kv heads, SwiGLU 64, 2 layers.
    # Per block: 2 norms 64, wq and wo 32·32 each, wk and wv 32·16 each, w1, w2, w3 32·64 each = 9280.
    shape = ModelShape.from_module("tests.models:LMLightningModule", {"model": "llama", "init": "meta"},
                                   seq_len=16, heads=4)
    assert (shape.kv_heads, shape.ffn_hidden, shape.gated_mlp, shape.hidden) == (2, 64, True, 32)
    assert shape.parameters_per_block == 9280
    real = build_module("llama")
    assert shape.total_parameters == 2 * 9280 + 2048 + 32 + 2048 == sum(p.numel() for p in real.parameters())


def test_from_module_says_which_arguments_to_pass() -> None:
    with pytest.raises(ValueError, match=r"heads= \(CLI --heads\)"):
        ModelShape.from_module("recipes.gpt:GPTLightning", seq_len=64)
    with pytest.raises(ValueError, match=r"seq_len= \(CLI --seq-len\) and heads= \(CLI --heads\)"):
        ModelShape.from_module("recipes.gpt:GPTLightning")
    with pytest.raises(ValueError, match="package.module:ClassName"):
        ModelShape.from_module("recipes.gpt.GPTLightning", seq_len=64, heads=4)


# ---------------------------------------------------------------------------------------------------- memory
def test_model_states_match_the_zero_paper_table_1() -> None:
    """Rajbhandari et al. 2020, Table 1: 7.5B parameters, 64 GPUs, K = 12 (mixed-precision Adam)."""
    model = ModelShape(layers=30, hidden=4096, heads=32, vocab=32000, seq_len=1024, parameters_per_block=250_000_000,
                       first_stage_parameters=0, last_stage_parameters=0)
    assert model.total_parameters == 7_500_000_000
    cluster = Cluster.preset("a100-80gb", nodes=8)
    unsharded = estimate(model, cluster, Layout(dp=1, dp_replicate=64), 64).memory
    sharded = estimate(model, cluster, Layout(dp=64, zero=3), 64).memory
    zero2 = estimate(model, cluster, Layout(dp=64, zero=2), 64).memory
    assert unsharded.model_states / 1e9 == pytest.approx(120, rel=0.01)  # baseline 120 GB
    assert sharded.model_states / 1e9 == pytest.approx(1.88, rel=0.01)  # P_os+g+p 1.88 GB
    # FSDP2's ZeRO-2 keeps 16 B/param sharded plus the whole model gathered in bf16 (2 B/param): next to the
    # paper's P_os+g (2 B unsharded fp16 parameters + 14 B sharded) 16.6 GB. (ZeRO-1, P_os, is not offered.) The
    # paper counts no transient buffers; FSDP2's two blocks of all-gather buffers at its measured peak are left out.
    buffers = 2 * 250_000_000 * 2
    assert (zero2.model_states + zero2.gathered_parameters - buffers) / 1e9 == pytest.approx(16.6, rel=0.03)


def test_activation_formula_is_megatrons_with_dropout_and_materialized_attention() -> None:
    s, b, h, a = 512, 2, 256, 8
    megatron = ModelShape(layers=1, hidden=h, heads=a, vocab=100, seq_len=s, dropout=True, flash_attention=False)
    # Korthikanti et al. 2022: s·b·h·(34 + 5·a·s/h) bytes at 16 bits; with TP: s·b·h·(10 + 24/t + 5·a·s/(h·t))
    assert layer_activation_bytes(megatron, b, 1, 2) == s * b * h * (34 + 5 * a * s / h) == 29_884_416
    assert layer_activation_bytes(megatron, b, 4, 2) == s * b * h * (10 + 24 / 4 + 5 * a * s / (h * 4)) == 9_437_184
    # fp32: the tensors double, the 1-byte masks (2h + a·s per token) do not: 2·(32h + 4as) + 2h + as.
    assert layer_activation_bytes(megatron, b, 1, 4) == s * b * (66 * h + 9 * a * s)
    # Default: no dropout masks, flash attention (no a·s scores; a 4-byte logsumexp per head): 32h + 4a per token.
    plain = ModelShape(layers=1, hidden=h, heads=a, vocab=100, seq_len=s)
    assert layer_activation_bytes(plain, b, 1, 2) == s * b * (32 * h + 4 * a)


def test_single_gpu_breakdown_by_hand() -> None:
    result = estimate(TINY, one_gpu(), Layout(), global_batch=4, precision="32-true")
    memory = result.memory
    assert (memory.parameters, memory.gradients) == (4 * TINY_TOTAL, 4 * TINY_TOTAL)
    assert memory.optimizer_state == 8 * TINY_TOTAL
    assert memory.gathered_parameters == 0  # one data-parallel rank in fp32: HybridStrategy applies no FSDP2
    assert memory.activations == 2 * 4 * TINY_LAYER_PER_SEQUENCE
    assert memory.logits == 2 * 4 * 32 * 128 * 4  # logits + saved log-softmax, b·s·V fp32 each
    assert memory.total == 3_023_872
    # bf16-mixed keeps FSDP2 (its casting policy): ZeRO-3 gathers two blocks (here all) and the root, in bf16.
    mixed = estimate(TINY, one_gpu(), Layout(), global_batch=4, precision="bf16-mixed").memory
    assert mixed.gathered_parameters == 2 * TINY_TOTAL
    # Forward FLOPs per token: 2 blocks · (2·49,280 + 4·32·64) + head 2·128·64 = 229,888; × 3 × 128 tokens at
    # 0.5 of 1 TFLOP/s. Nothing else costs time on one GPU, so MFU is the efficiency.
    assert result.time.step == pytest.approx(3 * 128 * 229_888 / 0.5e12)
    assert result.mfu == pytest.approx(0.5)
    assert result.tokens_per_second == pytest.approx(128 / result.time.step)
    assert result.feasible


def test_activation_checkpointing_keeps_block_inputs_and_one_block() -> None:
    result = estimate(TINY, one_gpu(), Layout(activation_checkpointing="every"), global_batch=4, precision="32-true")
    assert result.memory.activations == 2 * 4 * 32 * 64 * 4 + 4 * TINY_LAYER_PER_SEQUENCE  # 2 inputs b·s·h + 1 block
    # One more forward of the blocks (2 · (2·49,280 + 4·32·64) = 213,504 FLOPs per token), not of the head (2·128·64
    # = 16,384): HybridStrategy checkpoints blocks. 128 tokens at 0.5 of 1 TFLOP/s.
    assert result.time.compute == pytest.approx(128 * (4 * 213_504 + 3 * 16_384) / 0.5e12)


def test_pipeline_stages_hold_the_microbatches_of_their_schedule() -> None:
    four_layers = ModelShape(layers=4, hidden=64, heads=4, vocab=128, seq_len=32)
    two = Cluster(nodes=1, gpus_per_node=2, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9,
                  inter_node_bandwidth=1e9)
    layer = 2 * TINY_LAYER_PER_SEQUENCE  # 8 sequences in 4 microbatches of 2
    residual = 2 * 32 * 64 * 4  # one b·s·h tensor of a microbatch of 2
    one_f_one_b = estimate(four_layers, two, Layout(pp=2, microbatches=4), 8, "32-true").memory
    # 1F1B: stage 0 holds min(m, p) = 2 microbatches of its 2 blocks; stage 1 one. Stage 0 is fuller; it receives
    # gradients, two buffers of them at a time (one consumed, one posted ahead).
    assert one_f_one_b.stage == "first" and one_f_one_b.activations == 2 * 2 * layer + 2 * residual
    # The stage's unsharded fp32 gradients: 2 blocks + embedding; no FSDP2 on one data-parallel rank, nothing gathered.
    assert one_f_one_b.gradients == 4 * (2 * TINY_BLOCK + 8192) and one_f_one_b.gathered_parameters == 0
    gpipe = estimate(four_layers, two, Layout(pp=2, pp_schedule="gpipe", microbatches=4), 8, "32-true").memory
    # GPipe: every stage holds all 4; the last one also keeps 4 log-softmax outputs and the logits being computed.
    # Its one receive buffer is the activation posted ahead of the next forward.
    assert gpipe.stage == "last" and gpipe.activations == 4 * 2 * layer + residual
    assert gpipe.logits == 5 * 2 * 32 * 128 * 4


#: BENCHMARKS.md "Memory": the recipe GPT (4 blocks, width 128, 4 heads, vocabulary 64, sequence 64), fp32, a
#: global batch of 16, measured per rank with torch's MemTracker: (GPUs, layout, activations MiB, model states MiB)
#: of the fullest rank. The planner leaves out norm statistics, position ids and the loss's scalars (a few % low)
#: and counts a whole block's working set for the recompute (high with checkpointing, which stops early).
MEASURED = {
    "single": (1, Layout(), 33.63, 12.481),
    "single-ac": (1, Layout(activation_checkpointing="every"), 9.53, 12.481),
    "dp2-z3": (2, Layout(dp=2), 16.82, 6.240),
    "tp2": (2, Layout(tp=2), 21.73, 6.356),
    "tp2-ac": (2, Layout(tp=2, activation_checkpointing="every"), 6.52, 6.356),
    "dp2-tp2": (4, Layout(dp=2, tp=2), 10.86, 3.170),
    "pp2": (2, Layout(pp=2, microbatches=2), 17.31, 6.301),
    "pp2-gpipe-m4": (2, Layout(pp=2, pp_schedule="gpipe", microbatches=4), 17.38, 6.180),
    "tp2-pp2": (4, Layout(tp=2, pp=2, microbatches=2), 11.30, 3.246),
    "pp2-ac": (2, Layout(pp=2, microbatches=2, activation_checkpointing="every"), 5.77, 6.301),
    "dp1-ac2": (1, Layout(activation_checkpointing=2), 24.59, 12.481),  # blocks 1 and 3 checkpointed
    "dp1-sac": (1, Layout(activation_checkpointing="selective"), 25.08, 12.481),
}


@pytest.mark.parametrize("name", MEASURED)
def test_memory_matches_the_measured_benchmark(name: str) -> None:
    gpus, layout, activations_mib, states_mib = MEASURED[name]
    config = {"vocab_size": 64, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
    model = ModelShape.from_module("recipes.gpt:GPTLightning", {"config": config}, seq_len=64, heads=4)
    cluster = Cluster(nodes=1, gpus_per_node=gpus, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e9)
    memory = estimate(model, cluster, layout, global_batch=16, precision="32-true").memory
    assert memory.model_states / 2**20 == pytest.approx(states_mib, rel=0.005)
    assert 0.9 < (memory.activations + memory.logits) / 2**20 / activations_mib < 1.2


#: BENCHMARKS.md "Memory", measured FSDP2 gathered parameters (MiB, fullest rank) of the same GPT and batch.
MEASURED_GATHERED = {"dp2-z3": (2, Layout(dp=2), 2.36), "dp2-z2": (2, Layout(dp=2, zero=2), 4.63),
                     "dp4": (4, Layout(dp=4), 2.36), "dp2-tp2": (4, Layout(dp=2, tp=2), 1.30)}


@pytest.mark.parametrize("name", MEASURED_GATHERED)
def test_gathered_parameters_match_fsdp2s_measured_peak(name: str) -> None:
    gpus, layout, gathered_mib = MEASURED_GATHERED[name]
    config = {"vocab_size": 64, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}
    model = ModelShape.from_module("recipes.gpt:GPTLightning", {"config": config}, seq_len=64, heads=4)
    cluster = Cluster(nodes=1, gpus_per_node=gpus, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e9)
    memory = estimate(model, cluster, layout, global_batch=16, precision="32-true").memory
    # tp ranks gather the root (position embedding, final norm whole; token embedding and head: their vocabulary
    # share) and their share of each block: a little low there.
    assert memory.gathered_parameters / 2**20 == pytest.approx(gathered_mib, rel=0.08 if layout.tp > 1 else 0.01)


@pytest.mark.parametrize(("pp", "schedule", "microbatches", "bubble"),
                         [(2, "1f1b", 4, 1 / 5), (4, "1f1b", 8, 3 / 11), (2, "interleaved_1f1b", 4, 1 / 9)])
def test_bubble(pp: int, schedule: str, microbatches: int, bubble: float) -> None:
    """(p − 1) / (m·v + p − 1) of the pipelined time: 1/(4+1), 3/(8+3), 1/(4·2+1)."""
    eight_layers = ModelShape(layers=8, hidden=64, heads=4, vocab=128, seq_len=32)
    cluster = Cluster(nodes=1, gpus_per_node=pp, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e9)
    result = estimate(eight_layers, cluster, Layout(pp=pp, pp_schedule=schedule, microbatches=microbatches), 16)
    pipelined = result.time.step - result.time.data_parallel_exposed
    assert result.time.bubble / pipelined == pytest.approx(bubble)


# ----------------------------------------------------------------------------------- gradient accumulation
def two_gpus(memory: float = GIB) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=2, memory_bytes=memory, peak_flops=1e12, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=1e9)


def test_accumulation_fits_a_data_parallel_layout_that_is_out_of_memory_at_once() -> None:
    # dp=2, 8192 sequences: 4096 per replica. Model states 16 B × 115,008 / 2 + gathered 4 B × 115,008 (ZeRO-3's two
    # blocks are all of TINY) = 1,380,096 B. At once: activations 2 blocks · 4096 · 131,584 B = 1,077,936,128 and
    # logits + log-softmax 2 · 4096 · 32 · 128 · 4 B = 134,217,728: 1,213,533,952 B (1.13 GiB) > 0.9 GiB usable.
    # accumulate_grad_batches=2 runs 2048 sequences at a time: half of both, 607,457,024 B (0.57 GiB).
    at_once = estimate(TINY, two_gpus(), Layout(dp=2), global_batch=8192, precision="32-true")
    accumulated = estimate(TINY, two_gpus(), Layout(dp=2, microbatches=2), global_batch=8192, precision="32-true")
    assert at_once.memory.total == 1_380_096 + 1_077_936_128 + 134_217_728 and at_once.out_of_memory
    assert accumulated.memory.total == 1_380_096 + 1_077_936_128 // 2 + 134_217_728 // 2 and accumulated.feasible
    assert str(accumulated.layout) == "dp2 tp1 pp1 acc2 z3"
    # Compute is the whole replica batch either way: 3 · 4096 · 32 tokens · 229,888 FLOPs / (0.5 · 1 TFLOP/s).
    assert accumulated.time.compute == at_once.time.compute == pytest.approx(3 * 4096 * 32 * 229_888 / 0.5e12)


@pytest.mark.parametrize("steps", [1, 2, 4, 8])
def test_accumulation_divides_activations_and_multiplies_fsdp_syncs(steps: int) -> None:
    layout = Layout(dp=2, microbatches=steps if steps > 1 else None)
    zero3 = estimate(TINY, two_gpus(), layout, global_batch=64, precision="32-true")
    zero2 = estimate(TINY, two_gpus(), replace(layout, zero=2), global_batch=64, precision="32-true")
    # 32 sequences per replica, 32 / k at a time: activations 2 blocks · (32 / k) · 131,584 B.
    assert zero3.memory.activations == 2 * (32 // steps) * TINY_LAYER_PER_SEQUENCE
    # Every accumulation step reduce-scatters the fp32 gradients of all 115,008 parameters, ring (2 − 1) / 2 of
    # 460,032 B = 230,016 B at 1 GB/s, and all-gathers them: ZeRO-3 forward and backward, ZeRO-2 once (FSDP2
    # reshards after each backward). The gradients stay sharded: 4 B × 115,008 / 2.
    one_pass = 230_016 / 1e9
    assert zero3.time.data_parallel == pytest.approx((2 * steps + steps) * one_pass)
    assert zero2.time.data_parallel == pytest.approx((steps + steps) * one_pass)
    assert zero3.memory.gradients == zero2.memory.gradients == 4 * TINY_TOTAL / 2
    # Tensor parallelism moves the same bytes in k times as many messages.
    tensor = [estimate(TINY, two_gpus(), Layout(tp=2, microbatches=k), 64, "32-true").time.tensor_parallel
              for k in (None, steps)]
    assert tensor[0] == tensor[1]


def test_plan_accumulates_rather_than_recomputes() -> None:
    # 8192 sequences on 2 GPUs: no layout fits at once without checkpointing (above). dp2 with checkpointing fits
    # (states 1,380,096 + block inputs 2 · 4096 · 32 · 64 · 4 + one block 4096 · 131,584 + logits 134,217,728 =
    # 741,674,752 B) but recomputes (4/3 of the compute); dp2 acc2 fits at 3/3 with its FSDP traffic hidden, both
    # ZeRO levels alike in time; ZeRO-3 needs less memory (ZeRO-2's peak adds two blocks of buffers to TINY's two
    # gathered blocks). Accumulation counts are the divisors of 4096 sequences per replica.
    results = plan(TINY, two_gpus(), 8192, precision="32-true")
    assert results[0].layout == Layout(dp=2, zero=3, microbatches=2)
    zero2 = next(e for e in results if e.layout == Layout(dp=2, zero=2, microbatches=2))
    assert zero2.time.step == results[0].time.step
    assert zero2.memory.gathered_parameters - results[0].memory.gathered_parameters == 2 * 4 * TINY_BLOCK
    considered = {e.layout.microbatches for e in results if e.layout.pp == 1 and e.layout.dp == 2}
    assert considered == {None} | {2**i for i in range(1, 13)}
    recomputing = estimate(TINY, two_gpus(), Layout(dp=2, activation_checkpointing="every"), 8192, "32-true")
    assert recomputing.feasible and recomputing.memory.total == 741_674_752
    # FLOPs per token 3 · 229,888 = 689,664 against 4 · 213,504 (blocks, recomputed) + 3 · 16,384 (head) = 903,168.
    assert results[0].time.compute == pytest.approx(689_664 / 903_168 * recomputing.time.compute)


# ------------------------------------------------------------------------------------------------ links, rank
def test_the_vocabulary_tables_shard_over_tp_unless_kept_whole() -> None:
    model = ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq_len=32)
    memory = {shard: estimate(model, two_gpus(), Layout(tp=2, shard_vocab=shard), 8, "32-true").memory
              for shard in (True, False)}
    # The token embedding and the untied head, 128 × 64 each, keep half their rows per rank: 4 B parameters.
    assert memory[False].parameters - memory[True].parameters == 4 * 2 * 128 * 64 / 2
    odd = replace(model, vocab=127)  # tp=2 does not divide it: both tables stay whole either way
    assert (estimate(odd, two_gpus(), Layout(tp=2), 8, "32-true").memory
            == estimate(odd, two_gpus(), Layout(tp=2, shard_vocab=False), 8, "32-true").memory)


def test_every_message_costs_the_latency() -> None:
    """α–β: TINY (2 blocks) costs α more per all-reduce (4 per block and microbatch, and with the vocabulary
    sharded the embedding's output, the head's input gradient and the logits' all-gather per microbatch), pipeline
    message (2 per microbatch) and FSDP collective (a gather per unit in forward and backward, a reduce-scatter per
    unit; units: 2 blocks + root)."""
    alpha = 1e-3

    def times(layout: Layout, latency: float, global_batch: int = 16) -> Any:
        return estimate(TINY, replace(two_gpus(), latency=latency), layout, global_batch, "32-true").time

    tp2 = [times(Layout(tp=2, microbatches=2), latency) for latency in (0.0, alpha)]
    assert tp2[1].tensor_parallel - tp2[0].tensor_parallel == pytest.approx((2 * 4 + 3) * 2 * alpha)
    pp2 = [times(Layout(pp=2, microbatches=4), latency) for latency in (0.0, alpha)]
    assert pp2[1].pipeline - pp2[0].pipeline == pytest.approx(2 * 4 * alpha)
    dp2 = [times(Layout(dp=2), latency) for latency in (0.0, alpha)]
    assert dp2[1].data_parallel - dp2[0].data_parallel == pytest.approx((2 + 1) * 3 * alpha)
    # Hidden behind compute but for what FSDP2 cannot prefetch: the root's (16,448) and first block's parameters,
    # gathered before the forward and reduce-scattered after the backward, 4 + 4 B each, half of them moved.
    assert times(Layout(dp=2), alpha, global_batch=4096).data_parallel_exposed == pytest.approx(
        (TINY_BLOCK + 16_448) * 8 / 2 / 1e9)


def test_without_overlap_all_data_parallel_traffic_shows() -> None:
    overlapping = estimate(TINY, two_gpus(), Layout(dp=2), 4096, "32-true").time
    serial = estimate(TINY, replace(two_gpus(), overlap_communication=False), Layout(dp=2), 4096, "32-true").time
    unprefetched = (TINY_BLOCK + 16_448) * 8 / 2 / 1e9  # the root's and first block's gather and reduce-scatter
    assert overlapping.data_parallel_exposed == pytest.approx(unprefetched)
    assert serial.data_parallel_exposed == pytest.approx(serial.data_parallel) and serial.data_parallel > 0
    assert serial.step == pytest.approx(overlapping.step - unprefetched + serial.data_parallel)


def test_a_group_is_intra_node_when_its_ranks_fit_in_one_node() -> None:
    cluster = two_nodes_of_four()
    intra, inter = 100e9, 10e9
    assert cluster.link_bandwidth(4, 1) == intra  # tp=4: ranks 0-3, 4-7
    assert cluster.link_bandwidth(8, 1) == inter  # tp=8 spans both nodes
    assert cluster.link_bandwidth(2, 2) == intra  # dp=2 over tp=2: {0, 2}, {1, 3}, {4, 6}, {5, 7}
    assert cluster.link_bandwidth(2, 4) == inter  # dp=2 over tp=4: {0, 4}, ...
    assert cluster.link_bandwidth(3, 1) == inter  # groups of 3 straddle the node boundary: {3, 4, 5}
    assert cluster.link_bandwidth(2, 1) == intra
    single_node = Cluster(nodes=1, gpus_per_node=8, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=intra,
                          inter_node_bandwidth=inter)
    assert single_node.link_bandwidth(8, 1) == intra


def test_a_ring_collective_across_nodes_runs_over_as_many_nics_as_its_group_has_ranks_in_a_node() -> None:
    # NCCL's rings cross each node boundary once per channel, its channels spread over the node's NICs: a group
    # with g ranks in each node moves its boundary bytes over g NICs (10 GB/s each here), NVLink (100) the ceiling
    cluster = two_nodes_of_four()
    assert cluster.collective_bandwidth(8, 1) == 4 * 10e9  # dp=8: four ranks, four NICs per node
    assert cluster.collective_bandwidth(4, 2) == 2 * 10e9  # dp=4 over tp=2: the two groups share a node's NICs
    assert cluster.collective_bandwidth(2, 4) == 10e9  # one rank a node: its own NIC, as a message would
    assert cluster.collective_bandwidth(2, 2) == cluster.link_bandwidth(2, 2) == 100e9  # within a node: NVLink
    wide = Cluster(nodes=2, gpus_per_node=16, memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=100e9,
                   inter_node_bandwidth=10e9)
    assert wide.collective_bandwidth(32, 1) == 100e9  # 16 NICs would carry 160: NVLink is the slower hop
    assert cluster.link_bandwidth(8, 1) == 10e9  # point-to-point and all-to-all stay one NIC per GPU


def test_tensor_parallelism_across_nodes_ranks_below_within_a_node() -> None:
    model = ModelShape(layers=4, hidden=1024, heads=8, vocab=1000, seq_len=1024)
    across, within = two_nodes_of_four(), Cluster(nodes=1, gpus_per_node=8, memory_bytes=80 * GIB, peak_flops=100e12,
                                                  intra_node_bandwidth=100e9, inter_node_bandwidth=10e9)
    # 4 blocks × 4 all-reduces × ring 2·7/8 × (64 sequences · 1024 · 1024 · 2 B) over NVLink (100 GB/s) or, across
    # the two nodes, the 4 NICs a node's 4 ranks bring to the rings (4 × 10 GB/s); with the vocabulary sharded, 2 more all-reduces and an all-gather of the logits (7/8 × 64 · 1024 · 1000 · 2 B).
    ring_bytes = 4 * 4 * 2 * 7 / 8 * 64 * 1024 * 1024 * 2
    vocab_bytes = 2 * 2 * 7 / 8 * 64 * 1024 * 1024 * 2 + 7 / 8 * 64 * 1024 * 1000 * 2
    whole_vocab = Layout(tp=8, shard_vocab=False)
    assert estimate(model, across, whole_vocab, 64).time.tensor_parallel == pytest.approx(ring_bytes / 40e9)
    assert estimate(model, within, whole_vocab, 64).time.tensor_parallel == pytest.approx(ring_bytes / 100e9)
    sharded = estimate(model, within, Layout(tp=8), 64).time.tensor_parallel
    assert sharded == pytest.approx((ring_bytes + vocab_bytes) / 100e9)
    ranked = [e.layout for e in plan(model, across, 64, zero_levels=(3,), checkpointing=(None,))]
    assert ranked.index(Layout(dp=2, tp=4)) < ranked.index(Layout(tp=8))
    # Compute-bound: no tensor parallelism; FSDP2 over both nodes, whose rings cross them over each node's 4 NICs
    # (40 GB/s), ahead of HSDP (FSDP2 within a node on NVLink, then its shards' all-reduce over the network).
    assert ranked[:2] == [Layout(dp=8), Layout(dp=4, dp_replicate=2)]


# ------------------------------------------------------------------------------------------ infeasible, errors
def test_infeasible_layouts_say_why() -> None:
    twelve_heads = ModelShape(layers=2, hidden=768, heads=12, vocab=128, seq_len=32)
    cluster = Cluster.preset("h100-sxm", nodes=1)
    assert estimate(twelve_heads, cluster, Layout(tp=8), 8).reasons == ("tp=8 does not divide heads=12",)
    assert "4 pipeline stages for 2 layers" in estimate(twelve_heads, cluster, Layout(dp=2, pp=4), 8).reasons
    assert estimate(twelve_heads, cluster, Layout(dp=8), 12).reasons == (
        "global batch 12 is not divisible by dp × dp_replicate × microbatches = 8",)
    eight_layers = ModelShape(layers=8, hidden=768, heads=12, vocab=128, seq_len=32)
    too_few = estimate(eight_layers, cluster, Layout(dp=2, pp=4, microbatches=2), 8)
    assert too_few.reasons == ("pp_schedule='1f1b' needs microbatches ≥ pp (4); got microbatches=2.",)


def test_out_of_memory_says_by_how_much() -> None:
    # 4096 sequences: states 16 B per parameter (nothing gathered without FSDP2), activations 2 blocks · 4096 ·
    # 131,584 B, logits 2 · 4096 · 32 · 128 · 4 B = 1,213,993,984 B (1.13 GiB) against 0.9 of 1 GiB: 0.23 GiB over.
    total = 16 * TINY_TOTAL + 2 * 4096 * TINY_LAYER_PER_SEQUENCE + 2 * 4096 * 32 * 128 * 4
    assert total == 1_213_993_984
    result = estimate(TINY, one_gpu(), Layout(), global_batch=4096, precision="32-true")
    assert result.reasons == ("out of memory: 1.1 GiB per GPU, 0.2 GiB over the usable 0.9 GiB",)
    assert result.memory.total == total


def test_out_of_memory_by_less_than_a_tenth_of_a_gib_is_not_printed_as_zero() -> None:
    # The same model at 3300 sequences: 1,840,128 B of states + 3300 · 295,936 B = 978,428,928 B against the usable
    # 0.9 · 2^30 = 966,367,641.6 B: 12,061,286.4 B (11.5 MiB) over, which one decimal of GiB would print as 0.0.
    result = estimate(TINY, one_gpu(), Layout(), global_batch=3300, precision="32-true")
    assert result.memory.total == 978_428_928
    assert result.reasons == ("out of memory: 0.9 GiB per GPU, 11.5 MiB over the usable 0.9 GiB",)
    assert describe_size(0.1 * GIB) == "0.1 GiB"
    assert describe_size(0.04 * GIB) == "41.0 MiB"
    assert describe_size(1024.0) == "1.0 KiB"
    assert describe_size(50.0) == "50 B"


def test_plan_lists_feasible_layouts_fastest_first_then_infeasible_ones() -> None:
    model = ModelShape(layers=4, hidden=1024, heads=8, vocab=1000, seq_len=1024)
    results = plan(model, two_nodes_of_four(memory=2 * GIB), 64)
    feasible = [e for e in results if e.feasible]
    steps = [e.time.step for e in feasible]
    assert feasible and steps == sorted(steps)
    assert results[: len(feasible)] == feasible and all(e.reasons for e in results[len(feasible):])
    assert all(e.memory.total <= 0.9 * 2 * GIB for e in feasible)
    assert all(e.layout.gpus == 8 for e in results)


def test_bad_input_names_the_field() -> None:
    fields = dict(memory_bytes=GIB, peak_flops=1e12, intra_node_bandwidth=1e9, inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match=r"Cluster\(nodes=0\)"):
        Cluster(nodes=0, gpus_per_node=8, **fields)
    with pytest.raises(ValueError, match=r"Cluster\(gpus_per_node=0\)"):
        Cluster(nodes=1, gpus_per_node=0, **fields)
    with pytest.raises(ValueError, match=r"Cluster\(memory_bytes=-1\)"):
        Cluster(nodes=1, gpus_per_node=1, **{**fields, "memory_bytes": -1})
    with pytest.raises(ValueError, match=r"ModelShape\(hidden=0\)"):
        ModelShape(layers=2, hidden=0, heads=4, vocab=128, seq_len=32)
    with pytest.raises(ValueError, match=r"ModelShape\(seq_len=-5\)"):
        ModelShape(layers=2, hidden=64, heads=4, vocab=128, seq_len=-5)
    with pytest.raises(ValueError, match=r"Layout\(tp=0\)"):
        Layout(tp=0)
    with pytest.raises(ValueError, match=r"global_batch=0"):
        estimate(TINY, one_gpu(), Layout(), 0)
    with pytest.raises(ValueError, match="uses 2 GPUs; the cluster has 1"):
        estimate(TINY, one_gpu(), Layout(dp=2), 4)


def test_a_model_larger_than_the_cluster_is_refused_with_the_minimum_gpu_count() -> None:
    trillion = ModelShape(layers=4, hidden=1024, heads=8, vocab=1000, seq_len=1024,
                          parameters_per_block=250_000_000_000, first_stage_parameters=0, last_stage_parameters=0)
    cluster = Cluster.preset("h100-sxm", nodes=1)  # 8 × 80 GiB, 72 GiB usable each
    minimum = math.ceil(16e12 / (0.9 * 80 * GIB))  # 16 B/param × 10^12 = 16 TB → 207 GPUs
    assert minimum == 207
    with pytest.raises(ValueError) as error:
        plan(trillion, cluster, 64)
    assert ("need 16,000,000,000,000 bytes (16 B/param × 1,000,000,000,000 parameters, bf16-mixed with AdamW):"
            f" at least {minimum} GPUs of 80 GiB (90% usable), and the cluster has 8.") in str(error.value)
    with pytest.raises(ValueError, match="8,000,000,000,000 bytes \\(8 B/param"):  # bf16-true: 2 + 2 + 4
        estimate(trillion, cluster, Layout(dp=8), 64, precision="bf16-true")


def test_gpu_presets_pick_the_peak_of_the_precision() -> None:
    cluster = Cluster.preset("H100-SXM", nodes=4)
    assert (cluster.gpus, cluster.memory_bytes, cluster.peak_flops) == (32, 80 * 2**30, 989e12)
    assert Cluster.preset("a100-80gb", precision="32-true").peak_flops == 19.5e12
    assert Cluster.preset("l4", peak_flops=1e12).peak_flops == 1e12
    with pytest.raises(ValueError, match="Unknown GPU preset 'v100'"):
        Cluster.preset("v100")


# ------------------------------------------------------------------------------------------------------- CLI
TINY_ARGS = ["plan", "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128", "--seq-len", "32",
             "--gpu-memory-gib", "1", "--peak-tflops", "1", "--intra-node-gbps", "100", "--inter-node-gbps", "10",
             "--nodes", "2", "--gpus-per-node", "4", "--global-batch", "64", "--precision", "32-true"]


def test_cli_prints_a_ranked_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--top", "3"])
    out = capsys.readouterr().out
    assert "115,008 parameters" in out and "2 × 4 GPUs of 1 GiB (0.9 usable)" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("#"))
    rows = lines[header + 1:]
    assert [row.split()[0] for row in rows] == ["1", "2", "3", "4", "5", "6"]  # 3 fitting + 3 that do not
    assert [row.rstrip().endswith("yes") for row in rows] == [True] * 3 + [False] * 3
    assert all("NO: " in row for row in rows[3:])
    steps = [float(row.split()[-4]) for row in rows[:3]]  # ... step s, tokens/s, MFU, yes
    assert steps == sorted(steps)


def test_cli_latency_is_charged_per_message(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--json", "--latency-us", "1000"])
    result = json.loads(capsys.readouterr().out)
    assert result["cluster"]["latency"] == pytest.approx(1e-3)
    main(TINY_ARGS + ["--top", "1", "--latency-us", "250"])
    assert "250 µs per message" in capsys.readouterr().out


def test_cli_json_output(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--top", "1000", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["total_parameters"] == TINY_TOTAL
    assert report["cluster"]["memory_bytes"] == GIB and report["cluster"]["inter_node_bandwidth"] == 10e9
    feasible = report["feasible"]
    assert [e["time_s"]["step"] for e in feasible] == sorted(e["time_s"]["step"] for e in feasible)
    assert all(e["memory_bytes"]["total"] <= 0.9 * GIB and e["feasible"] for e in feasible)
    assert all(e["reasons"] for e in report["infeasible"])
    assert len(feasible) + len(report["infeasible"]) == report["layouts_considered"]
    fsdp8 = next(e for e in feasible if e["layout"] == "dp8 tp1 pp1 z3")
    assert fsdp8["memory_bytes"]["parameters"] == 4 * TINY_TOTAL / 8  # fp32, sharded 8 ways
    assert fsdp8["memory_bytes"]["activations"] == 2 * 8 * TINY_LAYER_PER_SEQUENCE  # 64 / 8 sequences per GPU


def test_cli_measures_a_module(capsys: pytest.CaptureFixture[str]) -> None:
    config = json.dumps({"config": {"vocab_size": 64, "block_size": 64, "n_layer": 4, "n_head": 4, "n_embd": 128}})
    main(["plan", "--module", "recipes.gpt:GPTLightning", "--module-kwargs", config, "--heads", "4", "--seq-len", "64",
          "--gpu", "l4", "--global-batch", "8", "--json", "--top", "1"])
    report = json.loads(capsys.readouterr().out)
    assert report["model"]["total_parameters"] == 817_920
    assert report["cluster"]["peak_flops"] == 121e12 and report["cluster"]["memory_bytes"] == 24 * GIB


def test_cli_activation_options(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--dropout", "--eager-attention", "--json", "--top", "1"])
    model = json.loads(capsys.readouterr().out)["model"]
    assert model["dropout"] is True and model["flash_attention"] is False


@pytest.mark.parametrize(("argv", "message"), [
    (["plan", "--params", "7B", "--gpu", "h100-sxm", "--global-batch", "8"], "--params needs --seq-len"),
    (["plan", "--gpu", "h100-sxm", "--global-batch", "8"], "describe the model one way"),
    (["plan", "--params", "7B", "--layers", "2", "--seq-len", "8", "--gpu", "h100-sxm", "--global-batch", "8"],
     "(got --params and --layers/--hidden)"),
    (["plan", "--layers", "2", "--hidden", "64", "--seq-len", "8", "--gpu", "h100-sxm", "--global-batch", "8"],
     "also needs --heads --vocab"),
    (["plan", "--module", "recipes.gpt:GPTLightning", "--seq-len", "64", "--gpu", "l4", "--global-batch", "8"],
     "heads= (CLI --heads)"),
    (["plan", "--module", "recipes.gpt:GPTLightning", "--module-kwargs", "{bad", "--heads", "4", "--seq-len", "64",
      "--gpu", "l4", "--global-batch", "8"], "--module-kwargs is not valid JSON"),
    (["plan", "--params", "7B", "--seq-len", "8", "--global-batch", "8", "--peak-tflops", "100"],
     "give --gpu-memory-gib --intra-node-gbps --inter-node-gbps"),
    (["plan", "--params", "7B", "--seq-len", "8", "--gpu", "h100-sxm", "--nodes", "0", "--global-batch", "8"],
     "Cluster(nodes=0) is invalid"),
    (["plan", "--params", "70B", "--seq-len", "8", "--gpu", "l4", "--global-batch", "8"],
     "GPUs of 24 GiB (90% usable), and the cluster has 8"),
    (["plan", "--params", "7B", "--seq-len", "8", "--gpu", "h100-sxm", "--global-batch", "8", "--precision", "fp8"],
     "precision='fp8' is invalid"),
    (["plan", "--params", "7B", "--seq-len", "8", "--heads", "32", "--gpu", "h100-sxm", "--global-batch", "8"],
     "--params (a GPT-3-shaped model) does not use --heads"),
    (["plan", "--params", "7B", "--seq-len", "8", "--gpu", "h100-sxm", "--global-batch", "0"], "global_batch=0"),
    (["plan", "--module", "recipes.gpt:GPTLightning", "--module-kwargs", '{"width": 3}', "--heads", "4", "--seq-len",
      "64", "--gpu", "l4", "--global-batch", "8"],
     "recipes.gpt:GPTLightning(**{'width': 3}) on the meta device failed"),
])
def test_cli_errors_are_one_line_messages(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("lightning-hybrid plan: error: ") and message in err and "Traceback" not in err


def test_from_module_measures_a_model_larger_than_host_memory() -> None:
    # 39.5B parameters (158 GB in fp32) are measured on the meta device without allocating them.
    config = {"vocab_size": 50_000, "block_size": 2048, "n_layer": 48, "n_head": 32, "n_embd": 8192}
    shape = ModelShape.from_module("recipes.gpt:GPTLightning", {"config": config}, seq_len=2048, heads=32)
    per_block = 2 * 8192 + (8192 * 3 * 8192 + 3 * 8192) + (8192**2 + 8192) + 2 * 8192 + (8192 * 4 * 8192 + 4 * 8192) \
        + (4 * 8192 * 8192 + 8192)
    assert shape.parameters_per_block == per_block
    assert shape.total_parameters == 48 * per_block + 50_000 * 8192 + 2048 * 8192 + 2 * 8192 + 50_000 * 8192
    assert torch.empty(0).device.type == "cpu"  # the meta device context did not leak
