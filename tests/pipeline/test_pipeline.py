"""Pipeline parallelism: schedule rules, Lightning semantics, and equivalence with single-process Lightning.

The slow tests run ``tests/equivalence.py`` (see ``test_equivalence.py``) with ``--pp``: every torch schedule at
pp=2 and dp×tp×pp = 2×2×2 on 8 ranks on both test models, 1F1B (GPT) and interleaved 1F1B (Llama) at pp=4, plus
blocks that return tuples and an unmodified Hugging Face Llama. Each compares every micro-batch loss, val/test loss, summed
metric, hook calls, learning rates and every final parameter with the reference within 1e-5 relative.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

from lightning_hybrid import HybridStrategy
from lightning_hybrid.observe.timeline import FIRST_TIMELINE_STEP
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.options.schedules import SCHEDULES, PipelineSchedule
from lightning_hybrid.pipeline.semantics import check_batch, combine_logs
from tests.conftest import CHECKPOINTED_LAYERS, ReferenceFn
from tests.equivalence import GRADIENT_CLIP_VAL
from tests.helpers import SHORT_RUN, SHORT_STEPS, assert_equivalent, cached_runs, run_script, run_sweep, scalars
from tests.models import MODEL_NAMES, PIPELINE_MODEL_NAMES

RTOL = 1e-5
LAYERS = 4  # pp=2 with two virtual stages per rank needs at least 4 blocks


# ----------------------------------------------------------------------------------------------------------------
# Schedules and options (fast)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "virtual_stages", "placement"),
    [
        ("gpipe", 1, "loop"),
        ("1F1B", 1, "loop"),
        ("Interleaved1F1B", 2, "loop"),
        ("looped-bfs", 2, "loop"),
        ("interleaved_zero_bubble", 2, "loop"),
        ("ZBVZeroBubble", 2, "v"),
        ("dualpipev", 2, "v"),
    ],
)
def test_schedule_defaults(name: str, virtual_stages: int, placement: str) -> None:
    schedule = PipelineSchedule.resolve(name, pp=4)
    assert (schedule.virtual_stages, schedule.placement) == (virtual_stages, placement)
    assert schedule.microbatches == 4 * virtual_stages  # default: one microbatch per stage
    assert schedule.torch_class.__name__.lower().replace("schedule", "") == name.lower().replace("_", "").replace("-", "")
    # The planner reads single_stage without importing torch's pipelining: it must agree with torch's classes.
    assert schedule.single_stage == issubclass(schedule.torch_class, PipelineScheduleSingle)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(name="pipedream"), r"Unknown pp_schedule='pipedream'. Choose one of: gpipe, 1f1b, interleaved_1f1b"),
        (dict(name="gpipe", virtual_stages=2), r"runs one stage per rank; virtual_stages=2 needs a multi-stage"),
        (dict(name="zbv_zero_bubble", virtual_stages=3), r"exactly 2 stages per rank in a V; use virtual_stages=2"),
        (dict(name="1f1b", microbatches=3), r"needs microbatches ≥ pp \(4\); got microbatches=3"),
        (dict(name="dualpipev", microbatches=6), r"needs microbatches ≥ its 8 stages \(2 × pp\)"),
        (dict(name="interleaved_1f1b", microbatches=9), r"microbatches=9 must be below pp or a multiple of its 2"),
        (dict(name="looped_bfs", virtual_stages=0), r"virtual_stages=0\) is invalid: virtual_stages must be a positive integer"),
        (dict(name="gpipe", microbatches=0), r"microbatches=0\) is invalid: microbatches must be a positive integer"),
    ],
)
def test_schedule_rules_are_checked_up_front(kwargs: dict, message: str) -> None:
    kwargs = dict(kwargs)
    name = kwargs.pop("name")
    with pytest.raises(ValueError, match=message):
        PipelineSchedule.resolve(name, pp=4, **kwargs)
    with pytest.raises(ValueError, match=message):  # the strategy checks at construction, before any process starts
        HybridStrategy(pp=4, pp_schedule=name, **kwargs)


def test_stage_placement_and_theoretical_bubble() -> None:
    looped = PipelineSchedule.resolve("interleaved_1f1b", pp=2)
    assert [looped.stage_ids(rank) for rank in range(2)] == [[0, 2], [1, 3]]
    v_shaped = PipelineSchedule.resolve("zbv_zero_bubble", pp=2)
    assert [v_shaped.stage_ids(rank) for rank in range(2)] == [[0, 3], [1, 2]]
    assert PipelineSchedule.resolve("1f1b", pp=4, microbatches=8).theoretical_bubble() == pytest.approx(3 / 11)


def test_pipeline_options_need_pp() -> None:
    with pytest.raises(ValueError, match=r"are pipeline options: set pp > 1"):
        HybridStrategy(microbatches=4)


def test_pipeline_options_given_for_an_automatic_layout_apply_only_if_it_has_a_pipeline() -> None:
    options = HybridOptions(tp="auto", pp="auto", microbatches=2, pp_schedule="1f1b")
    without = options.with_degrees(dp=2, tp=2, pp=1, dp_replicate=1)  # once raised "are pipeline options"
    assert (without.pp, without.microbatches, without.pipeline_schedule) == (1, None, None)
    with_pipeline = options.with_degrees(dp=1, tp=2, pp=2, dp_replicate=1)
    assert (with_pipeline.microbatches, with_pipeline.pipeline_schedule.name) == (2, "1f1b")


def test_pipelines_keep_parameters_gathered_unless_zero_3_is_asked_for() -> None:
    assert HybridStrategy(pp=2, pp_schedule="interleaved_zero_bubble").options.zero == 2
    assert HybridStrategy(pp=2, pp_schedule="1f1b").options.zero == 2  # one all-gather per block and step
    assert HybridStrategy(pp=2, pp_schedule="1f1b", zero=3).options.zero == 3
    assert HybridStrategy(dp=2).options.zero == 3
    chosen = HybridOptions(dp="auto", pp="auto")  # the default follows the chosen layout, a given level stays
    assert [chosen.with_degrees(dp=2, tp=1, pp=pp, dp_replicate=1).zero for pp in (1, 2)] == [3, 2]
    given = HybridOptions(dp="auto", pp="auto", zero=3)
    assert [given.with_degrees(dp=2, tp=1, pp=pp, dp_replicate=1).zero for pp in (1, 2)] == [3, 3]
    with pytest.raises(ValueError, match=r"needs parameters to stay gathered from forward to backward: use zero=2"):
        HybridStrategy(pp=2, pp_schedule="dualpipev", zero=3)
    # Changing one option keeps the others unset (dataclasses.replace would pass zero=3 and "1f1b" on as given).
    changed = chosen.changed(activation_checkpointing="every")
    assert (changed.zero_given, changed.pp_schedule_given, changed.pp_schedule) == (None, None, "1f1b")
    assert HybridOptions(pp=2).pipeline_schedule.name == "1f1b"  # unset: torch's 1F1B


def test_logged_values_combine_over_microbatches_by_reduce_fx() -> None:
    microbatches = [
        [("loss", torch.tensor(2.0), {"sync_dist": True}), ("tokens", 10.0, {"reduce_fx": "sum"}),
         ("peak", torch.tensor(1.0), {"reduce_fx": torch.max}), ("acc", torch.tensor(0.5), {"batch_size": 4})],
        [("loss", torch.tensor(4.0), {"sync_dist": True}), ("tokens", 12.0, {"reduce_fx": "sum"}),
         ("peak", torch.tensor(3.0), {"reduce_fx": torch.max}), ("acc", torch.tensor(1.0), {"batch_size": 4})],
    ]
    combined = {name: (value, kwargs) for name, value, kwargs in combine_logs(microbatches, [1.0, 1.0])}
    assert combined["loss"] == (torch.tensor(3.0), {"sync_dist": True})
    # Means weigh each microbatch by its loss terms: 30 and 10 tokens give (2·30 + 4·10) / 40.
    weighted = {name: value for name, value, _ in combine_logs(microbatches, [30.0, 10.0])}
    assert weighted["loss"] == torch.tensor(2.5) and weighted["tokens"] == 22.0
    assert combined["tokens"] == (22.0, {"reduce_fx": "sum"})
    assert combined["peak"][0] == torch.tensor(3.0)
    assert combined["acc"] == (torch.tensor(0.75), {"batch_size": 8})
    with pytest.raises(ValueError, match=r"reduce_fx=.*knows 'mean', 'sum', 'max' and 'min'"):
        combine_logs([[("x", torch.tensor(1.0), {"reduce_fx": torch.std})]], [1.0])


def test_batch_must_hold_a_sample_per_microbatch() -> None:
    check_batch((torch.zeros(6, 3), torch.zeros(6)), 4)  # a smaller last batch: microbatches of 2, 2, 1, 1
    with pytest.raises(ValueError, match=r"A batch of 3 samples cannot be split into 4 microbatches"):
        check_batch((torch.zeros(3, 3), torch.zeros(3)), 4)


# ----------------------------------------------------------------------------------------------------------------
# Equivalence with single-process Lightning (multi-process, slow)
# ----------------------------------------------------------------------------------------------------------------
def _pipeline_run(tmp_path: Path, model: str, *, pp: int, layers: int = LAYERS, devices: int | None = None,
                  extra: tuple = (), **strategy_kwargs: object) -> dict:
    return run_script([
        "--model", model, "--pp", pp, "--devices", devices or pp, "--layers", layers,
        "--strategy-kwargs", json.dumps(strategy_kwargs), *extra, "--out", tmp_path / "pipeline.pt",
    ])


@pytest.fixture(scope="module")
def pp2_runs(tmp_path_factory: pytest.TempPathFactory):
    """``pp2_runs(model)``: one pp=2 run per schedule, all in one launch of two processes (cached per model), each
    the short run (``SHORT_RUN``, the references ``reference_run(..., short=True)``): a sweep of 7-9 pipelined
    fits is bound by their steps."""

    def run(model: str, folder: Path) -> dict[str, dict]:
        extra = {**AUTO_ENTRIES, "frozen_stage": FROZEN_STAGE_ENTRY} if model == "gpt" else {}
        names = [*SCHEDULES, *extra]
        results = run_sweep(
            ["--model", model, "--pp", 2, "--devices", 2, "--layers", LAYERS, *SHORT_RUN,
             "--tensorboard", folder / "tb", "--out", folder / "run.pt"],
            [extra[name] if name in extra else _pp2_entry(model, name) for name in names],
        )
        for index, result in enumerate(results):
            result["tensorboard"] = folder / "tb" / str(index) / "version_0"
        return dict(zip(names, results))

    return cached_runs(run, tmp_path_factory, "pp2")


#: The layout chosen for the GPT on 2 CPU ranks with a cluster of 1.6 MB per device (1.44 MB usable), dp fixed at 1
#: (dp2 would change the global batch and so the numbers): per rank, with the harness's 8 sequences per data-parallel
#: rank and 2 accumulation steps, tp2 needs 1.21 MB and pp2 (1F1B, 2 microbatches, the Trainer's 2 accumulation steps
#: on top: "acc2") 0.94 MiB, pp2 the faster; the schedule, microbatch count, ZeRO level and checkpointing are left
#: to the planner too, and 8 microbatches shrink the bubble from 1/3 to 1/9 at this cluster's cheap messages.
#: "auto_probed": the same with the hardware probed (this CPU's matmul and gloo all-reduce, whose latency makes each
#: message dear): tp2 or pp2, with whichever options the probe favours, must train like the reference.
AUTO_ENTRIES = {
    "auto": {"dp": 1, "tp": "auto", "pp": "auto", "cluster": {
        "nodes": 1, "gpus_per_node": 2, "memory_bytes": 1.6e6, "peak_flops": 1e11, "intra_node_bandwidth": 1e9,
        "inter_node_bandwidth": 1e9, "efficiency": 1.0}},
    "auto_probed": {"tp": "auto", "pp": "auto"},
}


@pytest.mark.slow
def test_auto_layout_chooses_by_memory_and_trains_like_the_reference(reference_run: ReferenceFn, pp2_runs) -> None:
    reference = reference_run("gpt", 1, LAYERS, short=True)
    chosen = pp2_runs("gpt")["auto"]
    assert chosen["auto_layout"] == "dp1 tp1 pp2 acc2 1f1b m8 z2"
    # The microbatches were the planner's: 8 of the rank's 8 sequences (bubble 1/9 instead of 1/3 at the default 2).
    assert "Why: microbatches 8, bubble " in chosen["layout_note"] and "2: 0." in chosen["layout_note"]
    assert_equivalent(reference, chosen, rtol=RTOL)
    probed = pp2_runs("gpt")["auto_probed"]
    assert probed["auto_layout"].startswith(("dp1 tp2 pp1 acc2 ", "dp1 tp1 pp2 acc2 "))
    assert_equivalent(reference, probed, rtol=RTOL)


#: The GPT's first pipeline stage (1F1B, 4 blocks: embeddings and blocks 0-1 on rank 0) frozen: rank 0 holds no
#: gradient, yet clipping (on, in every harness run) takes the norm over both stages, and it still joins the
#: pipeline group's all-reduce of it.
FROZEN_STAGE = ["tok_emb", "pos_emb", "blocks.0.", "blocks.1."]
FROZEN_STAGE_ENTRY = {"pp_schedule": "1f1b", "module": {"freeze": FROZEN_STAGE}}


@pytest.mark.slow
def test_a_frozen_stage_clips_and_trains_like_the_reference(pp2_runs, tmp_path: Path) -> None:
    reference = run_script(["--model", "gpt", "--reference", "--devices", 1, "--layers", LAYERS, *SHORT_RUN,
                            "--module-kwargs", json.dumps({"freeze": FROZEN_STAGE}), "--out", tmp_path / "ref.pt"])
    result = pp2_runs("gpt")["frozen_stage"]
    assert_equivalent(reference, result, rtol=RTOL)
    # Clipping acted on every step (the norm of stage 1's gradients above the harness's clip value).
    assert min(reference["grad_norms"]) > GRADIENT_CLIP_VAL
    frozen = [name for name in reference["params"] if name.startswith(tuple(f"model.{p}" for p in FROZEN_STAGE))]
    assert len(frozen) == 2 + 2 * 10  # 2 embeddings; per block 2 LayerNorms, qkv, proj, fc_in, fc_out (+ biases)
    # Rank 0 holds exactly the frozen parameters: its stage has no gradient at all ...
    assert result["rank_parameter_counts"][0] == sum(reference["params"][name].numel() for name in frozen)
    for name in frozen:  # ... and kept its initial values
        assert torch.equal(result["params"][name], reference["initial_params"][name]), name
    # The monitor's norm, taken over both stages (rank 0 adding nothing), equals the single process's.
    logged = scalars(result["tensorboard"])["grad_norm"]
    assert len(logged) == SHORT_STEPS
    assert [norm for _, norm in logged] == pytest.approx([reference["grad_norms"][step - 1] for step, _ in logged],
                                                         rel=RTOL)


def _pp2_entry(model: str, schedule: str) -> dict:
    """The GPT runs every schedule with activation checkpointing too (it must not change a number); selective
    checkpointing where torch allows it (not with split weight gradients), every 2nd block otherwise."""
    if model != "gpt":
        return {"pp_schedule": schedule}
    mode = 2 if PipelineSchedule.resolve(schedule, 2, None, None).splits_weight_gradients else "selective"
    return {"pp_schedule": schedule, "activation_checkpointing": mode}


@pytest.mark.slow
@pytest.mark.parametrize("schedule", list(SCHEDULES))
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_pp2_every_schedule_matches_reference(model: str, schedule: str, reference_run: ReferenceFn, pp2_runs) -> None:
    reference = reference_run(model, 1, LAYERS, short=True)
    result = pp2_runs(model)[schedule]
    assert result["sweep_entry"] == _pp2_entry(model, schedule)
    assert_equivalent(reference, result, rtol=RTOL)
    _assert_rank0_tensorboard_matches(result["tensorboard"], reference)
    _assert_monitored(result["tensorboard"], reference, PipelineSchedule.resolve(schedule, 2, None, None))
    # Each parameter lives on exactly one rank, and the model summary counts them all, as one process does.
    counts = result["rank_parameter_counts"]
    assert sum(counts) == sum(t.numel() for t in reference["params"].values())
    assert result["summary_parameters"] == reference["summary_parameters"] == (sum(counts), sum(counts))
    if schedule in ("gpipe", "1f1b"):  # one stage per rank, 4 equal blocks: 2 + embeddings, 2 + final norm + head
        assert counts == _stage_parameter_counts(reference, model, [(0, 1), (2, 3)])


def _stage_parameter_counts(reference: dict, model: str, blocks_per_rank: list[tuple[int, ...]]) -> list[int]:
    """Parameters of each rank in the reference: its blocks, the embeddings on the first, the rest on the last."""
    trunk = "model.blocks." if model == "gpt" else "model.layers."

    def block(name: str) -> int | None:
        return int(name[len(trunk):].split(".")[0]) if name.startswith(trunk) else None

    counts = []
    for rank, blocks in enumerate(blocks_per_rank):
        def held(name: str) -> bool:
            if block(name) is not None:
                return block(name) in blocks
            return ("emb" in name) == (rank == 0) and rank in (0, len(blocks_per_rank) - 1)
        counts.append(sum(t.numel() for name, t in reference["params"].items() if held(name)))
    return counts


def _assert_rank0_tensorboard_matches(folder: Path, reference: dict) -> None:
    """Rank 0 computes no loss (it runs stage 0), yet its TensorBoard file must hold the single-process values."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    logged = [event.value for event in events.Scalars("train_loss")]
    # Lightning writes on_step values once per optimizer step: the last of its 2 accumulated micro-batches.
    expected = reference["losses"][1::2]
    assert len(logged) == len(expected) == SHORT_STEPS
    assert logged == pytest.approx(expected, rel=RTOL)
    assert [event.value for event in events.Scalars("tokens")] == reference["tokens"][1::2]


def _assert_monitored(folder: Path, reference: dict, schedule: PipelineSchedule) -> None:
    """The strategy's monitor (added because the run logs to TensorBoard): model FLOPs and gradient norms equal the
    single-process run's, the bubble is measured next to its theory, and the timeline holds every action."""
    logged = scalars(folder)
    assert {value for _, value in logged["flops/model_flops_per_batch"]} == {reference["model_flops"]}
    for step, norm in logged["grad_norm"]:
        assert norm == pytest.approx(reference["grad_norms"][step - 1], rel=RTOL)
    theory = schedule.theoretical_bubble()
    assert ("pipeline/bubble_theory" in logged) == (theory is not None)  # none for zero-bubble schedules
    if theory is not None:
        assert logged["pipeline/bubble_theory"][0][1] == pytest.approx(theory)
    assert all(0 < bubble < 1 for _, bubble in logged["pipeline/bubble"])
    # The first timeline, after the third optimizer step: per rank, each of its stages runs every microbatch forward
    # once and backward once, either whole (B) or as input then weight gradients (I + W; zero-bubble schedules,
    # some or all microbatches).
    trace = json.loads((folder.parent / "traces" / f"step_{FIRST_TIMELINE_STEP}.json").read_text())["traceEvents"]
    for rank in range(2):
        kinds = [e["name"][0] for e in trace if e["ph"] == "X" and e["tid"] == rank]
        per_rank = schedule.microbatches * schedule.virtual_stages
        assert kinds.count("F") == kinds.count("B") + kinds.count("I") == per_rank
        assert kinds.count("W") == kinds.count("I")
        assert (kinds.count("I") > 0) == schedule.splits_weight_gradients


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "schedule", "layers", "microbatches"),
    # One schedule per model keeps the suite short; pp=2 runs every schedule on both models.
    [("gpt", "1f1b", 4, None), ("llama", "interleaved_1f1b", 8, 4)],
    ids=["gpt-1f1b", "llama-interleaved"],
)
def test_pp4_matches_reference(model: str, schedule: str, layers: int, microbatches: int | None,
                               reference_run: ReferenceFn, tmp_path: Path) -> None:
    reference = reference_run(model, 1, layers)
    options = {"pp_schedule": schedule} | ({"microbatches": microbatches} if microbatches else {})
    result = _pipeline_run(tmp_path, model, pp=4, layers=layers, **options)
    assert_equivalent(reference, result, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_dp2_tp2_pp2_on_8_ranks_matches_reference(
    model: str, reference_run: ReferenceFn, uninterrupted, tmp_path: Path
) -> None:
    if model == "gpt":  # shared with the checkpoint tests (saving a checkpoint changes no number): 6 steps
        assert CHECKPOINTED_LAYERS == LAYERS
        reference = reference_run(model, 2, LAYERS)
        result, _ = uninterrupted("dp2_tp2_pp2")
    else:  # the short run: 8 ranks on 2 cores are bound by the steps
        reference = reference_run(model, 2, LAYERS, short=True)
        result = _pipeline_run(tmp_path, model, pp=2, devices=8, extra=("--dp", 2, "--tp", 2, *SHORT_RUN))
    assert result["world_size"] == 8
    assert_equivalent(reference, result, rtol=RTOL)


@pytest.mark.slow
@pytest.mark.parametrize("model", PIPELINE_MODEL_NAMES)
def test_third_party_block_styles_match_reference(model: str, reference_run: ReferenceFn, tmp_path: Path) -> None:
    """Blocks taking keyword arguments built outside the trunk and returning tuples; unmodified HF Llama
    (rotary tables from the embedding's output, causal mask and position ids built by the model)."""
    reference = reference_run(model, 1, LAYERS)
    result = _pipeline_run(tmp_path, model, pp=2)
    assert_equivalent(reference, result, rtol=RTOL)


@pytest.mark.slow
def test_checkpoint_and_early_stopping_decide_alike_on_all_ranks(tmp_path: Path) -> None:
    result = run_script([
        "--model", "llama", "--pp", 2, "--devices", 2, "--layers", LAYERS, "--monitor", "--out", tmp_path / "out.pt",
    ])
    decisions = result["rank_decisions"]
    assert len(decisions) == 2 and all(d == decisions[0] for d in decisions)
    assert decisions[0]["should_stop"] and decisions[0]["best_model_path"].endswith("step=4.ckpt")


@pytest.mark.slow
def test_bf16_mixed_pipeline_trains_close_to_fp32(reference_run: ReferenceFn, tmp_path: Path) -> None:
    """Stand-ins for other stages' blocks see inputs in bf16 like the real blocks do (Llama's rotary tables)."""
    reference = reference_run("llama", 1, LAYERS)
    result = _pipeline_run(tmp_path, "llama", pp=2, extra=("--precision", "bf16-mixed"))
    assert {p.dtype for p in result["params"].values()} == {torch.float32}  # fp32 master weights
    # bf16 has 8 bits of mantissa (relative rounding 4e-3): losses stay within a few roundings of fp32.
    worst = max(abs(a - b) / a for a, b in zip(reference["losses"], result["losses"]))
    assert worst < 2e-2
    assert result["losses"][-1] < result["losses"][0]
