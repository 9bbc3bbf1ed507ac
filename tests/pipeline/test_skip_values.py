"""A pipeline that would train to wrong numbers is stopped at setup: the first batch's pipelined step against the
unsplit step, and with NaN in what stands in for other stages (:mod:`lightning_hybrid.pipeline.verify`). The families whose values skip stages and train right
(two block lists with a conditioning vector, an encoder-decoder) are in the zoo (``tests/test_zoo.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SHORT_RUN, ScriptError, run_script


@pytest.mark.slow
def test_a_value_no_block_is_handed_stops_the_pipeline_at_setup_naming_the_stage(tmp_path: Path) -> None:
    # The first block's output is added to the last one's after the trunk: the last stage only has a stand-in.
    with pytest.raises(ScriptError) as raised:
        run_script(["--model", "early_exit_sum", "--pp", 2, "--devices", 2, *SHORT_RUN, "--out", tmp_path / "run.pt"])
    message = str(raised.value)
    assert "PipelineMismatch" in message and "verification" in message
    assert "differs from the unsplit step on stage 1 ('model.blocks.2' .. 'model.blocks.3')" in message
    assert "[equivalence] training starts" not in message  # before any step


@pytest.mark.slow
def test_without_an_unsplit_step_the_stand_in_check_stops_the_same_pipeline(tmp_path: Path) -> None:
    # On the meta device there is no unsplit step to compare with: NaN in the stand-ins finds the same stage.
    with pytest.raises(ScriptError) as raised:
        run_script(["--model", "early_exit_sum", "--pp", 2, "--devices", 2, "--init", "meta", *SHORT_RUN,
                    "--out", tmp_path / "run.pt"])
    message = str(raised.value)
    assert "not verified against the unsplit step" in message
    assert ("the pipelined step on stage 1 ('model.blocks.2' .. 'model.blocks.3') computes with a value that stands"
            " in for another stage's blocks (NaN put there reaches the loss)") in message
    assert "[equivalence] training starts" not in message


@pytest.mark.slow
@pytest.mark.parametrize("init", ["eager", "meta"])
def test_a_step_microbatching_changes_stops_at_setup_with_or_without_the_unsplit_model(init: str,
                                                                                      tmp_path: Path) -> None:
    # BatchNorm over each forward's samples: on the meta device no unsplit step exists, so the pipelined step on
    # the batch's samples grouped into other microbatches shows it.
    with pytest.raises(ScriptError) as raised:
        run_script(["--model", "batch_normed", "--pp", 2, "--devices", 2, "--init", init, *SHORT_RUN,
                    "--out", tmp_path / "run.pt"])
    message = str(raised.value)
    expected = ("another loss on them than on the whole batch" if init == "eager" else
                "another loss when the batch's samples are grouped into other microbatches")
    assert "PipelineMismatch" in message and expected in message and "pp_microbatches=1" in message
    assert "[equivalence] training starts" not in message
