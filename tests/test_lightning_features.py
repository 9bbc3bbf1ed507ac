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


def test_consolidated_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    # save_distributed_checkpoint=False: one file written by rank 0, loaded into every rank's shards (fused qkv
    # heads included). Saved at the end of epoch 0 (step 4 of 6); the resumed run trains steps 5 and 6 in new
    # processes and must reproduce the uninterrupted run bit for bit. (Sharded checkpoints: tests/checkpoint/test_checkpoint.py.)
    layout = [*DP2_TP2, "--strategy-kwargs", json.dumps({"save_distributed_checkpoint": False})]
    uninterrupted = run_script(["--model", "gpt", *layout, "--checkpoint-dir", tmp_path / "ckpt", "--out", tmp_path / "a.pt"])
    checkpoint = tmp_path / "ckpt" / "epoch=0-step=4.ckpt"
    assert checkpoint.is_file()
    resumed = run_script(["--model", "gpt", *layout, "--ckpt-path", checkpoint, "--out", tmp_path / "b.pt"])
    assert resumed["losses"] == uninterrupted["losses"][-4:]  # steps 5 and 6, two micro-batches each
    assert resumed["learning_rates"] == uninterrupted["learning_rates"][-2:]
    for name, tensor in uninterrupted["params"].items():
        assert torch.equal(resumed["params"][name], tensor), name


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
    applied_while_sharding = r"offload=, activation_checkpointing=, compile=, loss_parallel=\) are applied while the strategy"
    with pytest.raises(ScriptError, match=applied_while_sharding):
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
