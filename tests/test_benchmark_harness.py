"""``benchmarks/harness.py``: ranks launched through the test launcher and their results collected, rounds, medians,
least-squares lines and the aligned Markdown tables every benchmark prints."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness import (
    alternating, fit_line, launch_ranks, launch_saved_once, markdown_table, median_gap, rank_result_path,
)
from tests.helpers import REPO_ROOT, ScriptError

SCRIPT = REPO_ROOT / "tests" / "harness_rank.py"


def test_each_rank_saves_its_own_result_and_the_ranks_form_one_group() -> None:
    launched = launch_ranks(SCRIPT, ["--mode", "each"], world=2)
    assert [result["rank"] for result in launched.ranks] == [0, 1]  # listed by global rank
    for result in launched.ranks:
        assert result["world"] == 2 and result["devices"] == 2
        assert result["rank_sum"] == 3.0  # 1 + 2 all-reduced over the two ranks' gloo group
        assert result["threads"] == 1  # OMP_NUM_THREADS=1 applied in the forked rank
    assert launched.wall_s > 0


def test_a_single_rank_launch_gets_no_rank_variables_and_saves_with_torch() -> None:
    (result,) = launch_ranks(SCRIPT, ["--mode", "each"], world=1, suffix=".pt").ranks
    assert (result["rank"], result["world"], result["devices"]) == (0, 1, 1)
    assert torch.equal(result["tensor"], torch.arange(3))


def test_a_result_saved_once_for_all_ranks_is_returned() -> None:
    result = launch_saved_once(SCRIPT, ["--mode", "once"], world=2)
    assert (result["rank"], result["world"], result["rank_sum"]) == (0, 2, 3.0)


def test_a_failing_rank_raises_with_the_tail_of_its_output() -> None:
    with pytest.raises(ScriptError, match="rank 1 failed on purpose"):
        launch_ranks(SCRIPT, ["--mode", "fail"], world=2)


def test_rank_results_sit_beside_the_out_path() -> None:
    assert rank_result_path(REPO_ROOT / "result.json", 3) == REPO_ROOT / "result.rank3.json"


def test_markdown_table_pads_every_column_to_its_widest_cell() -> None:
    table = markdown_table(["layout", "step ms"], [["tp2", "12.5"], ["tp2-pp2", 7]])
    assert table == ("| layout  | step ms |\n"
                     "| ------- | ------- |\n"
                     "| tp2     | 12.5    |\n"
                     "| tp2-pp2 | 7       |")


def test_markdown_table_keeps_three_dashes_and_refuses_a_ragged_row() -> None:
    assert markdown_table(["p"], [[2]]).splitlines()[1] == "| --- |"
    with pytest.raises(ValueError, match="2 cells under 1 columns"):
        markdown_table(["p"], [[2, 3]])


def test_alternating_reverses_the_order_every_other_round() -> None:
    assert list(alternating(["A", "B", "C"], 3)) == [
        (0, "A"), (0, "B"), (0, "C"), (1, "C"), (1, "B"), (1, "A"), (2, "A"), (2, "B"), (2, "C")]


def test_median_gap_leaves_out_the_warm_up_steps() -> None:
    ends = [0.0, 5.0, 6.0, 8.0, 9.0, 12.0]  # steps 1-5 took 5, 1, 2, 1, 3 s
    assert median_gap(ends, 3) == 2.0  # of 2, 1, 3
    assert median_gap(ends, 1, stop=3) == 3.0  # of 5, 1


def test_fit_line_recovers_slope_and_intercept() -> None:
    slope, intercept = fit_line([8, 32, 64], [1.0 + 0.25 * blocks for blocks in (8, 32, 64)])
    assert slope == pytest.approx(0.25) and intercept == pytest.approx(1.0)
