"""The planner's mixture-of-experts terms: parameter counts (total and active), layouts with ``epN``, what expert
parallelism changes in memory (the gathered experts ÷ ep, the states unchanged) and time (the all-to-all), and the
layouts HybridStrategy would refuse."""

from __future__ import annotations

import pytest

from lightning_hybrid.hardware import Cluster
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.planner.layout import Layout, parse_layout
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.search import candidate_layouts

#: Mixtral 8x7B's published sizes: 46.7B parameters, 12.9B active per token.
MIXTRAL = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True, vocab=32000,
                     seq_len=4096, experts=8, experts_per_token=2)


def test_mixture_of_experts_counts_total_and_active_parameters() -> None:
    assert MIXTRAL.total_parameters == pytest.approx(46.7e9, rel=0.005)
    active = MIXTRAL.layers * MIXTRAL.active_parameters_per_block + MIXTRAL.outside_block_parameters
    assert active == pytest.approx(12.9e9, rel=0.01)
    dense_first = ModelShape(**{**MIXTRAL.__dict__, "moe_layers": 2, "parameters_per_block": None})
    assert dense_first.total_parameters < MIXTRAL.total_parameters  # 30 of 32 blocks hold one MLP instead of 8
    with pytest.raises(ValueError, match="experts_per_token"):
        ModelShape(layers=2, hidden=64, heads=4, vocab=100, seq_len=16, experts=4, experts_per_token=5)


def test_ep_is_a_layout_word() -> None:
    layout = parse_layout("tp2 ep8 z3", gpus=64)
    assert (layout.dp, layout.tp, layout.ep) == (32, 2, 8) and str(layout) == "dp32 tp2 pp1 ep8 z3"
    assert parse_layout(str(layout)) == layout


def test_expert_parallelism_gathers_fewer_experts_and_pays_the_all_to_all() -> None:
    cluster = Cluster.preset("h100-sxm", nodes=2)
    whole, spread = (estimate(MIXTRAL, cluster, Layout(dp=16, ep=ep, activation_checkpointing="every"),
                              global_batch=16) for ep in (1, 8))
    assert whole.feasible and spread.feasible
    # Model states shard over all 16 ranks either way; FSDP2 gathers a block's 8 experts, or its one local expert.
    assert spread.memory.model_states == pytest.approx(whole.memory.model_states)
    expert = 3 * 4096 * 14336
    gathered_experts = (whole.memory.gathered_parameters - spread.memory.gathered_parameters) / 2  # bf16
    assert gathered_experts == pytest.approx(3 * 7 * expert)  # 3 blocks gathered at ZeRO-3, 7 experts fewer each
    assert whole.time.experts == 0.0
    # A sequence of 4096 tokens × 2 choices × 4096 × 2 bytes per exchange, 7/8 to other ranks of the node; 6 per
    # block (dispatch and return, forward, backward and the checkpointed block's recompute), 32 blocks; 20 µs each.
    rows = 4096 * 2 * 4096 * 2
    assert spread.time.experts == pytest.approx(6 * 32 * (rows * 7 / 8 / cluster.intra_node_bandwidth + 20e-6))


@pytest.mark.parametrize(("model", "layout", "reason"), [
    (ModelShape(layers=4, hidden=256, heads=4, vocab=1000, seq_len=64), Layout(dp=16, ep=2),
     "ep=2 needs a mixture-of-experts model"),
    (MIXTRAL, Layout(dp=16, ep=16), "ep=16 does not divide experts=8"),
    (MIXTRAL, Layout(dp=2, tp=8, ep=4), "ep=4 does not divide dp=2"),
])
def test_an_ep_hybrid_strategy_refuses_is_infeasible(model: ModelShape, layout: Layout, reason: str) -> None:
    result = estimate(model, Cluster.preset("h100-sxm", nodes=2), layout, global_batch=64)
    assert any(reason in given for given in result.reasons), result.reasons


def test_the_search_tries_every_ep_that_divides_dp_and_the_experts() -> None:
    cluster = Cluster.preset("h100-sxm", nodes=2)
    layouts = candidate_layouts(cluster, 64, zero_levels=(3,), checkpointing=(None,), experts=MIXTRAL.experts)
    assert sorted({layout.ep for layout in layouts if (layout.dp, layout.tp, layout.pp) == (16, 1, 1)}) == [1, 2, 4, 8]
    assert {layout.ep for layout in candidate_layouts(cluster, 64, zero_levels=(3,), checkpointing=(None,))} == {1}
