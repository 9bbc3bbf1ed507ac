"""``HybridStrategy(tp="auto", pp="auto")``: reading the live model, ruling layouts out, choosing, and the errors.

The multi-rank run that trains with a chosen layout and matches single-process Lightning is in ``tests/pipeline/test_pipeline.py``
(``test_auto_layout_chooses_by_memory_and_trains_like_the_reference``, part of the pp=2 sweep).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from torch import nn
from torch.utils.data import DataLoader, default_collate

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.planner.auto_layout import Obstacles, adopt_layout, choose_layout, describe_choice
from lightning_hybrid.planner.live_model import measure_model, tensor_parallel_obstacles
from lightning_hybrid.planner.hardware_probe import all_reduce_link, matmul_flops
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.probe.record import first_block_call, record_step
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.layout import Layout
from lightning_hybrid.planner.model import ModelShape
from tests import block_zoo
from tests.helpers import on_two_ranks
from tests.models import MODEL_NAMES, RandomTokenDataset, build_module, default_config

#: Heads, key/value heads and whether the model materializes attention scores, from each test model's config.
ATTENTION = {"gpt": (4, 4, True), "llama": (4, 2, True), "tuple": (4, 4, False), "hf_llama": (4, 2, False)}


def _first_block_call(module: nn.Module, sequences: int = 8) -> tuple[str, nn.Module, tuple]:
    config = default_config(module.hparams.model)
    dataset = RandomTokenDataset(sequences, config["seq_len"], config["vocab_size"], seed=1)
    batch = default_collate([dataset[i] for i in range(sequences)])
    path, blocks = find_block_list(module)
    return path, blocks, first_block_call(record_step(module, blocks, lambda: module.training_step(batch, 0)))


# ------------------------------------------------------------------------------------------- the live model
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_heads_and_sequence_length_are_read_from_the_first_blocks_attention(model: str) -> None:
    module = build_module(model)
    path, _, call = _first_block_call(module, sequences=8)
    shape, tokens = measure_model(module, path, call)
    heads, kv_heads, flash = ATTENTION[model]
    assert (shape.heads, shape.kv_heads, shape.flash_attention) == (heads, kv_heads, flash)
    assert shape.seq_len == default_config(model)["seq_len"] == 16 and tokens == 8 * 16
    assert shape.total_parameters == sum(p.numel() for p in module.parameters())


def test_measuring_runs_the_block_on_a_copy_of_its_inputs() -> None:
    """A Hugging Face layer appends to the key/value cache it is handed: measuring must not grow the real one."""
    module = build_module("hf_llama")
    path, blocks, call = _first_block_call(module)
    before = [t.clone() for t in call[0] if isinstance(t, torch.Tensor)]
    measure_model(module, path, call)
    tensor_parallel_obstacles(module, path, call, [2], {})  # would fail on a grown cache: key length 32 vs mask 16
    assert all(torch.equal(a, b) for a, b in zip(before, [t for t in call[0] if isinstance(t, torch.Tensor)]))


class _MixerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def test_a_model_without_attention_asks_for_explicit_degrees() -> None:
    model = nn.Sequential(nn.Embedding(16, 8), nn.ModuleList([_MixerBlock(), _MixerBlock()]))
    blocks = model[1]
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"found no attention in _MixerBlock .* Pass tp=N and pp=N yourself"):
        measure_model(model, "1", ((x,), {}))
    assert len(blocks) == 2


def test_tensor_parallel_degrees_are_ruled_out_by_the_tensor_parallel_planner() -> None:
    """GPT: 4 heads of 8 in a fused qkv; Llama: 4 query heads, 2 key/value heads."""
    gpt, llama = build_module("gpt"), build_module("llama")
    gpt_path, _, gpt_call = _first_block_call(gpt)
    llama_path, _, llama_call = _first_block_call(llama)
    gpt_obstacles = tensor_parallel_obstacles(gpt, gpt_path, gpt_call, [1, 2, 3, 4, 8], {})
    llama_obstacles = tensor_parallel_obstacles(llama, llama_path, llama_call, [1, 2, 4, 8], {})
    assert sorted(gpt_obstacles) == [3, 8] and "reshaped into 4 × 8" in gpt_obstacles[3]
    # tp=4 shares each key/value head between two ranks; 8 ranks cannot split 4 query heads.
    assert sorted(llama_obstacles) == [8] and "'attention.wq'" in llama_obstacles[8]
    # With the user's entries keeping attention whole, only the MLP (width 32 → 128 → 32) is sharded: 8 divides it.
    whole = {f"{gpt_path}.*.attn.qkv": "replicate", f"{gpt_path}.*.attn.proj": "replicate"}
    assert sorted(tensor_parallel_obstacles(gpt, gpt_path, gpt_call, [3, 8], whole)) == [3]


def _obstacles_on_two_ranks(rank: int, results: dict) -> None:
    x = torch.randn(2, 8, block_zoo.DIM, generator=torch.Generator().manual_seed(1))
    for style, check_on in (("nanogpt", None), ("nanogpt", "cpu"), ("timm", "cpu")):
        root = nn.Module()
        root.blocks = nn.ModuleList([block_zoo.build(style)])
        found = tensor_parallel_obstacles(root, "blocks", ((x,), {}), [2], {}, check_on=check_on)
        if rank == 0:
            results[f"{style}-{check_on}"] = found


@pytest.mark.slow
def test_the_numeric_plan_check_rules_out_what_structure_cannot() -> None:
    """nanoGPT derives the head size from the input width (C // n_head): structurally tp=2 divides everything, but
    the sharded block computes something else; the check the strategy runs at setup, run per candidate degree on a
    temporary mesh, rules tp=2 out before the layout is chosen. A timm block passes both."""
    results = on_two_ranks(_obstacles_on_two_ranks)
    assert results["nanogpt-None"] == {}
    assert "no rank can compute a share of the heads between ['attn.c_attn', 'attn.c_proj']" in results["nanogpt-cpu"][2]
    assert results["timm-cpu"] == {}


# ------------------------------------------------------------------------------------------------- choosing
#: 8 layers of width 1024 (16 heads), 12.6M parameters per block, 32k vocabulary, 2048 tokens per sequence.
MODEL = ModelShape(layers=8, hidden=1024, heads=16, vocab=32000, seq_len=2048)


#: What HybridStrategy(tp="auto", pp="auto") asks the planner for: the degrees, and what is left unset.
AUTO_LAYOUT = HybridOptions(tp="auto", pp="auto")
#: The degrees alone: ZeRO, schedule and checkpointing given (the default level follows the chosen pp).
DEGREES_ONLY = HybridOptions(tp="auto", pp="auto", pp_schedule="1f1b", activation_checkpointing="none")


def cluster(memory_gib: float, gpus: int = 4, inter_node_bandwidth: float = 10e9) -> Cluster:
    return Cluster(nodes=1, gpus_per_node=gpus, memory_bytes=memory_gib * GIB, peak_flops=100e12,
                   intra_node_bandwidth=100e9, inter_node_bandwidth=inter_node_bandwidth)


def test_with_room_to_spare_data_parallelism_wins() -> None:
    """dp4's FSDP traffic hides behind compute (but for its first and last collectives); tensor parallelism exposes its
    all-reduces and pipelines their bubble."""
    ranked = choose_layout(MODEL, cluster(80), DEGREES_ONLY, per_rank_batch=4, precision="bf16-mixed")
    assert ranked[0].layout == Layout(dp=4) and all(e.feasible for e in ranked)
    assert len({(e.layout.tp, e.layout.pp) for e in ranked}) == 6  # tp × pp over 4 devices: 1·4, 2·2, 4·1 ... 6
    dp4 = estimate(MODEL, cluster(80), Layout(dp=4), global_batch=16, precision="bf16-mixed")
    assert ranked[0].tokens_per_second == dp4.tokens_per_second
    # MFU = the cluster's efficiency, 0.5, but for the first gathers and last reduce-scatters FSDP2 cannot hide
    assert ranked[0].mfu == pytest.approx(0.5 * dp4.time.compute / dp4.time.step) and ranked[0].mfu > 0.48
    assert all(e.mfu < ranked[0].mfu for e in ranked[1:] if e.layout.dp < 4)


def test_memory_rules_out_data_parallelism_and_the_fastest_fitting_split_wins() -> None:
    roomy = {str(e.layout): e for e in choose_layout(MODEL, cluster(80), DEGREES_ONLY, 8, "bf16-mixed")}
    dp4_need = roomy["dp4 tp1 pp1 z3"].memory.total
    fitting = [e for e in roomy.values() if e.memory.total < 0.9 * dp4_need]
    assert fitting  # splitting the model saves memory that sharding alone does not: activations
    budget = 0.95 * dp4_need / 0.9  # usable = 90 %: dp4 is 5 % over
    ranked = choose_layout(MODEL, cluster(budget / GIB), DEGREES_ONLY, 8, "bf16-mixed")
    dp4 = next(e for e in ranked if e.layout == Layout(dp=4))
    assert not dp4.feasible and dp4.out_of_memory
    assert ranked[0].feasible and ranked[0].layout.dp < 4
    assert ranked[0].memory.total <= 0.9 * budget
    assert ranked[0].tokens_per_second == max(e.tokens_per_second for e in ranked if e.feasible)
    # Left to choose checkpointing too, the planner keeps dp4 and drops activations instead: selective
    # checkpointing recomputes only cheap elementwise work, free at this cluster's unlimited memory bandwidth.
    chosen = choose_layout(MODEL, cluster(budget / GIB), AUTO_LAYOUT, 8, "bf16-mixed")[0]
    assert chosen.layout == Layout(dp=4, activation_checkpointing="selective")
    assert chosen.tokens_per_second == pytest.approx(roomy["dp4 tp1 pp1 z3"].tokens_per_second)


def test_fixed_degrees_and_obstacles_narrow_the_candidates() -> None:
    only_tp2 = choose_layout(MODEL, cluster(80, gpus=8), DEGREES_ONLY.changed(tp=2), 4, "bf16-mixed")
    assert {e.layout.tp for e in only_tp2} == {2} and {e.layout.pp for e in only_tp2} == {1, 2, 4}
    refused = {2: "tensor parallelism: no"}
    ranked = choose_layout(MODEL, cluster(80), DEGREES_ONLY.changed(dp=1), 4, "bf16-mixed",
                           obstacles=Obstacles(refused))
    by_layout = {(e.layout.tp, e.layout.pp): e for e in ranked}
    assert set(by_layout) == {(1, 4), (2, 2), (4, 1)}
    assert by_layout[(2, 2)].reasons == ("tensor parallelism: no",) and by_layout[(1, 4)].feasible


def test_a_module_that_cannot_be_pipelined_gets_no_pipeline() -> None:
    """The strategy passes why (manual optimization) and every pp > 1 layout is ruled out with that reason, even
    where a pipeline is what memory calls for (2 GiB: only dp1 tp1 pp4 fits, above)."""
    why = "the pipeline needs automatic optimization"
    ranked = choose_layout(MODEL, cluster(80), DEGREES_ONLY, 4, "bf16-mixed", obstacles=Obstacles(pipeline=why))
    assert ranked[0].layout.pp == 1
    assert all(why in e.reasons for e in ranked if e.layout.pp > 1)
    with pytest.raises(ValueError, match=r"The nearest, dp1 tp4 pp1 z3: out of memory: 4.4 GiB per GPU"):
        choose_layout(MODEL, cluster(2), DEGREES_ONLY, 8, "bf16-mixed", obstacles=Obstacles(pipeline=why))


def test_accumulation_is_the_planners_microbatches_without_a_pipeline() -> None:
    ranked = choose_layout(MODEL, cluster(80), DEGREES_ONLY.changed(pp=1), 4, "bf16-mixed", accumulation=4)
    dp4 = next(e for e in ranked if e.layout.dp == 4)
    assert dp4.layout == Layout(dp=4, microbatches=4)
    # 4 sequences per rank and step, 4 steps per optimizer step, 4 ranks: 64 sequences of 2048 tokens per step.
    assert dp4.tokens_per_second * dp4.time.step == pytest.approx(64 * 2048)
    # On top of a pipeline the accumulation steps are pipeline steps, each with its microbatches and bubble.
    piped = choose_layout(MODEL, cluster(80), HybridOptions(pp=2, tp=1), 4, "bf16-mixed", accumulation=4)
    assert {e.layout.accumulate for e in piped} == {4}
    assert piped[0].tokens_per_second * piped[0].time.step == pytest.approx(2 * 4 * 4 * 2048)  # dp2 · 4 · 4


def test_when_nothing_fits_the_error_says_what_would() -> None:
    """With checkpointing ruled out ("none") the message names what checkpointing would fit; left unset, the
    search has tried it already."""
    with pytest.raises(ValueError, match=r"no layout of 4 devices .* 8 sequences of 2048 tokens per data-parallel rank"
                                         r".*out of memory.* With HybridStrategy\(activation_checkpointing='every'\)"
                                         r" dp1 tp2 pp2 1f1b m8 z2 ac fits \(1.00 GiB per device\)"):
        choose_layout(MODEL, cluster(1.2), DEGREES_ONLY, 8, "bf16-mixed")  # the nearest is 49.7 MiB over
    assert choose_layout(MODEL, cluster(1.2), AUTO_LAYOUT, 8, "bf16-mixed")[0].layout.activation_checkpointing
    with pytest.raises(ValueError, match=r"over the usable 0.9 GiB. Lower the DataLoader's batch size or add devices"):
        choose_layout(MODEL, cluster(1), AUTO_LAYOUT, 8, "bf16-mixed")


def test_the_log_line_names_the_choice_its_memory_and_the_runner_up() -> None:
    ranked = choose_layout(MODEL, cluster(80), DEGREES_ONLY, 4, "bf16-mixed")
    text = describe_choice(ranked, cluster(80), "given")
    assert text.startswith(f"chose {ranked[0].layout} for 4 devices: predicted {ranked[0].memory.total / GIB:.2f} GiB")
    assert f"next {ranked[1].layout} at" in text and text.endswith("Hardware: given.")
    # Besides the degrees only ZeRO was left open: at dp4 both levels hide their traffic, ZeRO-3 holds less.
    assert text.endswith(f"Why: ZeRO 3 (2: as fast, {ranked[1].memory.total / GIB:.2f} GiB). Hardware: given.")


# ------------------------------------------------------------------------------------ the options left unset
def test_more_microbatches_shrink_the_bubble_and_are_chosen() -> None:
    """pp4 on 4 devices, 16 sequences per rank: 1F1B's bubble is (p − 1)/(m + p − 1) of the step, 3/7 at m = 4
    and 3/19 at m = 16, and at equal compute the step shrinks with it: the most microbatches win (the p2p messages
    of 16 small microbatches cost less than the idle time they save)."""
    options = HybridOptions(dp=1, tp="auto", pp=4, pp_schedule="1f1b", zero=2, activation_checkpointing="none")
    ranked = choose_layout(MODEL, cluster(80), options, 16, "bf16-mixed")
    by_count = {e.layout.microbatches: e for e in ranked}
    assert sorted(by_count) == [4, 8, 16] and ranked[0].layout.microbatches == 16
    for count, bubble in ((4, 3 / 7), (16, 3 / 19)):
        assert by_count[count].time.bubble / by_count[count].time.step == pytest.approx(bubble, rel=0.1)
    text = describe_choice(ranked, cluster(80), "given")
    slower = by_count[4].tokens_per_second / by_count[16].tokens_per_second
    assert f"Why: microbatches 16, bubble {by_count[16].time.bubble / by_count[16].time.step:.0%} of the step" in text
    assert f"4: {slower:.2f}×" in text and slower < 0.8


def test_zero_3_under_a_pipeline_loses_to_zero_2_where_its_gathers_are_exposed() -> None:
    """Under pp ZeRO-3 gathers each block 2 × microbatches times a step, ZeRO-2 once: over a slow link (2 GB/s)
    the planner keeps parameters gathered; without a pipeline, where memory is tight, it shards them (ZeRO-2 does
    not fit)."""
    slow = replace(cluster(80), intra_node_bandwidth=2e9)
    options = HybridOptions(dp=2, tp=1, pp="auto", pp_schedule="1f1b", activation_checkpointing="none")
    piped = [e for e in choose_layout(MODEL, slow, options, 8, "bf16-mixed") if e.layout.pp == 2]
    by_zero = {e.layout.zero: e for e in piped if e.layout.microbatches == piped[0].layout.microbatches}
    assert piped[0].layout.zero == 2 and by_zero[3].time.data_parallel > 2 * by_zero[2].time.data_parallel
    assert by_zero[3].tokens_per_second < by_zero[2].tokens_per_second
    only_dp = HybridOptions(dp=4, tp="auto", pp=1, activation_checkpointing="none")  # 4 devices: tp1 is left
    dp4 = {e.layout.zero: e for e in choose_layout(MODEL, cluster(80), only_dp, 8, "bf16-mixed")}
    tight = cluster((dp4[2].memory.total + dp4[3].memory.total) / 2 / 0.9 / GIB)  # between the two levels' needs
    chosen = choose_layout(MODEL, tight, only_dp, 8, "bf16-mixed")
    assert chosen[0].layout == Layout(dp=4, zero=3) and dp4[2].memory.total > dp4[3].memory.total
    assert f"Why: ZeRO 3 (2: out of memory ({dp4[2].memory.total / GIB:.2f} GiB))" in describe_choice(
        chosen, tight, "given")


def test_given_options_are_kept_and_the_chosen_ones_adopted() -> None:
    given = HybridOptions(tp="auto", pp="auto", pp_schedule="gpipe", microbatches=4, zero=3,
                          activation_checkpointing="none")
    ranked = choose_layout(MODEL, cluster(80), given, 8, "bf16-mixed")
    piped = [e.layout for e in ranked if e.layout.pp > 1]
    assert piped and {(l.pp_schedule, l.microbatches, l.zero) for l in piped} == {("gpipe", 4, 3)}
    assert {e.layout.activation_checkpointing for e in ranked} == {None}
    chosen = Layout(dp=1, tp=1, pp=4, zero=2, pp_schedule="interleaved_1f1b", microbatches=8, virtual_stages=2,
                    activation_checkpointing="selective")
    adopted = adopt_layout(AUTO_LAYOUT, chosen)
    assert (adopted.tp, adopted.pp, adopted.zero, adopted.activation_checkpointing) == (1, 4, 2, "selective")
    assert adopted.pipeline_schedule == PipelineSchedule("interleaved_1f1b", 4, 2, 8) and adopted.cluster is None
    unpiped = adopt_layout(HybridOptions(tp="auto", activation_checkpointing="none"), Layout(dp=4, zero=3))
    assert (unpiped.pipeline_schedule, unpiped.zero, unpiped.checkpointing) == (None, 3, None)


# ------------------------------------------------------------------------------------------------- hardware
def test_cpu_probes_measure_positive_rates() -> None:
    assert 1e8 < matmul_flops(size=128, repeats=3) < 1e14  # any CPU: 0.1 GFLOP/s to 100 TFLOP/s
    assert all_reduce_link() == (0.0, float("inf"))  # one process: no links to measure


# ------------------------------------------------------------------------------------------------- strategy
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp="Auto"), r"tp='Auto'\) is invalid: tp must be a positive integer or 'auto'"),
        (dict(pp="auto", pp_split=[1, 1]), r"pp='auto', pp_split=...\): a split fixes the number of stages"),
        (dict(pp="auto", save_distributed_checkpoint=False), r"pp='auto'.*\(pp='auto' may choose a pipeline.\)"),
        (dict(pp="auto", pp_schedule="zbv_zero_bubble"), r"the planner models the schedules 1f1b, gpipe"),
        (dict(tp=2, cluster=cluster(80)), r"cluster=\) describes the hardware for tp='auto'/pp='auto'"),
        (dict(tp="auto", cluster="h100"), r"cluster='h100'\) must be a lightning_hybrid.Cluster"),
    ],
)
def test_bad_auto_options_fail_at_construction(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridStrategy(**kwargs)


def test_fixed_degrees_and_the_cluster_are_checked_against_the_world_size() -> None:
    with pytest.raises(ValueError, match=r"tp=2 = 2 does not divide the world size 3"):
        Trainer(accelerator="cpu", devices=3, strategy=HybridStrategy(tp=2, pp="auto"), logger=False)
    with pytest.raises(ValueError, match=r"describes 1 node\(s\) × 4 devices, but the Trainer runs num_nodes=1 ×"
                                         r" devices=2"):
        Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(tp="auto", cluster=cluster(80)), logger=False)


def _fit(strategy: HybridStrategy, model: str = "gpt", init: str = "eager") -> None:
    config = default_config(model)
    data = RandomTokenDataset(8, config["seq_len"], config["vocab_size"], seed=1)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False,
                      enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    environment = dict(os.environ)
    try:
        trainer.fit(build_module(model, init=init), DataLoader(data, batch_size=4))
    finally:
        # Lightning leaves its one-process group and its launch variables (LOCAL_RANK, MASTER_PORT, ...) behind; a
        # later multi-process launch would inherit LOCAL_RANK and take itself for an already launched rank (hang).
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)


@pytest.mark.parametrize("init", ["eager", "meta"])
def test_one_device_chooses_the_only_layout_and_keeps_its_estimate(init: str) -> None:
    """Also for a model built on the meta device in configure_model: measured on meta tensors before it is
    materialized."""
    strategy = HybridStrategy(tp="auto", pp="auto")
    _fit(strategy, init=init)
    assert strategy.layout_estimate is not None and strategy.layout_estimate.layout == Layout()
    assert strategy.dims is not None and strategy.dims.sizes == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "tp": 1}
    # 4 sequences of 16 tokens of the GPT (2 blocks, width 32): its fp32 model states are 16 B per parameter.
    parameters = sum(p.numel() for p in strategy.lightning_module.parameters())
    assert strategy.layout_estimate.memory.model_states == 16 * parameters


def test_a_device_too_small_stops_setup_with_the_planners_message() -> None:
    tiny = Cluster(nodes=1, gpus_per_node=1, memory_bytes=1e5, peak_flops=1e11, intra_node_bandwidth=1e9,
                   inter_node_bandwidth=1e9)
    with pytest.raises(ValueError, match=r"The model states alone need 478,720 bytes \(16 B/param × 29,920 parameters.* at least 6 GPUs"):
        _fit(HybridStrategy(tp="auto", pp="auto", cluster=tiny))
    roomy_for_states = replace(tiny, memory_bytes=6e5)  # 540,000 B usable: the states fit, activations do not
    with pytest.raises(ValueError, match=r"found no layout of 1 devices .* 4 sequences of 16 tokens"):
        _fit(HybridStrategy(tp="auto", pp="auto", cluster=roomy_for_states))
