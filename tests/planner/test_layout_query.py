"""One layout written in words (``lightning-hybrid plan --layout "tp8 pp8 interleaved_1f1b m96 ac"``): read back
from what ``str(layout)`` prints, estimated, and ranked among the layouts the planner tries."""

from __future__ import annotations

import json

import pytest

from lightning_hybrid.cli import main
from lightning_hybrid.hardware import Cluster
from lightning_hybrid.planner.layout import Layout, parse_layout
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.search import candidate_layouts, plan, rank_of
from tests.planner.test_planner import TINY_ARGS, two_nodes_of_four

WRITTEN = [
    Layout(dp=24, tp=8, pp=8, zero=2, pp_schedule="interleaved_1f1b", microbatches=96, virtual_stages=2,
           activation_checkpointing="every"),
    Layout(dp=2, microbatches=4, activation_checkpointing="selective", compile=True, offload=True, reduce_dtype="bf16"),
    Layout(dp=4, tp=2, activation_checkpointing=3, shard_vocab=False, loss_parallel=True),
    Layout(pp=2, zero=2, microbatches=4, accumulate=2, dp_replicate=2),
]


@pytest.mark.parametrize("layout", WRITTEN, ids=str)
def test_what_a_layout_prints_reads_back_equal(layout: Layout) -> None:
    assert parse_layout(str(layout)) == layout


def test_left_out_words_take_the_strategys_defaults() -> None:
    layout = parse_layout("tp8 pp8 interleaved-1f1b m96 ac", gpus=1536)
    assert (layout.dp, layout.zero, layout.virtual_stages) == (24, 2, None)  # 1536 / 64; ZeRO-2 under a pipeline
    assert parse_layout("TP2, acc4", gpus=8) == Layout(dp=4, tp=2, zero=3, microbatches=4)  # pp = 1: accumulation
    with pytest.raises(ValueError, match="cannot read 'mb4'. A layout is written as words"):
        parse_layout("dp2 mb4")
    with pytest.raises(ValueError, match="12 GPUs do not split into tp × pp × rep × cp = 8"):
        parse_layout("tp8", gpus=12)


def test_rank_counts_the_faster_layouts_that_fit() -> None:
    model = ModelShape(layers=4, hidden=1024, heads=8, vocab=1000, seq_len=1024)
    ranked = plan(model, two_nodes_of_four(), 64)
    fitting = [e for e in ranked if e.feasible]
    assert rank_of(fitting[0], ranked) == 1 and rank_of(fitting[3], ranked) <= 4
    assert rank_of(next(e for e in ranked if not e.feasible), ranked) is None


def test_interleaving_tries_more_virtual_stages_where_they_split_the_layers_evenly() -> None:
    cluster = Cluster(nodes=1, gpus_per_node=2, memory_bytes=1e9, peak_flops=1e12, intra_node_bandwidth=1e9,
                      inter_node_bandwidth=1e9)
    stages = {layout.virtual_stages for layout in candidate_layouts(cluster, 8, ("interleaved_1f1b",), layers=8)
              if layout.pp == 2}
    assert stages == {2, 4}  # 8 layers over 2 ranks: 3 stages per rank would not split them evenly


def test_cli_prints_one_layouts_breakdown_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--layout", "dp4 tp2 z3"])
    out = capsys.readouterr().out
    assert "dp4 tp2 pp1 z3" in out and "Seconds per step on the busiest rank: compute" in out
    assert "Memory on the fullest GPU (only stage): parameters" in out
    assert "Rank " in out and "layouts that fit" in out
    main(TINY_ARGS + ["--layout", "pp8"])  # 8 stages for 2 layers
    assert "It does not fit (8 pipeline stages for 2 layers" in capsys.readouterr().out


def test_cli_json_gives_the_layout_and_its_rank(capsys: pytest.CaptureFixture[str]) -> None:
    main(TINY_ARGS + ["--json", "--top", "1", "--layout", "tp2", "--compile", "--reduce-dtype", "bf16"])
    report = json.loads(capsys.readouterr().out)
    asked = report["layout"]
    assert asked["layout"] == "dp4 tp2 pp1 z3 compile reduce=bf16" and asked["degrees"]["compile"] is True
    assert asked["rank"] >= 1 and report["feasible"][0]["degrees"]["reduce_dtype"] == "bf16"
