"""The planner's context-parallel terms: layouts with ``cpN`` (dp counts the batches, cp the ranks of a sequence),
what cp changes in memory (the blocks' activations ÷ cp, the logits whole, FSDP2's shards over dp × cp) and time
(the blocks' FLOPs ÷ cp, the exchange), the layouts HybridStrategy would refuse, and cp tried when nothing else fits
a long sequence."""

from __future__ import annotations

import pytest

from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import Layout, parse_layout
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.search import plan

#: Meta-Llama-3-8B's dimensions at an 80k-token context (recipes/configs/llama3_8b_80k_cp4_1x8_h100.yaml).
LLAMA_80K = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True, vocab=128256,
                       seq_len=81920)
NODE = Cluster.preset("h100-sxm", nodes=1)


def test_cp_is_a_layout_word_and_takes_gpus_of_its_own() -> None:
    layout = parse_layout("cp4 ac", gpus=8)
    assert (layout.dp, layout.cp, layout.gpus) == (2, 4, 8) and str(layout) == "dp2 tp1 pp1 cp4 z3 ac"
    assert parse_layout(str(layout)) == layout


def test_cp_divides_the_blocks_activations_and_the_shards_but_not_the_logits() -> None:
    whole, split = (estimate(LLAMA_80K, NODE, Layout(dp=8 // cp, cp=cp, activation_checkpointing="every",
                                                     microbatches=8 // (8 // cp)), global_batch=8) for cp in (1, 4))
    assert split.memory.logits == whole.memory.logits  # the head and the loss run on the whole sequence
    assert split.memory.parameters == whole.memory.parameters  # FSDP2 shards over dp × cp = 8 ranks either way
    # Checkpointed: each block keeps its input (÷ 4) and one block recomputes (÷ 4); cp adds one output gathered
    # whole (b·s·h, 2 bytes).
    residual = 81920 * 4096 * 2
    assert split.memory.activations == pytest.approx(whole.memory.activations / 4 + residual, rel=1e-12)
    assert not whole.feasible and split.feasible and split.memory.total / GIB == pytest.approx(66.10, abs=0.01)


def test_cp_divides_the_blocks_compute_and_pays_the_exchange() -> None:
    small = ModelShape(layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=64, seq_len=4096)
    cluster = Cluster.preset("h100-sxm", nodes=1, gpus_per_node=2)
    one, two = (estimate(small, cluster, Layout(dp=2 // cp, cp=cp), global_batch=2, precision="32-true")
                for cp in (1, 2))
    assert one.time.context == 0.0 and two.time.context > 0.0
    # Per block (2), forward and backward: q, k, v, output (64 + 2·64 + 64 floats a token over the rank's 4096 of
    # the 2 sequences' 8192 tokens), half of each crossing; the block's output and its input's gradient gathered
    # (half of 8192 × 64 floats each); a message's latency for each of the 8 exchanges and 2 gathers.
    link, alpha = cluster.link_bandwidth(2, 1), cluster.latency
    exchange = 2 * 2 * (4096 * 256 * 4 / 2 / link) + 2 * 2 * (8192 * 64 * 4 / 2 / link) + 2 * (4 * 2 + 2) * alpha
    assert two.time.context == pytest.approx(exchange, rel=1e-9)


def test_what_cp_cannot_split_is_a_reason() -> None:
    result = estimate(LLAMA_80K, NODE, Layout(dp=1, tp=8, cp=1), global_batch=8)
    assert not any(reason.startswith("cp=") for reason in result.reasons)
    refused = estimate(ModelShape(layers=2, hidden=96, heads=6, vocab=64, seq_len=1002), NODE,
                       Layout(dp=1, tp=2, cp=4), global_batch=1)
    assert {"cp=4 does not divide seq_len=1002", "cp=4 does not divide heads per tp rank=3"} <= set(refused.reasons)


def test_cp_is_tried_when_nothing_else_fits_a_long_sequence() -> None:
    ranked = plan(LLAMA_80K, NODE, global_batch=8)
    feasible = [e for e in ranked if e.feasible]
    assert any(e.layout.cp > 1 for e in feasible)
    # Without cp only pipelines fit, to the brim (under 5 % of the usable memory free): cp is tried beside them.
    brim = 0.95 * NODE.usable_memory
    assert all(e.layout.pp > 1 and e.memory.total > brim for e in feasible if e.layout.cp == 1)
    shorter = plan(ModelShape(**{**LLAMA_80K.__dict__, "seq_len": 8192}), NODE, global_batch=8)
    assert all(e.layout.cp == 1 for e in shorter)  # layouts without cp fit: cp is not tried
