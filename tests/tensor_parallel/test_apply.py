"""The tensor-parallel planner's decisions on blocks of many styles, and its error messages.

Single-process tests check what the planner *decides* from a trace; the spawned two-rank tests check that the
applied plan computes the same outputs and gradients as the unsharded block, and that a plan which cannot work
is refused at the check instead of training to wrong numbers.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn

from lightning_hybrid.tensor_parallel.dataflow import trace_block
from lightning_hybrid.tensor_parallel.block_plan import plan_block
from lightning_hybrid.tensor_parallel.overrides import resolve_overrides
from tests import block_zoo
from tests.block_zoo import HEADS
from tests.helpers import on_two_ranks
from tests.models import GPTConfig, GPTBlock, LlamaBlock, LlamaConfig, rope_tables


def _first_choice(block: nn.Module, *args: torch.Tensor, tp: int = 2, overrides: dict | None = None) -> list:
    trace = trace_block(block, args, {})
    _, candidates = plan_block(block, trace, tp, overrides)
    return [options[0] for options in candidates]


def _x() -> torch.Tensor:
    return torch.randn(2, 8, block_zoo.DIM)


def test_gpt_block_fused_qkv_gets_strided_whole_heads() -> None:
    block = GPTBlock(GPTConfig())
    attention, mlp = _first_choice(block, torch.randn(2, 8, 32))
    assert attention.columns == {"attn.qkv": attention.columns["attn.qkv"]}
    assert attention.columns["attn.qkv"].split_factor == 3
    assert attention.rows == ["attn.proj"]
    assert sorted(attention.scaled_attributes) == [("attn", "embed_dim"), ("attn", "num_heads")]
    assert list(mlp.columns) == ["mlp.fc_in"] and mlp.rows == ["mlp.fc_out"]
    assert mlp.columns["mlp.fc_in"].split_factor == 1 and mlp.scaled_attributes == []


def test_llama_block_pairs_separate_projections_and_scales_both_head_counts() -> None:
    config = LlamaConfig()
    block = LlamaBlock(config)
    rope = rope_tables(8, config.dim // config.n_heads, config.rope_theta)
    attention, mlp = _first_choice(block, torch.randn(2, 8, config.dim), rope)
    assert list(attention.columns) == ["attention.wq", "attention.wk", "attention.wv"]
    assert all(shard.split_factor == 1 for shard in attention.columns.values())
    assert attention.rows == ["attention.wo"]
    # head_dim must stay: it is the size of one head, not a count of them.
    assert sorted(attention.scaled_attributes) == [("attention", "n_heads"), ("attention", "n_kv_heads")]
    assert list(mlp.columns) == ["feed_forward.w1", "feed_forward.w3"] and mlp.rows == ["feed_forward.w2"]


def test_timm_reshape_into_three_by_heads_is_strided_by_three() -> None:
    attention, _ = _first_choice(block_zoo.build("timm"), _x())
    assert attention.columns["attn.qkv"].split_factor == 3
    assert attention.scaled_attributes == [("attn", "num_heads")]


def test_config_object_attributes_are_found() -> None:
    attention, _ = _first_choice(block_zoo.build("litgpt"), _x())
    assert attention.columns["attn.attn"].split_factor == 3
    assert ("attn.config", "n_head") in attention.scaled_attributes
    assert ("attn.config", "head_size") not in attention.scaled_attributes


def test_hugging_face_style_pairs_projections_and_offers_leaving_group_counts_alone() -> None:
    block = block_zoo.build("hf")
    _, candidates = plan_block(block, trace_block(block, (_x(),), {}), 2)
    attention = candidates[0]
    assert list(attention[0].columns) == ["attn.q_proj", "attn.k_proj", "attn.v_proj"]
    assert attention[0].rows == ["attn.o_proj"]
    # num_key_value_groups (2) equals the kv head count (2) by value: both "rescale" and "keep" get tried.
    assert [group.scaled_attributes for group in attention] == [[("attn", "num_key_value_groups")], [], []]
    # ... and last, the weights sharded with the activations between them gathered (nothing rescaled).
    assert [group.gathered for group in attention] == [False, False, True]


def test_parallel_attention_and_mlp_block() -> None:
    attention, mlp = _first_choice(block_zoo.build("parallel"), _x())
    assert attention.rows == ["attn.proj"] and mlp.rows == ["mlp.down"]


def test_third_linear_of_a_chain_is_sharded_alone_with_its_output_gathered() -> None:
    _, mlp, third = _first_choice(block_zoo.build("three_layer_mlp"), _x())
    assert list(mlp.columns) == ["mlp.up"] and mlp.rows == ["mlp.mid"] and not mlp.gathered
    assert (list(third.columns), third.rows, third.gathered) == (["mlp.down"], [], True)


def test_user_override_replicate_removes_a_pair() -> None:
    groups = _first_choice(block_zoo.build("timm"), _x(), overrides={"attn.qkv": "replicate", "attn.proj": "replicate"})
    assert [group.rows for group in groups] == [["mlp.down"]]


class _DiagonalGate(nn.Module):
    """A 2-D parameter that is not applied as a linear map (its diagonal scales the features)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(block_zoo.DIM, block_zoo.DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.diagonal()


def test_matrix_parameter_outside_linear_layers_is_refused_with_the_plan_entry_that_fixes_it() -> None:
    block = nn.Sequential(nn.Linear(block_zoo.DIM, block_zoo.DIM), _DiagonalGate(), nn.Linear(block_zoo.DIM, block_zoo.DIM))
    with pytest.raises(ValueError, match=r"cannot shard _DiagonalGate '1'.*tp_plan=\{'\*\.1': 'replicate'\}"):
        _first_choice(block, _x())


def test_a_layer_stored_transposed_is_paired_like_a_linear() -> None:
    """Conv1D-style layers (weight (in, out), applied as x @ w) are found by the shapes they map."""
    group = next(g for g in _first_choice(block_zoo.build("conv1d"), _x()) if "mlp.c_fc" in g.columns)
    assert (list(group.columns), group.rows, group.transposed) == (["mlp.c_fc"], ["mlp.c_proj"],
                                                                   {"mlp.c_fc", "mlp.c_proj"})


def test_tp_not_dividing_heads_leaves_only_the_gathered_layout() -> None:
    """4 heads over 8 ranks: no rank can hold whole heads, but the widths divide: the weights are sharded and the
    attention runs on the gathered q|k|v."""
    block = block_zoo.build("timm")
    _, candidates = plan_block(block, trace_block(block, (_x(),), {}), 8)
    attention = candidates[0]
    assert [(list(group.columns), group.rows, group.gathered) for group in attention] == [
        (["attn.qkv"], ["attn.proj"], True)]


def test_tp_not_dividing_a_width_names_the_layer() -> None:
    block = block_zoo.SequentialBlock(block_zoo.HFAttention(), block_zoo.GeluMLP())
    block.mlp.up, block.mlp.down = nn.Linear(32, 36), nn.Linear(36, 32)
    with pytest.raises(ValueError, match=r"'mlp.up': it has 36 output features") as caught:
        _first_choice(block, _x(), tp=8)
    assert caught.value.modules == ("mlp.up", "mlp.down")  # type: ignore[attr-defined]


def test_fused_projection_with_unequal_pieces_deals_query_heads_and_their_key_value_groups() -> None:
    attention, _ = _first_choice(block_zoo.build("fused_gqa"), _x())
    shard = attention.columns["attn.qkv"]
    assert shard.heads == ((32, 4), (16, 2), (16, 2))  # (width, heads) of q, k, v
    # rank 1 of 2: query heads 2-3 (rows 16:32), key group 1 (rows 40:48), value group 1 (rows 56:64)
    assert shard.spans(1, 2) == ((16, 32), (40, 48), (56, 64))
    assert sorted(attention.scaled_attributes) == [("attn", "n_head"), ("attn", "n_kv")]


def test_sliced_fused_projection_is_cut_where_the_forward_slices_it() -> None:
    """Phi-3: ``qkv[..., :query_pos]`` slices, the query width read from a config object; ``chunk(2)`` gate|up."""
    attention, mlp = _first_choice(block_zoo.build("phi3"), _x())
    assert attention.columns["attn.qkv_proj"].heads == ((32, 4), (16, 2), (16, 2))
    assert {("attn.config", "num_attention_heads"), ("attn", "num_key_value_heads")} <= set(attention.scaled_attributes)
    assert mlp.columns["mlp.gate_up_proj"].split_factor == 2 and mlp.rows == ["mlp.down_proj"]


@pytest.mark.parametrize("tp", [2, 4])
def test_fewer_key_value_heads_than_ranks_share_the_head(tp: int) -> None:
    attention, _ = _first_choice(block_zoo.build("mqa"), _x(), tp=tp)
    assert attention.columns["attn.q_proj"].heads == ()  # query heads: an even shard
    key = attention.columns["attn.k_proj"]
    assert key.heads == ((8, 1),) and {key.spans(rank, tp) for rank in range(tp)} == {((0, 8),)}
    # 4 query heads per key/value head become 4/tp on each rank; the key/value head count (1) stays
    assert attention.scaled_attributes == [("attn", "num_key_value_groups")]
    assert attention.per_rank(HEADS, tp) == HEADS // tp


def test_key_value_groups_fewer_than_ranks_go_to_the_ranks_of_their_query_heads() -> None:
    block = block_zoo.build("fused_gqa")  # 4 query heads, 2 key/value groups, at tp=4
    attention, _ = _first_choice(block, _x(), tp=4)
    shard = attention.columns["attn.qkv"]
    assert [shard.spans(rank, 4)[1] for rank in range(4)] == [(32, 40), (32, 40), (40, 48), (40, 48)]
    assert attention.per_rank(2, 4) == 1  # n_kv: one group per rank


def test_plan_patterns_must_match_and_name_a_style() -> None:
    names = ["model", "model.blocks.0.attn.qkv", "model.blocks.1.attn.qkv"]
    assert resolve_overrides({"model.blocks.*.attn.qkv": "replicate"}, names) == {
        "model.blocks.0.attn.qkv": "replicate", "model.blocks.1.attn.qkv": "replicate"}
    with pytest.raises(ValueError, match="matches no module"):
        resolve_overrides({"model.layers.*.wq": "colwise"}, names)
    with pytest.raises(ValueError, match="is not a style: use one of colwise, rowwise, replicate"):
        resolve_overrides({"model.blocks.*.attn.qkv": "columnwise"}, names)


# ------------------------------------------------------------------------------------------- two-rank checks
def _sharded_vs_unsharded(rank: int, results: dict, style: str, tp_plan: dict, strict: bool = False,
                          outputs_used: tuple[bool, ...] | None = None) -> None:
    """Apply the automatic plan on 2 ranks and measure output/gradient differences against the whole block (its
    first output where ``outputs_used`` says the step drops the others)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.probe.blocks import BlockList
    from lightning_hybrid.tensor_parallel.apply import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    root = nn.Module()
    root.blocks = nn.ModuleList([block_zoo.build(style)])
    reference = copy.deepcopy(root.blocks[0])
    x = torch.randn(2, 8, block_zoo.DIM, generator=torch.Generator().manual_seed(1))
    plan = apply_tensor_parallel(root, "blocks", BlockList("blocks", root.blocks), {0: ((x,), {})}, mesh,
                                 tp_plan=tp_plan, verify=True, strict=strict,
                                 outputs_used={0: outputs_used} if outputs_used else None)
    sharded = root.blocks[0]
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_ref, out_tp = reference(x_ref), sharded(x_tp)
    if outputs_used:
        out_ref, out_tp = out_ref[0], out_tp[0]
    (out_ref.square().sum()).backward()
    (out_tp.square().sum()).backward()
    grad_error = 0.0
    for (name, p_ref), (_, p_tp) in zip(reference.named_parameters(), sharded.named_parameters()):
        grad = p_tp.grad.full_tensor() if isinstance(p_tp.grad, DTensor) else p_tp.grad
        grad_error = max(grad_error, float((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()))
    sharded_params = sum(isinstance(p, DTensor) for p in sharded.parameters())
    if rank == 0:
        results.update(
            output=float((out_tp - out_ref).detach().abs().max() / out_ref.abs().max()),
            input_grad=float((x_tp.grad - x_ref.grad).abs().max() / x_ref.grad.abs().max()),
            param_grad=grad_error,
            sharded_params=sharded_params,
            plan=plan,
        )


def _run_two_ranks(style: str, tp_plan: dict | None = None) -> dict:
    return on_two_ranks(_sharded_vs_unsharded, style, tp_plan or {})


@pytest.mark.slow
@pytest.mark.parametrize("style", ["timm", "litgpt", "hf", "parallel", "three_layer_mlp", "fused_gqa", "phi3",
                                   "phi3_mqa", "mqa", "grouped_qkv"])
def test_applied_plan_matches_unsharded_block_in_output_and_gradients(style: str) -> None:
    results = _run_two_ranks(style)
    assert results["output"] < 1e-5
    assert results["input_grad"] < 1e-5
    assert results["param_grad"] < 1e-5
    assert results["sharded_params"] >= 3  # something really was sharded


@pytest.mark.slow
def test_fused_projection_laid_out_per_key_value_group_is_sharded_by_whole_groups() -> None:
    """q q k v | q q k v: a contiguous half of the rows is one whole group, its head count read from n_kv."""
    results = _run_two_ranks("grouped_qkv")
    assert results["plan"]["blocks.*.attn.query_key_value"] == "colwise"
    assert results["plan"]["blocks.*.attn.n_kv"] == "÷tp" and "blocks.*.attn.per_group" not in results["plan"]
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_state_space_mixer_is_sharded_per_channel_of_its_inner_dimension() -> None:
    """Megatron's Mamba layout, found by data flow: in_proj by x|z pieces, the depthwise conv (its groups), A_log,
    D and dt_proj per channel, x_proj a row whose reduced output (dt|B|C, read by every channel) gets its gradient
    summed, dt_proj leaving its input gradient partial, out_proj a row."""
    results = _run_two_ranks("selective_scan")
    plan = {key.removeprefix("blocks.*.attn."): style for key, style in results["plan"].items()}
    assert plan["in_proj"] == "colwise (strided x2)" and plan["x_proj"] == plan["out_proj"] == "rowwise"
    assert plan["dt_proj"] == "colwise (input gradient summed at its source)"
    assert {plan[name] for name in ("conv1d.weight", "conv1d.bias", "A_log", "D")} == {"per head (dim 0)"}
    assert plan["inner"] == "÷tp"
    (structure,) = results["plan"].structures
    assert structure.kept_whole == () and structure.fraction > 0.95
    assert results["output"] < 1e-5 and results["input_grad"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_outputs_the_step_drops_do_not_keep_the_attention_from_being_sharded_by_heads() -> None:
    """A decoder layer returning its attention probabilities (the model drops them): planned and checked on the
    hidden states only, the attention is sharded by heads, not gathered."""
    results = on_two_ranks(_sharded_vs_unsharded, "returns_scores", {}, False, (True, False))
    assert results["plan"]["blocks.*.attn.qkv"] == "colwise (strided x3)"
    assert results["plan"]["blocks.*.attn.proj"] == "rowwise"
    assert results["output"] < 1e-5 and results["input_grad"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_an_attribute_that_only_matches_a_size_is_not_rescaled() -> None:
    results = _run_two_ranks("windowed")
    assert results["plan"]["blocks.*.attn.q_proj"] == "colwise" and "blocks.*.attn.sliding_window" not in results["plan"]
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_user_styles_inside_blocks_win_over_the_automatic_choice() -> None:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel

    # The up projection sharded with its output gathered again, so the down layer runs whole.
    tp_plan = {"blocks.*.mlp.up": ColwiseParallel(output_layouts=Replicate()), "blocks.*.mlp.down": "replicate"}
    results = _run_two_ranks("timm", tp_plan)
    assert results["plan"]["blocks.*.mlp.up"] == "ColwiseParallel"
    assert "blocks.*.mlp.down" not in results["plan"]
    assert results["plan"]["blocks.*.attn.qkv"] == "colwise (strided x3)"
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_wrong_user_style_is_caught_by_the_check() -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel

    # Sharded output fed to a whole down layer: the check must refuse it and name the user's layer (a style the
    # user gave is never dropped to keep the block whole).
    tp_plan = {"blocks.*.mlp.up": ColwiseParallel(), "blocks.*.mlp.down": "replicate"}
    with pytest.raises(Exception, match=r"full plan changes the block's output.*'mlp.up'"):
        _run_two_ranks("timm", tp_plan)


def _refused_when_strict_else_kept_whole(rank: int, results: dict, style: str) -> None:
    from lightning_hybrid.tensor_parallel.refusal import PlanCheckFailed

    try:
        _sharded_vs_unsharded(rank, results, style, {}, strict=True)
    except PlanCheckFailed as refusal:
        results["refusal"] = str(refusal)
    _sharded_vs_unsharded(rank, results, style, {})


@pytest.mark.slow
def test_plan_that_changes_the_output_is_refused_with_the_fix_when_strict_else_kept_whole() -> None:
    # The MLP reads its up layer's weight outside the layer's call: no sharding of it computes the same. The
    # attention derives its head size from the input width (nanoGPT), which stays global: no rank can compute a
    # share of the heads, so its weights are sharded with q|k|v gathered.
    results = on_two_ranks(_refused_when_strict_else_kept_whole, "weight_normalized")
    assert re.search(r"plan check failed for SequentialBlock.*'blocks\.\*\.mlp\.up': 'replicate'",
                     results["refusal"])
    # by default the MLP stays whole on both ranks, the attention is sharded, and the block computes the same
    (structure,) = results["plan"].structures
    assert structure.kept_whole[0].modules == ("mlp.up", "mlp.down")
    assert structure.kept_whole[0].reason.startswith("the plan check: sharding them changes the block's output")
    assert results["plan"]["blocks.*.attn.c_attn"] == "colwise (output gathered)"
    assert results["plan"]["blocks.*.attn.c_proj"] == "rowwise (input whole)" and "blocks.*.mlp.up" not in results["plan"]
    assert results["output"] < 1e-5 and results["input_grad"] < 1e-5 and results["param_grad"] < 1e-5


def _plan_on_meta(rank: int, results: dict, style: str) -> None:
    """Plan and check a block that only exists on the meta device (the check materializes a copy of it)."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.probe.blocks import BlockList
    from lightning_hybrid.tensor_parallel.apply import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    root = nn.Module()
    with torch.device("meta"):
        root.blocks = nn.ModuleList([block_zoo.build(style)])
        x = torch.empty(2, 8, block_zoo.DIM)
    plan = apply_tensor_parallel(root, "blocks", BlockList("blocks", root.blocks), {0: ((x,), {})}, mesh, tp_plan={}, verify=True)
    if rank == 0:
        results.update(plan=plan, still_meta=all(p.is_meta for p in root.blocks.parameters()))


@pytest.mark.slow
def test_plan_check_works_for_a_meta_device_model() -> None:
    results = on_two_ranks(_plan_on_meta, "timm")
    assert results["still_meta"]  # nothing but the checked copy was materialized
    assert results["plan"]["blocks.*.attn.qkv"] == "colwise (strided x3)"
    assert results["plan"]["blocks.*.attn.num_heads"] == "÷tp"
    assert results["plan"]["blocks.*.mlp.down"] == "rowwise"


def test_plan_entries_inside_blocks_must_cover_every_block() -> None:
    from lightning_hybrid.tensor_parallel.overrides import _per_block_overrides

    overrides = {"blocks.0.attn.qkv": "replicate", "blocks.1.attn.qkv": "replicate", "head": "colwise"}
    assert _per_block_overrides(overrides, ("blocks.0", "blocks.1")) == {"attn.qkv": "replicate"}
    with pytest.raises(ValueError, match=r"must treat every block of one structure alike.*'blocks\.\*\.attn\.qkv'"):
        _per_block_overrides({"blocks.1.attn.qkv": "replicate"}, ("blocks.0", "blocks.1"))


def test_key_value_heads_fewer_than_ranks_are_shared_by_the_ranks_of_their_query_heads() -> None:
    config = LlamaConfig()  # 4 query heads, 2 key/value heads, at tp=4
    block = LlamaBlock(config)
    rope = rope_tables(8, config.dim // config.n_heads, config.rope_theta)
    attention, _ = _first_choice(block, torch.randn(2, 8, config.dim), rope, tp=4)
    key = attention.columns["attention.wk"]
    assert key.heads == ((16, 2),) and [key.spans(rank, 4) for rank in range(4)] == [((0, 8),)] * 2 + [((8, 16),)] * 2
    assert attention.per_rank(config.n_kv_heads, 4) == 1 and attention.per_rank(config.n_heads, 4) == 1


def test_tp_not_dividing_query_heads_shards_the_weights_with_the_heads_gathered() -> None:
    config = LlamaConfig()
    rope = rope_tables(8, config.dim // config.n_heads, config.rope_theta)
    attention, mlp = _first_choice(LlamaBlock(config), torch.randn(2, 8, config.dim), rope, tp=8)
    assert (list(attention.columns), attention.rows, attention.gathered) == (
        ["attention.wq", "attention.wk", "attention.wv"], ["attention.wo"], True)
    assert not mlp.gathered and attention.scaled_attributes == []
