"""The main recipe runs with the strategy on CPU and writes TensorBoard logs that hold the training loss."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_recipe_defaults_train_tp_x_pp_and_log_to_tensorboard(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "recipes/pretrain_gpt.py", "--max-steps", "20", "--log-dir", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert "tensor-parallel plan (tp=2)" in output
    assert "pipeline 1f1b over 2 stages, blocks per stage [2, 2], 2 microbatches" in output

    events = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {tmp_path}"
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 2  # logged every 10 of 20 steps
    assert losses[-1] < losses[0] - 0.3  # the tiny GPT learns the generated grammar quickly
