"""What ``ParallelMonitor`` writes about the run (:mod:`lightning_hybrid.observe.run_record`) and its profiler window
(``profile_steps``): argument checks, the texts' formatting, and a one-process fit of a fixed layout whose
TensorBoard log holds the layout, the planner's prediction and a trace. The 4-process tp2 × pp2 run, read back
through TensorBoard's HTTP API, is ``tests/test_recipe.py``."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader

from lightning_hybrid import HybridStrategy, ParallelMonitor
from lightning_hybrid.observe.profiling import profile_window
from lightning_hybrid.observe.run_record import markdown_table, prediction_text, tp_plan_text
from tests.models import RandomTokenDataset, build_module, default_config


@pytest.mark.parametrize("steps", [0, -2, True, (3, 3), (4, 2), (-1, 2), (1, 2, 3), "3", (1.0, 2)])
def test_bad_profile_windows_are_refused(steps: object) -> None:
    with pytest.raises(ValueError, match=r"ParallelMonitor\(profile_steps=.*\) must be a number of batches"):
        ParallelMonitor(profile_steps=steps)  # type: ignore[arg-type]


def test_profile_windows_count_batches_from_the_fits_first() -> None:
    assert profile_window(None, 1) is None
    assert profile_window(3, 1) == range(2, 5)  # after the monitor's own measured batch
    assert profile_window((5, 8), 1) == range(5, 8)
    assert profile_window([0, 2], 1) == range(0, 2)  # LightningCLI passes a list
    assert ParallelMonitor(profile_steps=(10, 13)).profile_steps == range(10, 13)


def test_texts_are_markdown_tables_or_say_why_not() -> None:
    assert markdown_table(("a", "b"), [(1, "x"), (2, "y")]) == "| a | b |\n|---|---|\n| 1 | x |\n| 2 | y |"
    assert tp_plan_text({}, 1) == "no tensor-parallel plan (tp=1)"
    assert tp_plan_text({"b.*.fc": "colwise", "a": "rowwise"}, 2).splitlines()[2:] == ["| `a` | rowwise |",
                                                                                     "| `b.*.fc` | colwise |"]
    assert prediction_text(None, "no prediction: because") == "no prediction: because"


@pytest.mark.slow
def test_a_fixed_layout_logs_its_layout_prediction_and_trace(tmp_path: Path) -> None:
    config = default_config("gpt")
    data = RandomTokenDataset(24, config["seq_len"], config["vocab_size"], seed=1)
    monitor = ParallelMonitor(profile_steps=(1, 3), log_every_n_steps=2, timeline_every_n_steps=None)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=monitor), max_steps=6,
                      logger=TensorBoardLogger(tmp_path, name=""), enable_progress_bar=False,
                      enable_checkpointing=False)
    environment = dict(os.environ)
    try:
        trainer.fit(build_module("gpt"), DataLoader(data, batch_size=4))
    finally:  # as tests/planner/test_auto_layout.py: no process group or launch variables left behind
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.clear()
        os.environ.update(environment)
    estimate = trainer.strategy.layout_estimate
    assert estimate is not None and str(estimate.layout) == "dp1 tp1 pp1 z3"
    assert trainer.strategy.layout_note.startswith("Hardware: CPU probe: matmul")
    events = EventAccumulator(str(tmp_path / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    predicted = {tag: events.Scalars(tag)[0].value for tag in ("plan/memory_gib", "plan/tokens_per_sec")}
    assert predicted["plan/memory_gib"] == pytest.approx(estimate.memory.total / 2**30, rel=1e-5)
    assert predicted["plan/tokens_per_sec"] == pytest.approx(estimate.tokens_per_second, rel=1e-5)
    layout = events.Tensors("run/layout/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "| tp | 1 |" in layout and "| schedule | none |" in layout
    traces = sorted((tmp_path / "version_0" / "profiler").glob("rank0.*.pt.trace.json"))
    assert len(traces) == 1 and json.loads(traces[0].read_text())["traceEvents"]
    assert "comm/share_of_step" not in events.Tags()["scalars"]  # the window covered the monitor's batch 1
