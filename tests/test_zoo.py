"""The model zoo (``tests/zoo.py``): every family trains under every layout its sizes allow to the numbers of
single-process Lightning. One launch per layout trains all its families (``--sweep`` entries name the model), and
one launch per data-parallel size computes all their references; every run is the harness's short one
(``SHORT_RUN``: 4 steps over an epoch boundary)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.parallel.parallelize import find_blocks
from tests.helpers import SHORT_RUN, assert_equivalent, cached_runs, param_extended_if, run_sweep
from tests.models import build_module
from tests.zoo import VOCAB

RTOL = 1e-5
ZOO_LAUNCH_TIMEOUT_S = 1200
#: Layout → the harness's arguments for it and the data-parallel size its reference must reproduce.
LAYOUTS: dict[str, tuple[list[Any], int]] = {
    "dp2": (["--dp", 2, "--devices", 2], 2),
    "tp2": (["--tp", 2, "--devices", 2], 1),
    "pp2": (["--pp", 2, "--devices", 2], 1),
    "dp2_pp2": (["--dp", 2, "--pp", 2, "--devices", 4], 2),
    "tp2_pp2": (["--tp", 2, "--pp", 2, "--devices", 4], 1),
    "pp2_zbv": (["--pp", 2, "--devices", 2, "--strategy-kwargs", '{"pp_schedule": "zbv_zero_bubble"}'], 1),
    "dp2_tp2_pp2": (["--dp", 2, "--tp", 2, "--pp", 2, "--devices", 8], 2),
    # expert parallelism: the experts spread over the data-parallel ranks (with tensor or pipeline parallelism)
    "dp2_ep2": (["--dp", 2, "--devices", 2, "--strategy-kwargs", '{"ep": 2}'], 2),
    "dp2_tp2_ep2": (["--dp", 2, "--tp", 2, "--devices", 4, "--strategy-kwargs", '{"ep": 2}'], 2),
    "dp2_pp2_ep2": (["--dp", 2, "--pp", 2, "--devices", 4, "--strategy-kwargs", '{"ep": 2}'], 2),
}
#: Layouts whose launches run only with ``-m extended`` (4 and 8 ranks on 2 cores: about 10 minutes together); the
#: layouts they combine run in the default suite, and the 3-D layout on the test models there too.
EXTENDED_LAYOUTS = {"dp2_pp2", "pp2_zbv", "dp2_tp2_pp2"}
#: Family → the layouts it is trained under.
CASES: dict[str, tuple[str, ...]] = {
    "titan": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "flat": ("dp2",),
    "root_params": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "tied": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "pp2_zbv", "dp2_tp2_pp2"),
    "hf_gpt2": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "pp2_zbv", "dp2_tp2_pp2"),
    "fused_gqa": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_qwen2": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "pp2_zbv", "dp2_tp2_pp2"),
    "hf_phi3": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_mixtral": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2", "dp2_ep2", "dp2_tp2_ep2"),
    "hf_gpt_neox": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_bert": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "pp2_zbv", "dp2_tp2_pp2"),
    "hf_vit": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_t5_encoder": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "mixed_moe": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2", "dp2_ep2", "dp2_tp2_ep2",
                  "dp2_pp2_ep2"),
    "hf_qwen2_mqa": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_bart": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "diffusers_dit": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "hf_mamba": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "hf_deepseek_v3": ("dp2", "tp2", "pp2", "tp2_pp2", "dp2_ep2", "dp2_pp2_ep2"),
    "hf_qwen3_moe": ("dp2", "tp2", "pp2", "tp2_pp2", "dp2_ep2"),
    "hf_olmo2": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "hf_gpt_oss": ("dp2", "tp2", "pp2", "tp2_pp2", "dp2_ep2"),
    "hf_zamba2": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "hf_llama4": ("dp2", "tp2", "pp2", "tp2_pp2", "dp2_ep2"),
    "litgpt": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "hf_swin": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "peft_lora": ("dp2", "tp2", "pp2", "tp2_pp2"),
    "two_lists": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
    "encoder_decoder": ("dp2", "tp2", "pp2", "dp2_pp2", "tp2_pp2", "dp2_tp2_pp2"),
}


#: Families whose head is the token embedding's weight (one weight, sharded once).
TIED = {"tied", "hf_gpt2", "hf_qwen2", "hf_bert", "hf_mamba", "hf_zamba2"}
#: Families whose vocabulary stays whole over tp (the embedding is also read elsewhere: a decoder's input, a
#: conditioning; several embedding/head pairs), and one whose embedding alone is sharded (no head of its width).
VOCAB_WHOLE = {"hf_bart", "diffusers_dit", "two_lists", "encoder_decoder"}
EMBEDDING_ONLY = {"hf_swin"}
#: Families whose LightningModule also logs torchmetrics objects (``self.log("train_acc", self.train_acc)``).
WITH_METRICS = {"titan"}


#: Layout → extra entries of its launch, by name: a family trained with a strategy option (no launch of its own).
#: ``loss_parallel``: the tied head's logits stay sharded; ``train_loss`` is logged without sync_dist on this entry.
OPTION_ENTRIES: dict[str, dict[str, dict]] = {
    "tp2": {"hf_qwen2 loss_parallel": {"model": "hf_qwen2", "loss_parallel": True, "module": {"sync_loss": False}}},
}


def _entry(model: str) -> dict:
    return {"model": model, **({"module": {"log_metrics": True}} if model in WITH_METRICS else {})}


def _models_under(layout: str) -> list[str]:
    return [model for model, layouts in CASES.items() if layout in layouts]


@pytest.fixture(scope="session")
def zoo_references(tmp_path_factory: pytest.TempPathFactory):
    """``zoo_references(dp_size)``: ``{family: reference result}`` for every family, from one launch."""

    def run(dp_size: str, folder: Path) -> dict[str, dict]:
        models = list(CASES)
        results = run_sweep(["--reference", "--dp", dp_size, "--devices", 1, *SHORT_RUN,
                             "--out", folder / "reference.pt"],
                            [_entry(model) for model in models], nprocs_timeout=ZOO_LAUNCH_TIMEOUT_S)
        return dict(zip(models, results))

    return cached_runs(run, tmp_path_factory, "zoo_reference")


@pytest.fixture(scope="session")
def zoo_runs(tmp_path_factory: pytest.TempPathFactory):
    """``zoo_runs(layout)``: ``{family: result}`` for the families trained under ``layout``, from one launch."""

    def run(layout: str, folder: Path) -> dict[str, dict]:
        models = _models_under(layout)
        options = OPTION_ENTRIES.get(layout, {})
        # All families in one launch: up to 8 ranks on 2 cores training a dozen models takes minutes, so the
        # launch (and its references) trains the short run.
        results = run_sweep([*LAYOUTS[layout][0], *SHORT_RUN, "--out", folder / "run.pt"],
                            [_entry(model) for model in models] + list(options.values()),
                            nprocs_timeout=ZOO_LAUNCH_TIMEOUT_S)
        return dict(zip(models + list(options), results))

    return cached_runs(run, tmp_path_factory, "zoo")


def _cases(layout_filter=lambda layout: True) -> list:
    return [param_extended_if(layout in EXTENDED_LAYOUTS, model, layout)
            for model, layouts in CASES.items() for layout in layouts if layout_filter(layout)]


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), _cases())
def test_zoo_family_trains_like_single_device(model: str, layout: str, zoo_references, zoo_runs) -> None:
    reference = zoo_references(str(LAYOUTS[layout][1]))[model]
    result = zoo_runs(layout)[model]
    assert_equivalent(reference, result, rtol=RTOL)  # logged torchmetrics values included
    # The model summary counts the whole model as one process does: every stage, a weight tied across stages once.
    assert result["summary_parameters"] == reference["summary_parameters"]
    if model in WITH_METRICS:  # the comparison above covered them: make sure they were logged at all
        assert {"epoch:train_acc_epoch", "validation:val_acc"} <= result["metric_values"].keys()
        assert all(0 <= value <= 1 for values in result["metric_values"].values() for value in values)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), _cases(lambda layout: "tp" in layout))
def test_zoo_embedding_and_head_are_sharded_over_the_vocabulary(model: str, layout: str, zoo_runs) -> None:
    """Under tp the token embedding and the head hold a 1/tp slice of the vocabulary's rows (1/(tp·dp) with
    FSDP2's data sharding on top), tied pairs included, also held on the first and the last pipeline stage; the
    equivalence test above covers their numbers."""
    result = zoo_runs(layout)[model]
    vocab_styles = {name: style for name, style in result["tp_plan"].items() if "(vocab" in style}
    expected = [] if model in VOCAB_WHOLE else ["rowwise"] if model in EMBEDDING_ONLY else ["colwise", "rowwise"]
    # (several embedding modules may hold the one table: T5's ``shared`` and ``encoder.embed_tokens``)
    assert sorted({style.split()[0] for style in vocab_styles.values()}) == expected, result["tp_plan"]
    if not vocab_styles:
        return
    ranks = result["rank_local_shapes"]
    held = {name: [rank[f"{name}.weight"] for rank in ranks if f"{name}.weight" in rank] for name in vocab_styles}
    shards = 2 * LAYOUTS[layout][1]  # tp=2 × the data-parallel size
    for name, shapes in held.items():
        assert shapes and all(full[0] == VOCAB and local[0] * shards == VOCAB for local, full in shapes), (name, shapes)
    if model in TIED and "pp" in layout:  # one weight, held on the first and the last stage: a shard on every rank
        assert all(len(shapes) == len(ranks) for shapes in held.values()), held
    assert ("tied" in next(iter(vocab_styles.values()))) == (model in TIED)


#: Under tp2 every block structure of every family has at least this share of its parameters split over the tp
#: ranks (by heads, by experts, or with the activations gathered) ...
TP_SHARE = 0.85
#: ... except where a fused q|k|v has fewer key/value heads than q heads: its weight stays whole on every rank,
#: each rank computing its rows of it (sharing a layout of the weight by heads is impossible there).
TP_SHARE_LOWER = {"fused_gqa": 0.65, "hf_phi3": 0.75, "litgpt": 0.75}


#: How tp2 shards what the planner refused before (by structure; a pattern per family).
TP_STYLES = {
    # a norm over the whole q/k projection: DTensor computes it on the shards (its mean summed over the ranks)
    "hf_olmo2": {"model.model.layers.*.self_attn.q_proj": "colwise", "model.model.layers.*.self_attn.q_norm":
                 "SequenceParallel"},
    # a learned logit per head, a relative position table per head: sharded with the heads
    "hf_gpt_oss": {"model.model.layers.*.self_attn.sinks": "per head (dim 0)",
                   "model.model.layers.*.mlp.experts": "experts (gate_up_proj dim 2, gate_up_proj_bias dim 1,"
                                                       " down_proj dim 1, down_proj_bias whole (added by one rank))"},
    "hf_swin": {"model.swin.encoder.layers.0.blocks.0.attention.relative_position_bias.relative_position_bias_table":
                "per head (dim 1)", "model.swin.encoder.layers.0.blocks.0.attention.q_proj": "colwise"},
    # head sizes derived from the input width (no rank can compute a share of the heads): gathered
    "encoder_decoder": {"model.decoder.0.cross.k": "colwise (output gathered)",
                        "model.decoder.0.cross.out": "rowwise (input whole)"},
    # latent attention: the up-projections by heads, the down-projections sharded alone (their output gathered)
    "hf_deepseek_v3": {"model.model.layers.1.self_attn.kv_a_proj_with_mqa": "colwise (output gathered)",
                       "model.model.layers.1.self_attn.kv_b_proj": "colwise (input gradient summed at its source)",
                       "model.model.layers.1.self_attn.kv_a_layernorm": "whole (gradient summed over tp)",
                       "model.model.layers.1.self_attn.o_proj": "rowwise"},
    # a state-space mixer per channel of its inner dimension (Megatron's layout); an adaLN modulation sharded alone
    "hf_mamba": {"model.backbone.layers.*.mixer.in_proj": "colwise (strided x2)",
                 "model.backbone.layers.*.mixer.x_proj": "rowwise",
                 "model.backbone.layers.*.mixer.conv1d.weight": "per head (dim 0)",
                 "model.backbone.layers.*.mixer.dt_proj.weight": "per head (dim 0)",
                 "model.backbone.layers.*.mixer.A_log": "per head (dim 0)"},
    "diffusers_dit": {"model.dit.transformer_blocks.*.norm1.linear": "colwise (output gathered)"},
    # a block every hybrid layer holds (its weights tied across them): sharded once, by heads
    "hf_zamba2": {"model.model.layers.1.shared_transformer.self_attn.q_proj": "colwise",
                  "model.model.layers.3.shared_transformer.self_attn.o_proj": "rowwise"},
    # the shared expert's output, changed in place by the routed experts' (add_), sharded with the others
    "hf_llama4": {"model.model.layers.1.feed_forward.shared_expert.down_proj": "rowwise"},
}


@pytest.mark.slow
def test_a_block_module_held_where_it_is_called_is_reported_kept_whole(zoo_runs) -> None:
    """DiT calls ``transformer_blocks[0].norm1.emb`` after the trunk: under pp the last stage holds it too, so every
    block's embedder stays whole over tp — and the report says so, with what it costs."""
    first = zoo_runs("tp2_pp2")["diffusers_dit"]["tp_plan"].structures[0]
    held = first.kept_whole[0]
    assert held.modules and all(name.startswith("norm1.emb.") for name in held.modules)
    assert held.reason.startswith("the step calls them from outside their block") and first.extra_bytes > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", list(TP_STYLES))
def test_zoo_tp_shards_by_structure_what_was_refused(model: str, zoo_runs) -> None:
    plan = zoo_runs("tp2")[model]["tp_plan"]
    assert {name: plan.get(name) for name in TP_STYLES[model]} == TP_STYLES[model]


@pytest.mark.slow
@pytest.mark.parametrize("model", [model for model, layouts in CASES.items() if "tp2" in layouts])
def test_zoo_tp_shards_most_of_every_block_structure(model: str, zoo_runs) -> None:
    structures = zoo_runs("tp2")[model]["tp_plan"].structures
    assert structures and all(s.fraction >= TP_SHARE_LOWER.get(model, TP_SHARE) for s in structures), [
        (s.blocks, round(s.fraction, 3), s.kept_text()) for s in structures]


#: Under ``dp2_ep2``: each family's experts (a stacked weight, or one module of a list) and how many it has. (Llama 4's
#: experts are called with the tokens already grouped per expert, not with the router's choice: they stay whole.)
EXPERTS = {"hf_mixtral": ("model.model.layers.0.mlp.experts.gate_up_proj", 4),
           "hf_qwen3_moe": ("model.model.layers.0.mlp.experts.down_proj", 4),
           "hf_deepseek_v3": ("model.model.layers.1.mlp.experts.gate_up_proj", 4),
           "hf_gpt_oss": ("model.model.layers.0.mlp.experts.gate_up_proj_bias", 4),
           "mixed_moe": ("model.blocks.1.experts.{}.up.weight", 4)}


@pytest.mark.slow
@pytest.mark.parametrize("model", list(EXPERTS))
def test_zoo_experts_are_spread_over_the_ep_ranks(model: str, zoo_runs) -> None:
    """Each of the two ranks holds half of every expert layer's experts (the numbers are the test above's)."""
    ranks = zoo_runs("dp2_ep2")[model]["rank_local_shapes"]
    name, count = EXPERTS[model]
    if "{}" in name:  # a list: rank r holds experts 2r and 2r + 1, under their unmodified names
        assert [sorted(e for e in range(count) if name.format(e) in rank) for rank in ranks] == [[0, 1], [2, 3]]
    else:
        assert [(rank[name][0][0], rank[name][1][0]) for rank in ranks] == [(count // 2, count)] * 2


@pytest.mark.slow
def test_loss_parallel_keeps_the_logits_sharded_and_trains_like_single_device(zoo_references, zoo_runs) -> None:
    """``loss_parallel=True`` at tp2 (tied Qwen2 head): the head's output stays sharded over the vocabulary and
    training (losses logged without sync_dist, validation and test losses, every parameter) equals single-device
    Lightning; dp2 × tp2 is in ``tests/parallel/test_initialization.py``."""
    result = zoo_runs("tp2")["hf_qwen2 loss_parallel"]
    assert result["tp_plan"]["model.lm_head"] == "colwise (vocab, logits sharded) tied"
    assert_equivalent(zoo_references("1")["hf_qwen2"], result, rtol=RTOL)


def test_data_parallelism_alone_needs_no_block_list() -> None:
    flat = build_module("flat")
    with pytest.warns(UserWarning, match=r"Could not find the repeated blocks of LMLightningModule.*one FSDP2 unit"):
        assert len(find_blocks(flat, HybridOptions())) == 0
    for needs_blocks in (dict(tp=2), dict(pp=2), dict(activation_checkpointing="every"), dict(tp="auto")):
        with pytest.raises(ValueError, match=r"Could not find the repeated blocks .* HybridStrategy\(blocks="):
            find_blocks(flat, HybridOptions(**needs_blocks))


def test_blocks_in_a_module_dict_are_found_by_structure() -> None:
    blocks = find_blocks(build_module("titan"), HybridOptions())
    assert blocks.path == "model.layers" and blocks.keys == ("0", "1", "2", "3")
    assert [blocks.name(i) for i in (0, 3)] == ["model.layers.0", "model.layers.3"]
    assert type(blocks[2]).__name__ == "TitanBlock"


# ------------------------------------------------------------------------------------------ the README's table
#: Family × layout → what tensor parallelism keeps whole on every tp rank there (the README's note; the modules
#: the report names for the block structure whose index comes last) and the refusal ``tp_strict=True`` gives instead.
KEPT_WHOLE: dict[tuple[str, str], tuple[str, tuple[str, ...], str, int]] = {
    (model, layout): (note, modules, refusal, structure) for model, (note, modules, refusal, structure) in {
        "diffusers_dit": ("the class-label table kept whole over tp", ("norm1.emb.class_embedder.embedding_table",),
                          r"cannot shard Embedding 'norm1\.emb\.class_embedder\.embedding_table'", 0),
        # Mamba-2 mixers with fewer groups than tp ranks: projections gathered, the hybrid layers' conv kept whole
        "hf_zamba2": ("the hybrid layers' Mamba-2 convolution kept whole over tp", ("mamba_decoder.mamba.conv1d",),
                      r"cannot shard Conv1d 'mamba_decoder\.mamba\.conv1d'", 1),
    }.items() for layout in CASES[model]
    # under pp the DiT's embedder is whole in every block anyway: the stage that calls it after the trunk holds it too
    if "tp" in layout and not (model == "diffusers_dit" and "pp" in layout)
}
#: How each family is described in the README.
DESCRIPTIONS = {
    "titan": "torchtitan-style Llama (ModuleDict blocks, complex rotary buffer, torchmetrics logged)",
    "flat": "no repeated blocks (dp only)",
    "root_params": "parameters held by the model next to its blocks",
    "tied": "tied embedding/head, attributes read across stages",
    "hf_gpt2": "Hugging Face GPT-2 (Conv1D, fused c_attn, tied head)",
    "fused_gqa": "litgpt-style fused q/k/v with grouped-query attention",
    "hf_qwen2": "Hugging Face Qwen2 (grouped-query attention, q/k/v biases, tied head)",
    "hf_phi3": "Hugging Face Phi-3 (fused qkv_proj with grouped-query attention, fused gate_up_proj)",
    "hf_mixtral": "Hugging Face Mixtral (mixture of 4 experts, top-2, grouped_mm kernel)",
    "hf_gpt_neox": "Hugging Face GPT-NeoX (fused query_key_value, parallel residual, partial rotary)",
    "hf_bert": "Hugging Face BERT masked LM (bidirectional, head with a transform and a tied decoder)",
    "hf_vit": "Hugging Face ViT on tokens as image patches (class token, position table, dtype read across stages)",
    "hf_t5_encoder": "Hugging Face T5 encoder (relative position bias from the first block handed to the others)",
    "mixed_moe": "dense blocks alternating with mixture-of-experts blocks of another class (nn.Linear experts)",
    "hf_qwen2_mqa": "Hugging Face Qwen2, other sizes: width 48, 6 heads, 1 key/value head, untied head",
    "hf_bart": "Hugging Face BART (encoder-decoder: two block lists, cross-attention to the encoder's output)",
    "diffusers_dit": "diffusers DiT, class-conditional, in a denoising step (adaLN; a block's embedder called after"
                     " the trunk)",
    "hf_mamba": "Hugging Face Mamba (state-space mixers, sharded per channel under tp; reference scan)",
    "hf_deepseek_v3": "Hugging Face DeepSeek-V3 (multi-head latent attention, first block dense, MoE with a shared"
                      " expert)",
    "hf_qwen3_moe": "Hugging Face Qwen3-MoE (per-head q/k norms, every block a mixture of experts)",
    "hf_olmo2": "Hugging Face OLMo 2 (q/k RMSNorm over the whole projection width)",
    "hf_gpt_oss": "Hugging Face GPT-OSS (attention sinks, sliding/full attention, experts with biases and"
                  " interleaved gate|up)",
    "hf_zamba2": "Hugging Face Zamba2 (Mamba-2 layers; a transformer block shared by every hybrid layer, its weights"
                 " tied across them)",
    "hf_llama4": "Hugging Face Llama 4 text (dense and MoE blocks interleaved, shared expert, a router returning"
                 " scores and logits)",
    "litgpt": "litgpt's own GPT (`transformer = ModuleDict(wte, h, ln_f)`, fused q|k|v with grouped queries)",
    "hf_swin": "Hugging Face Swin on tokens as an image (hierarchical stages, patch merging, relative position"
               " tables)",
    "peft_lora": "PEFT LoRA on a Hugging Face Llama (frozen base, adapters on q/v and the MLP's down projection)",
    "two_lists": "two block lists (double- then single-stream) with a conditioning vector handed to every block",
    "encoder_decoder": "encoder-decoder whose every decoder block cross-attends to the encoder's output",
}


def readme_models_table() -> str:
    """The README's "Tested models" table: ✓ = trains like single-process Lightning (tests above), with a phrase
    saying what tensor parallelism keeps whole there, – = not run."""
    header = "| model | " + " | ".join(LAYOUTS) + " |"
    lines = [header, "|" + " --- |" * (len(LAYOUTS) + 1)]
    notes = {key: note for key, (note, *_) in KEPT_WHOLE.items()} | {
        ("diffusers_dit", layout): "each block's embedder kept whole over tp: the last stage calls it too"
        for layout in CASES["diffusers_dit"] if "tp" in layout and "pp" in layout}
    for model, layouts in CASES.items():
        cells = [("✓" + (f" ({notes[(model, layout)]})" if (model, layout) in notes else ""))
                 if layout in layouts else "–" for layout in LAYOUTS]
        lines.append(f"| {DESCRIPTIONS[model]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_the_readme_table_is_the_zoo() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert readme_models_table() in readme, "regenerate it: python -c 'from tests.test_zoo import *; print(readme_models_table())'"


@pytest.mark.parametrize(("model", "layout"), list(KEPT_WHOLE))
def test_what_tp_keeps_whole_is_what_tp_strict_refuses(model: str, layout: str) -> None:
    import torch

    from lightning_hybrid.probe.blocks import block_structures, find_block_list
    from lightning_hybrid.probe.record import record_step
    from lightning_hybrid.tensor_parallel.dataflow import trace_block
    from lightning_hybrid.tensor_parallel.block_plan import plan_block

    module = build_module(model)
    _, blocks = find_block_list(module)
    tokens = torch.randint(0, 64, (2, 16))
    first = block_structures(blocks)[KEPT_WHOLE[(model, layout)][3]][0]
    args, kwargs = record_step(module, blocks, lambda: module(tokens)).block_calls[first]
    with pytest.raises(ValueError, match=KEPT_WHOLE[(model, layout)][2]):
        plan_block(blocks[first], trace_block(blocks[first], args, kwargs), 2)


@pytest.mark.slow
@pytest.mark.parametrize(("model", "layout"), [
    param_extended_if(layout in EXTENDED_LAYOUTS, model, layout) for model, layout in KEPT_WHOLE])
def test_what_tp_keeps_whole_is_reported(model: str, layout: str, zoo_runs) -> None:
    first = zoo_runs(layout)[model]["tp_plan"].structures[KEPT_WHOLE[(model, layout)][3]]
    assert first.kept_whole[0].modules == KEPT_WHOLE[(model, layout)][1] and first.extra_bytes > 0
