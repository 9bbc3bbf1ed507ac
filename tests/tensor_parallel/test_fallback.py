"""Degrade instead of refusing (:mod:`lightning_hybrid.tensor_parallel.fallback`): what the planner refuses stays
whole on every tensor-parallel rank, the run trains to single-process Lightning's numbers, and the report says
what was kept whole, why, and what it costs; ``tp_strict=True`` refuses as before.

The model (``odd_parts`` of ``tests/zoo.py``): 2 blocks of width 21, each a learned position table (16 × 21, no
linear layer), attention with 3 heads of 7 (q, k, v, o: tp=2 divides neither the heads nor the width, so not even
the gathered layout fits) and an MLP 21 → 42 → 21.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection

import pytest
import torch
from torch import nn

from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.tensor_parallel.block_plan import BlockPlan, PairGroup
from lightning_hybrid.tensor_parallel.fallback import (AppliedPlan, KeptWhole, StructureReport, format_bytes,
                                                        plan_keeping_whole)
from lightning_hybrid.tensor_parallel.refusal import PlanCheckFailed, PlanRefusal
from tests.helpers import SHORT_RUN, assert_equivalent, on_two_ranks, run_script

# The report's numbers, by hand from the layer shapes (per block; 2 blocks; fp32, 4 bytes; tp=2).
DIM, HIDDEN, SEQ, BLOCKS = 21, 42, 16, 2
NORMS = 2 * (2 * DIM)  # two LayerNorms, weight and bias
ATTENTION = 4 * (DIM * DIM + DIM)  # q, k, v, o with biases: kept whole (3 heads)
TABLE = SEQ * DIM  # the position table: kept whole (no linear layer)
MLP_SHARDED = DIM * HIDDEN + HIDDEN + HIDDEN * DIM  # up (column: weight and bias), down's weight (row)
MLP_WHOLE = DIM  # down's bias: added once, after the all-reduce, so whole on every rank
PER_BLOCK = NORMS + ATTENTION + TABLE + MLP_SHARDED + MLP_WHOLE
EXTRA_BYTES = BLOCKS * (ATTENTION + TABLE) * 4 // 2  # their bytes × (1 - 1/tp)


def test_the_hand_counts_add_up() -> None:
    assert (PER_BLOCK, MLP_SHARDED, EXTRA_BYTES) == (4095, 1806, 8736)


# ------------------------------------------------------------------------------------------ the fallback's stages
def _planner(refusals: list[Exception]) -> tuple[Any, list[Collection[str]]]:
    """A plan function raising ``refusals`` in turn, then planning; and the ``keep_whole`` of each call."""
    calls: list[Collection[str]] = []

    def plan(keep_whole: Collection[str]) -> BlockPlan:
        calls.append(tuple(keep_whole))
        if len(calls) <= len(refusals):
            raise refusals[len(calls) - 1]
        return BlockPlan(groups=[PairGroup({}, ["mlp.down"], "mlp")])

    return plan, calls


def test_the_modules_a_refusal_names_stay_whole_and_the_rest_is_planned_again() -> None:
    plan, calls = _planner([PlanRefusal("full", ["pos"], "no linear"), PlanRefusal("heads", ["q", "o"], "3 heads")])
    planned, kept = plan_keeping_whole(plan, {}, strict=False)
    assert calls == [(), ("pos",), ("pos", "q", "o")]
    assert kept == [KeptWhole(("pos",), "no linear"), KeptWhole(("q", "o"), "3 heads")]
    assert planned.groups[0].rows == ["mlp.down"]


def test_a_refusal_naming_no_module_keeps_the_whole_block() -> None:
    plan, calls = _planner([PlanRefusal("pos", ["pos"], "no linear"), PlanCheckFailed("full plan", (), "full")])
    planned, kept = plan_keeping_whole(plan, {"norm": "replicate"}, strict=False)
    assert planned.groups == [] and planned.custom == {}
    assert kept == [KeptWhole(("pos",), "no linear"), KeptWhole((), "full")]
    assert StructureReport("b.*", "Block", 2, 10, 0, tuple(kept)).kept_text() == "pos (no linear); the whole block (full)"


def test_the_report_names_the_layers_sharded_with_their_activations_gathered() -> None:
    report = StructureReport("b.*", "Block", 2, 100, 90, (KeptWhole(("pos",), "no linear"),), 40, ("q", "o"))
    assert report.describe(2) == (
        "tensor parallelism (tp=2) shards 90.0% of the 100 parameters of Block × 2 (b.*); q, o sharded with their"
        " activations gathered (what runs between them is computed whole on every tp rank); kept whole on every tp"
        " rank: pos (no linear); +40 B per tp rank. HybridStrategy(tp_strict=True) refuses instead.")


@pytest.mark.parametrize(("explicit", "strict"), [({}, True), ({"q": "colwise"}, False)])
def test_strict_or_a_style_the_user_gave_refuses(explicit: dict, strict: bool) -> None:
    plan, _ = _planner([PlanCheckFailed("the check failed for q", ["q", "o"], "check")])
    with pytest.raises(PlanCheckFailed, match="the check failed for q"):
        plan_keeping_whole(plan, explicit, strict=strict)
    plan, _ = _planner([PlanCheckFailed("the full plan fails", (), "check")])  # names none: the user's style too
    with pytest.raises(PlanCheckFailed, match="the full plan fails"):
        plan_keeping_whole(plan, {"up": nn.Module()}, strict=False)  # type: ignore[dict-item]


def test_errors_that_are_not_the_planners_refusals_are_never_hidden() -> None:
    for error in (ValueError("tp_plan entry 'x' matches no module"), RuntimeError("a bug in the block")):
        plan, _ = _planner([error])
        with pytest.raises(type(error), match=str(error)):
            plan_keeping_whole(plan, {}, strict=False)


def test_refusals_name_the_modules_and_stay_the_errors_they_were() -> None:
    from lightning_hybrid.tensor_parallel.block_plan import plan_block
    from lightning_hybrid.tensor_parallel.dataflow import trace_block
    from tests.models import build_module

    block = build_module("odd_parts").model.blocks[0]
    x = torch.randn(2, SEQ, DIM)
    with pytest.raises(ValueError, match=r"cannot shard PositionTable 'pos'") as caught:
        plan_block(block, trace_block(block, (x,), {}), 2)
    assert caught.value.modules == ("pos",)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"tp=2 does not divide the layout of 'q': .*3 × 7") as caught:
        plan_block(block, trace_block(block, (x,), {}), 2, {"pos": "replicate"})
    assert caught.value.modules == ("q", "k", "v", "o")  # type: ignore[attr-defined]
    assert isinstance(PlanCheckFailed("x"), RuntimeError)  # what the plan check raised before


def test_the_option_is_a_bool() -> None:
    assert HybridOptions(tp=2).tp_strict is False and HybridOptions(tp=2, tp_strict=True).tp_strict is True
    with pytest.raises(ValueError, match=r"tp_strict='yes'\) is invalid"):
        HybridOptions(tp=2, tp_strict="yes")  # type: ignore[arg-type]


def test_the_applied_plan_is_the_mapping_it_was() -> None:
    plan = AppliedPlan({"b.*.up": "colwise"}, [StructureReport("b.*", "Block", 2, 8, 2, (), 0)])
    assert plan == {"b.*.up": "colwise"} and dict(plan) == {"b.*.up": "colwise"} and plan["b.*.up"] == "colwise"
    assert AppliedPlan() == {} and not AppliedPlan()
    other = AppliedPlan({"b.0.x": "rowwise"}, [StructureReport("b.{0}", "Other", 1, 4, 4, (), 0)])
    assert [s.blocks for s in plan.merged([plan, other]).structures] == ["b.*", "b.{0}"]
    assert (format_bytes(11136), format_bytes(100), format_bytes(3 * 2**30)) == ("10.9 KiB", "100 B", "3.0 GiB")


# ------------------------------------------------------------------------------------------ two ranks
def _strict_refuses_at_setup(rank: int, results: dict) -> None:
    """The driver with ``tp_strict=True``: the planner's refusal, as before, before anything is sharded."""
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.mesh import ParallelDims
    from lightning_hybrid.parallel.parallelize import parallelize
    from lightning_hybrid.probe.blocks import BlockList
    from lightning_hybrid.probe.step_probe import StepProbe
    from tests.models import build_module

    module = build_module("odd_parts").model
    dims = ParallelDims(world_size=2, tp=2)
    mesh, data_mesh = dims.build_mesh("cpu")
    blocks = BlockList("blocks", module.blocks)
    tokens = torch.randint(0, 64, (2, SEQ))
    probe = StepProbe(module, blocks, lambda microbatches: module(tokens), torch.device("cpu"))
    try:
        parallelize(module, "blocks", blocks, mesh, dims, HybridOptions(tp=2, tp_strict=True), data_mesh=data_mesh,
                    precision="32-true", device=torch.device("cpu"), probe=probe)
    except PlanRefusal as refusal:
        if rank == 0:
            results.update(error=str(refusal), untouched=not any(isinstance(p, DTensor) for p in module.parameters()))


@pytest.mark.slow
def test_tp_strict_refuses_at_setup_with_the_planners_message() -> None:
    results = on_two_ranks(_strict_refuses_at_setup)
    assert "cannot shard PositionTable 'pos' in OddPartsBlock" in results["error"]
    assert "tp_plan={'*.pos': 'replicate'}" in results["error"] and results["untouched"]


@pytest.fixture(scope="module")
def odd_parts_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Single-process Lightning and tp=2 (with TensorBoard) on ``odd_parts``: one launch each."""
    folder = tmp_path_factory.mktemp("odd_parts")
    common = ["--model", "odd_parts", *SHORT_RUN]
    reference = run_script([*common, "--reference", "--devices", 1, "--out", folder / "reference.pt"])
    tp2 = run_script([*common, "--tp", 2, "--devices", 2, "--tensorboard", folder / "tb", "--out", folder / "tp2.pt"])
    return {"reference": reference, "tp2": tp2, "folder": folder}  # type: ignore[dict-item]


@pytest.mark.slow
def test_what_tp_cannot_shard_stays_whole_and_trains_like_one_process(odd_parts_runs: dict) -> None:
    assert_equivalent(odd_parts_runs["reference"], odd_parts_runs["tp2"], rtol=1e-5)
    plan = odd_parts_runs["tp2"]["tp_plan"]
    assert dict(plan) == {"model.blocks.*.up": "colwise", "model.blocks.*.down": "rowwise",
                          "model.head": "colwise (vocab, logits gathered)", "model.embed": "rowwise (vocab)"}
    (structure,) = plan.structures
    assert (structure.blocks, structure.block_class, structure.count) == ("model.blocks.*", "OddPartsBlock", 2)
    assert (structure.parameters, structure.sharded) == (BLOCKS * PER_BLOCK, BLOCKS * MLP_SHARDED)
    assert structure.fraction == pytest.approx(1806 / 4095)
    assert [kept.modules for kept in structure.kept_whole] == [("pos",), ("q", "k", "v", "o")]
    assert structure.kept_whole[0].reason == "PositionTable with a 2-D parameter is no linear layer the planner recognizes"
    assert structure.kept_whole[1].reason == "tp=2 does not divide the layout of 'q': its output is reshaped into 3 × 7"
    assert structure.extra_bytes == EXTRA_BYTES and plan.vocab == ""
    # each tp rank holds the whole attention and table, half of the MLP's sharded parameters
    ranks = odd_parts_runs["tp2"]["rank_local_shapes"]
    assert ranks[0]["model.blocks.0.up.weight"] == ((HIDDEN // 2, DIM), (HIDDEN, DIM))
    assert "model.blocks.0.q.weight" not in ranks[0]  # a plain tensor, not a DTensor


@pytest.mark.slow
def test_the_report_is_logged_once_and_written_to_tensorboard(odd_parts_runs: dict) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = (odd_parts_runs["folder"] / "tp2.rank0.log").read_text()
    lines = [line for line in log.splitlines() if "tensor parallelism (tp=2) shards" in line]
    assert len(lines) == 1, log[-3000:]
    assert ("shards 44.1% of the 8,190 parameters of OddPartsBlock × 2 (model.blocks.*); kept whole on every tp"
            " rank: pos (PositionTable with a 2-D parameter") in lines[0]
    assert "q, k, v, o (tp=2 does not divide the layout of 'q'" in lines[0] and "+8.5 KiB per tp rank" in lines[0]
    assert "tensor parallelism (tp=2) shards" not in (odd_parts_runs["folder"] / "tp2.rank1.log").read_text()
    events = EventAccumulator(str(Path(odd_parts_runs["folder"]) / "tb" / "version_0"))
    events.Reload()
    text = events.Tensors("run/tp_plan/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| `model.blocks.*` | 2 × OddPartsBlock | 8,190 | 44.1% | pos (PositionTable" in text
    assert text.rstrip().endswith("| 8.5 KiB |")
