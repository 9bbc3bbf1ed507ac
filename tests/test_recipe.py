"""The main recipe runs with the strategy on CPU and writes TensorBoard logs that hold the training loss, the
strategy monitor's figures and the pipeline timeline; the progress bar shows the loss and tokens/s."""

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
    command = [sys.executable, "recipes/pretrain_gpt.py", "--max-steps", "20", "--log-dir", str(tmp_path),
               "--timeline-every-n-steps", "10", "--peak-flops", "1e11"]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    output = done.stdout + done.stderr
    assert "tensor-parallel plan (tp=2)" in output
    assert "pipeline 1f1b over 2 stages, blocks per stage [2, 2], 2 microbatches" in output
    assert "tokens/s:" in done.stdout and "loss:" in done.stdout  # Lightning's progress bar

    events = sorted(tmp_path.rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {tmp_path}"
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"images": 0})
    accumulator.Reload()
    losses = [event.value for event in accumulator.Scalars("train_loss")]
    assert len(losses) == 2  # logged every 10 of 20 steps
    assert losses[-1] < losses[0] - 0.3  # the tiny GPT learns the generated grammar quickly
    for tag in ("throughput/tokens_per_sec", "flops/mfu", "memory/peak_gib_max", "pipeline/bubble",
                "pipeline/bubble_theory", "comm/share_of_step", "grad_norm"):
        assert len(accumulator.Scalars(tag)) == 2, tag
    mfu = accumulator.Scalars("flops/mfu")[-1].value
    tflops = accumulator.Scalars("flops/tflops_per_sec_per_device")[-1].value
    assert mfu == pytest.approx(tflops * 1e12 / 1e11)
    assert [image.step for image in accumulator.Images("pipeline/timeline")] == [10, 20]


@pytest.mark.slow
def test_fine_tuning_recipe_loads_trains_exports_and_reloads_with_from_pretrained(tmp_path: Path) -> None:
    """recipes/finetune_hf.py with its defaults (tp=2 x pp=2 on 4 CPU processes): a saved Hugging Face checkpoint
    read into the shards, fine-tuned, exported, and reloaded by transformers, better than before."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "recipes/finetune_hf.py", "--max-steps", "20", "--out", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {line.split(":")[0]: line for line in done.stdout.splitlines() if ": " in line and "val loss" in line}
    before, after = (float(lines[key].split("val loss ")[1].split(",")[0]) for key in ("pretrained", "fine-tuned"))
    assert after < before - 1.0  # 20 steps learn much of the reversal task
    assert (tmp_path / "hf" / "config.json").is_file() and any((tmp_path / "hf").glob("*.safetensors"))
    events = sorted((tmp_path / "logs").rglob("events.out.tfevents.*"))
    accumulator = EventAccumulator(str(events[0].parent))
    accumulator.Reload()
    assert len(accumulator.Scalars("train_loss")) == 2  # logged every 10 of 20 steps
