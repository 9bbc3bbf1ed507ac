"""Lightning behaviour users rely on keeps working under HybridStrategy: checkpoint resume, callbacks' decisions,
precision flags, and modules that parallelize themselves in ``configure_model``.

Each test runs ``tests/equivalence.py`` in subprocesses (see ``tests/helpers.py``); the standard stays "same
numbers as single-process Lightning doing the same thing".
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import ReferenceFn
from tests.helpers import ScriptError, assert_equivalent, run_script

pytestmark = pytest.mark.slow
DP2_TP2 = ["--dp", 2, "--tp", 2, "--devices", 4]


@pytest.mark.parametrize("distributed", [True, False], ids=["sharded", "consolidated"])
def test_resume_matches_single_process_resume(distributed: bool, tmp_path: Path) -> None:
    # Save a checkpoint at the end of epoch 0 (step 4 of 6), then resume in a new process group. Sharded: one DCP
    # shard per rank; consolidated: one file written by rank 0 (save_distributed_checkpoint=False).
    layout = [*DP2_TP2, "--strategy-kwargs", json.dumps({"save_distributed_checkpoint": distributed})]
    run_script(["--model", "gpt", *layout, "--checkpoint-dir", tmp_path / "hybrid", "--out", tmp_path / "a.pt"])
    run_script(["--model", "gpt", "--reference", "--dp", 2, "--checkpoint-dir", tmp_path / "single",
                "--out", tmp_path / "ra.pt"])
    hybrid_ckpt = tmp_path / "hybrid" / "epoch=0-step=4.ckpt"
    if distributed:
        assert sorted(p.suffix for p in hybrid_ckpt.iterdir()).count(".distcp") == 4  # one shard file per rank
    else:
        assert hybrid_ckpt.is_file()
    resumed = run_script(["--model", "gpt", *layout, "--ckpt-path", hybrid_ckpt, "--out", tmp_path / "b.pt"])
    single = run_script(["--model", "gpt", "--reference", "--dp", 2,
                         "--ckpt-path", tmp_path / "single" / "epoch=0-step=4.ckpt", "--out", tmp_path / "rb.pt"])
    assert len(resumed["losses"]) == 4  # steps 5 and 6, two micro-batches each
    # Parameters (whole heads of the fused qkv included), AdamW moments, step counts, learning rate and scheduler
    # must all come back: any one missing changes the first update after the resume.
    assert_equivalent(single, resumed, rtol=1e-5)


def test_checkpoint_and_early_stopping_decide_alike_on_every_rank(tmp_path: Path) -> None:
    result = run_script(["--model", "llama", *DP2_TP2, "--monitor", "--out", tmp_path / "out.pt"])
    decisions = result["rank_decisions"]
    assert len(decisions) == 4
    assert all(d == decisions[0] for d in decisions), decisions
    # EarlyStopping's divergence threshold stops training at the first validation (end of epoch 0, step 4).
    assert decisions[0]["should_stop"] and decisions[0]["global_step"] == 4
    assert decisions[0]["best_model_path"].endswith("epoch=0-step=4.ckpt")


def test_module_that_parallelizes_itself_is_left_alone(reference_run: ReferenceFn, tmp_path: Path) -> None:
    result = run_script(["--model", "gpt", "--dp", 2, "--devices", 2, "--user-parallel", "--out", tmp_path / "u.pt"])
    assert result["tp_plan"] == {}
    assert_equivalent(reference_run("gpt", 2), result, rtol=1e-5)


def test_offload_needs_the_strategy_to_shard(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match=r"offload=, activation_checkpointing=\) are applied while the strategy"):
        run_script(["--model", "gpt", "--devices", 1, "--user-parallel", "--strategy-kwargs", '{"offload": true}',
                    "--out", tmp_path / "u.pt"])


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.float32), ("bf16-true", torch.bfloat16)])
def test_bf16_precisions_train_close_to_fp32(
    precision: str, dtype: torch.dtype, reference_run: ReferenceFn, tmp_path: Path
) -> None:
    reference = reference_run("gpt", 2)
    result = run_script(["--model", "gpt", *DP2_TP2, "--precision", precision, "--out", tmp_path / "bf16.pt"])
    # bf16-mixed keeps fp32 master weights; bf16-true trains bf16 parameters.
    assert {p.dtype for p in result["params"].values()} == {dtype}
    # bf16 has 8 bits of mantissa (relative rounding 4e-3): losses stay within a few roundings of fp32.
    worst = max(abs(a - b) / a for a, b in zip(reference["losses"], result["losses"]))
    print(f"{precision}: max relative loss difference to fp32 {worst:.2e}")
    assert worst < 2e-2
    assert result["losses"][-1] < result["losses"][0]
