"""Tensor parallelism on third-party model code, unmodified: Hugging Face models built from configs are sharded
on spawned ranks and compared, logits and every gradient, with the whole model; the planner's decisions on
mixture-of-experts layers and on block lists whose blocks differ."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.tensor_parallel.dataflow import trace_block
from lightning_hybrid.tensor_parallel.block_plan import plan_block
from tests import block_zoo
from tests.helpers import on_ranks
from tests.tensor_parallel.test_apply import _first_choice


# ------------------------------------------------------------------------------- third-party code, unmodified
def _hugging_face_model(name: str) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=64, num_hidden_layers=2, use_cache=False, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    kind, _, variant = name.partition("_")
    if variant == "mqa":  # one key/value head
        common["num_key_value_heads"] = 1
    if variant == "wide":  # other widths and head counts: 8 query heads in 4 key/value groups, head size 8
        common.update(hidden_size=64, intermediate_size=96, num_attention_heads=8, num_key_value_heads=4)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_embd=32, n_head=4, n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0,
                                         attn_pdrop=0.0, vocab_size=64, num_hidden_layers=2, use_cache=False)
        return transformers.GPT2LMHeadModel(config)
    config_class, model_class = {  # qwen2: q/k/v projections with bias; phi3: fused qkv_proj and gate_up_proj
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
    }[kind]
    experts = 8 if variant == "wide" else 4
    extra = {"num_local_experts": experts, "num_experts_per_tok": 2} if kind == "mixtral" else {}
    return model_class(config_class(**common, **extra))


def _hugging_face_vs_unsharded(rank: int, results: dict, name: str, tp_plan: dict) -> None:
    """Shard a whole Hugging Face model's blocks on 2 ranks; compare logits and gradients with the original."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step
    from lightning_hybrid.tensor_parallel.apply import apply_tensor_parallel

    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    model = _hugging_face_model(name)
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    path, blocks = find_block_list(model)
    record = record_step(model, blocks, lambda: model(idx))
    plan = apply_tensor_parallel(model, path, blocks, record.block_calls, mesh, tp_plan=tp_plan, verify=True)
    out_ref, out_tp = reference(idx).logits, model(idx).logits
    out_ref.square().mean().backward()
    out_tp.square().mean().backward()
    grad_error = 0.0
    for (_, p_ref), (_, p_tp) in zip(reference.named_parameters(), model.named_parameters()):
        grad = p_tp.grad.full_tensor() if isinstance(p_tp.grad, DTensor) else p_tp.grad
        grad_error = max(grad_error, float((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()))
    if rank == 0:
        results.update(plan=plan, output=float((out_tp - out_ref).detach().abs().max() / out_ref.abs().max()),
                       param_grad=grad_error)


def _run_hugging_face(name: str, tp_plan: dict | None = None, tp: int = 2) -> dict:
    return on_ranks(tp, _hugging_face_vs_unsharded, name, tp_plan or {})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_hugging_face_models_are_planned_unmodified(name: str) -> None:
    results = _run_hugging_face(name)
    plan = results["plan"]
    assert [plan[f"model.layers.*.self_attn.{p}_proj"] for p in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert [plan[f"model.layers.*.mlp.{p}_proj"] for p in ("gate", "up", "down")] == ["colwise"] * 2 + ["rowwise"]
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


@pytest.mark.slow
def test_gpt2_conv1d_layers_are_sharded_through_their_transposed_weights() -> None:
    """Hugging Face's Conv1D stores its weight (in, out) and computes x @ w: found by the shapes it maps, its fused
    c_attn dealt whole heads of q, k and v (strided over the weight's columns), c_proj and the MLP paired."""
    results = _run_hugging_face("gpt2")
    plan = results["plan"]
    assert plan["transformer.h.*.attn.c_attn"] == "colwise (strided x3)"
    assert plan["transformer.h.*.attn.c_proj"] == plan["transformer.h.*.mlp.c_proj"] == "rowwise"
    assert plan["transformer.h.*.mlp.c_fc"] == "colwise"
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


#: Model, tp → layers whose plan entry is asserted.
GROUPED_QUERY_AND_EXPERTS = {
    ("phi3", 2): {"self_attn.qkv_proj": "colwise (heads 4 | 2 | 2)", "mlp.gate_up_proj": "colwise (strided x2)"},
    ("qwen2_mqa", 2): {"self_attn.k_proj": "colwise (heads 1)", "self_attn.q_proj": "colwise"},
    ("llama", 4): {"self_attn.k_proj": "colwise (heads 2)", "self_attn.q_proj": "colwise"},
    # every expert keeps all experts, sharded along each one's hidden width (gate and up halves dealt apart)
    ("mixtral", 2): {"mlp.experts": "experts (gate_up_proj dim 1 (strided x2), down_proj dim 2)"},
    # the same families in other configurations
    ("phi3_mqa", 2): {"self_attn.qkv_proj": "colwise (heads 4 | 1 | 1)"},
    ("phi3_wide", 4): {"self_attn.qkv_proj": "colwise (heads 8 | 4 | 4)"},
    ("qwen2_wide", 4): {"self_attn.k_proj": "colwise"},
    ("mixtral_wide", 4): {"mlp.experts": "experts (gate_up_proj dim 1 (strided x2), down_proj dim 2)"},
}


@pytest.mark.slow
@pytest.mark.parametrize(("name", "tp"), list(GROUPED_QUERY_AND_EXPERTS))
def test_grouped_query_attention_and_experts_train_like_the_whole_model(name: str, tp: int) -> None:
    """Phi-3's fused q|k|v of unequal pieces (and fused gate|up), one key/value head at tp=2, two at tp=4,
    Mixtral's stacked experts (its router kept whole)."""
    results = _run_hugging_face(name, tp=tp)
    for layer, style in GROUPED_QUERY_AND_EXPERTS[(name, tp)].items():
        assert results["plan"][f"model.layers.*.{layer}"] == style
    assert results["output"] < 1e-5 and results["param_grad"] < 1e-5


# ------------------------------------------------------------------------------- mixture of experts, mixed blocks
def test_blocks_that_differ_in_structure_are_found_as_one_list_and_planned_apart() -> None:
    from lightning_hybrid.probe.blocks import block_structures, find_block_list
    from lightning_hybrid.probe.record import record_step
    from tests.zoo_mixed import MixedConfig, MixedLM

    model = MixedLM(MixedConfig())
    path, blocks = find_block_list(model)  # not a block's list of experts
    assert path == "blocks" and block_structures(blocks) == [[0, 2], [1, 3]]
    args, kwargs = record_step(model, blocks, lambda: model(torch.randint(0, 64, (2, 16)))).block_calls[1]
    groups = _first_choice(blocks[1], *args)
    pairs = [(list(group.columns), group.rows) for group in groups]
    # every expert's MLP is a column/row pair; the router's logits choose experts (top-k): it stays whole
    assert (["experts.3.up"], ["experts.3.down"]) in pairs
    assert not any("router" in name for group in groups for name in group.layers)
    assert trace_block(blocks[1], args, kwargs).selected == {"router"}


def test_stacked_expert_weights_are_sharded_along_each_experts_hidden_width() -> None:
    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step
    from lightning_hybrid.tensor_parallel.experts import expert_layouts, holds_expert_stack

    model = _hugging_face_model("mixtral")
    _, blocks = find_block_list(model)
    args, kwargs = record_step(model, blocks, lambda: model(torch.randint(0, 64, (2, 8)))).block_calls[0]
    trace = trace_block(blocks[0], args, kwargs)
    assert trace.opaque == {"mlp.gate"}  # the router returns logits, scores and indices: kept whole
    experts = blocks[0].mlp.experts
    assert holds_expert_stack(experts) and not holds_expert_stack(blocks[0].mlp.gate)
    layouts = expert_layouts(experts, stream_widths={32}, tp=2)
    # (E, 2I, D) and (E, D, I): only the hidden dimensions, one projection or fused gate|up halves
    assert (("gate_up_proj", 1, 2), ("down_proj", 2, 1)) in layouts
    assert all(dim != 0 for layout in layouts for _, dim, _ in layout)
    _, candidates = plan_block(blocks[0], trace, 2)
    assert [group.name for group in candidates[-1]] == ["mlp.experts"] * len(candidates[-1])
    with pytest.raises(ValueError, match=r"tp=3 does not divide the experts' hidden width.*'\*\.mlp\.experts'"):
        plan_block(blocks[0], trace, 3, {f"self_attn.{p}_proj": "replicate" for p in "qkvo"})


def test_experts_with_biases_shard_the_first_bias_and_add_the_last_one_once() -> None:
    """GPT-OSS: ``gate_up_proj`` (E, D, 2I) with interleaved gate|up columns, ``gate_up_proj_bias`` (E, 2I),
    ``down_proj`` (E, I, D), ``down_proj_bias`` (E, D); the last bias is added to partial sums, so by one rank."""
    from lightning_hybrid.tensor_parallel.experts import ONCE, expert_layouts
    from tests.zoo_hf import hugging_face_gpt_oss

    experts = hugging_face_gpt_oss({}).model.layers[0].mlp.experts
    layouts = expert_layouts(experts, stream_widths={32}, tp=2)
    assert (("gate_up_proj", 2, 1), ("gate_up_proj_bias", 1, 1), ("down_proj", 1, 1),
            ("down_proj_bias", ONCE, 1)) in layouts
    # only a stacked bias (2-D) may be kept whole: a layout computing everything on one rank is never offered
    assert all(dim != ONCE for layout in layouts for name, dim, _ in layout if name in ("gate_up_proj", "down_proj"))


def test_parameters_held_per_head_are_found_by_shape() -> None:
    from lightning_hybrid.tensor_parallel.per_head import head_counts, holds_tables_per_head, per_head_parameters
    from tests.zoo_hf import hugging_face_gpt_oss

    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step

    model = hugging_face_gpt_oss({})  # 4 heads of 8: sinks (4,) on the attention module itself
    _, blocks = find_block_list(model)
    args, kwargs = record_step(model, blocks, lambda: model(torch.randint(0, 64, (2, 8)))).block_calls[0]
    trace = trace_block(model.model.layers[0], args, kwargs)
    assert head_counts(trace) == {4, 2}  # q's heads, k's and v's
    called = {*trace.linears, *trace.module_inputs}
    found = per_head_parameters(model.model.layers[0], "self_attn", {4}, 2, set(trace.linears), called)
    assert found == [("self_attn", "sinks", 0)]
    assert per_head_parameters(model.model.layers[0], "self_attn", {4}, 8, set(trace.linears), called) == []  # 8 ∤ 4
    table = nn.Module()  # a position table (9 positions × 4 heads) is no unknown matrix; a 9 × 9 one is
    table.bias_table = nn.Parameter(torch.zeros(9, 4))
    assert holds_tables_per_head(table, {4}) and not holds_tables_per_head(table, {2})


def test_latent_attention_keeps_its_down_projections_whole_and_shards_the_up_projections_by_heads() -> None:
    """DeepSeek-V3's multi-head latent attention: q_a and kv_a (width 32 → 16, 32 → 16 + 4 rotary) are read by
    their up-projections q_b and kv_b, which are the columns; the rotary key part of kv_a is read by every head
    directly, so kv_a's output gradient is summed once over the ranks, kv_b leaves its input gradient partial, and
    the norm between them sums its weight's gradient. A multi-query k/v projection is no latent one."""
    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step
    from tests.zoo_hf import hugging_face_deepseek_v3

    model = hugging_face_deepseek_v3({})
    _, blocks = find_block_list(model)
    args, kwargs = record_step(model, blocks, lambda: model(torch.randint(0, 64, (2, 8)))).block_calls[0]
    _, candidates = plan_block(blocks[0], trace_block(blocks[0], args, kwargs), 2)
    attention = candidates[0][0]
    assert (list(attention.columns), attention.rows) == (["self_attn.q_b_proj", "self_attn.kv_b_proj"],
                                                         ["self_attn.o_proj"])
    assert attention.whole_inputs == ["self_attn.kv_a_proj_with_mqa"] and not attention.gathered
    assert attention.partial_inputs == {"self_attn.kv_b_proj"}
    assert attention.summed_modules == ["self_attn.kv_a_layernorm"]
    alone = [group[0].layers for group in candidates if group[0].gathered and not group[0].rows]
    assert ["self_attn.q_a_proj"] in alone and ["self_attn.kv_a_proj_with_mqa"] in alone
    mqa = _first_choice(block_zoo.build("mqa"), torch.randn(2, 8, 32))
    assert not any(group.gathered for group in mqa)


def test_an_experts_hidden_width_equal_to_the_models_is_a_layout_to_check_and_a_convolution_holds_no_experts() -> None:
    from lightning_hybrid.tensor_parallel.experts import expert_layouts, holds_expert_stack

    experts = nn.Module()  # Qwen3-MoE's layout with its hidden width equal to the model's (32)
    experts.gate_up_proj = nn.Parameter(torch.zeros(4, 64, 32))
    experts.down_proj = nn.Parameter(torch.zeros(4, 32, 32))
    layouts = expert_layouts(experts, stream_widths={32}, tp=2)
    assert (("gate_up_proj", 1, 2), ("down_proj", 2, 1)) in layouts
    assert layouts[0][0][1] == 1  # the dimension of another size than the model's first
    assert not holds_expert_stack(nn.Conv1d(8, 8, 4, groups=8))  # Mamba's depthwise convolution
