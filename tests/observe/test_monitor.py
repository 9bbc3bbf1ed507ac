"""``ParallelMonitor``: what a dp2 × tp2 × pp2 run logs to TensorBoard, checked against the single-process run.

The 8-rank run is the shared 3D GPT run of ``tests/conftest.py::uninterrupted`` (it logs to TensorBoard, so the
strategy adds its monitor; that run's losses and parameters are also checked against the reference elsewhere, so
the monitor demonstrably changes no number). Every schedule's bubble and FLOPs are checked in
``tests/pipeline/test_pipeline.py`` on the pp=2 runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_hybrid import HybridStrategy, ParallelMonitor
from lightning_hybrid.observe.monitor import add_monitor, default_batch_tokens
from tests.conftest import CHECKPOINTED_LAYERS, ReferenceFn
from tests.equivalence import ACCUMULATE_GRAD_BATCHES
from tests.helpers import scalars
from tests.models import default_config

FLOAT_BYTES = 4


def images(folder: Path) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"images": 0})
    events.Reload()
    return [image.step for image in events.Images("pipeline/timeline")]


# ----------------------------------------------------------------------------------------------- options
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"log_every_n_steps": 0}, "log_every_n_steps=0"),
        ({"timeline_every_n_steps": True}, "timeline_every_n_steps=True"),
        ({"peak_flops": -1.0}, "peak_flops=-1.0"),
    ],
)
def test_bad_monitor_options_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelMonitor(**kwargs)


def test_strategy_refuses_a_monitor_that_is_not_one() -> None:
    with pytest.raises(ValueError, match=r"monitor='tensorboard'.*ParallelMonitor"):
        HybridStrategy(monitor="tensorboard")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("monitor", "logger", "progress_bar", "added"),
    [(True, True, False, True), (True, False, True, True), (True, False, False, False), (False, True, True, False)],
)
def test_monitor_is_added_when_something_shows_it(
    monitor: bool, logger: bool, progress_bar: bool, added: bool, tmp_path: Path
) -> None:
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=monitor),
                      enable_progress_bar=progress_bar, logger=TensorBoardLogger(tmp_path) if logger else False,
                      enable_checkpointing=False)
    add_monitor(trainer, monitor)
    assert sum(isinstance(c, ParallelMonitor) for c in trainer.callbacks) == int(added)


def test_a_configured_monitor_is_used_as_given(tmp_path: Path) -> None:
    monitor = ParallelMonitor(peak_flops=1e12)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=monitor), logger=False,
                      enable_progress_bar=False)
    add_monitor(trainer, monitor)
    assert [c for c in trainer.callbacks if isinstance(c, ParallelMonitor)] == [monitor]


def test_tokens_are_the_token_ids_of_the_batch() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert default_batch_tokens((ids, ids)) == 64
    assert default_batch_tokens({"pixels": torch.zeros(4, 3, 8, 8)}) == 0


# ------------------------------------------------------------------------------------------ the 3D run
@pytest.fixture(scope="module")
def logged_3d(uninterrupted, reference_run: ReferenceFn) -> tuple[dict, dict, Path, dict]:
    result, _ = uninterrupted("dp2_tp2_pp2")
    reference = reference_run("gpt", 2, CHECKPOINTED_LAYERS)
    folder = result["tensorboard"]
    return scalars(folder / "version_0"), reference, folder, result


@pytest.mark.slow
def test_model_flops_and_grad_norm_equal_the_single_process_run(logged_3d) -> None:
    logged, reference, _, _ = logged_3d
    # Summed over 8 ranks (DTensor shares, the tp-replicated LM head counted once, stand-ins not at all) = torch's
    # FlopCounterMode on the whole single-process model, same batch.
    assert reference["model_flops"] > 0
    assert {value for _, value in logged["flops/model_flops_per_batch"]} == {reference["model_flops"]}
    # Logged at optimizer step S (1-based): the norm before clipping of that step, over all meshes and stages.
    norms = dict(logged["grad_norm"])
    assert sorted(norms) == list(range(1, 7))
    for step, norm in norms.items():
        assert norm == pytest.approx(reference["grad_norms"][step - 1], rel=1e-5)


@pytest.mark.slow
def test_the_model_summary_counts_the_whole_3d_model(logged_3d) -> None:
    _, reference, _, result = logged_3d
    # FSDP2's and the tensor-parallel shards at their global size, both pipeline stages: what one process counts.
    assert result["summary_parameters"] == reference["summary_parameters"]
    assert reference["summary_parameters"][0] == sum(t.numel() for t in reference["params"].values())


@pytest.mark.slow
def test_throughput_counts_each_data_parallel_replica_once(logged_3d) -> None:
    logged, _, _, result = logged_3d
    global_batch = result["args"]["global_batch"]  # 2 replicas × 4 samples; the 4 tp × pp ranks of one share them
    seq_len = default_config("gpt")["seq_len"]
    for (_, samples), (_, tokens), (_, step_time) in zip(
        logged["throughput/samples_per_sec"], logged["throughput/tokens_per_sec"], logged["throughput/step_time_sec"]
    ):
        assert samples * step_time == pytest.approx(global_batch)
        assert tokens * step_time == pytest.approx(global_batch * seq_len)


@pytest.mark.slow
def test_communication_volume_matches_the_layout(logged_3d) -> None:
    logged, _, _, result = logged_3d
    config = default_config("gpt")
    per_replica_batch = result["args"]["global_batch"] // 2
    activation = per_replica_batch * config["seq_len"] * config["embed_dim"] * FLOAT_BYTES  # all microbatches
    comm = {tag.split("/")[-1]: values[0][1] for tag, values in logged.items() if tag.startswith("comm/bytes")}
    # Pipeline: each microbatch's activation forward (stage 0) or its gradient backward (stage 1), nothing else.
    assert comm["send"] == comm["recv"] == activation
    # Tensor parallel (Megatron): 2 all-reduces of the activation per block forward, 2 backward; 2 blocks per
    # stage; plus the vocabulary-sharded embedding's output (stage 0, forward) or the column-parallel head's input
    # gradient (stage 1, backward): one activation more. Beyond that only scalars: the loss and gradient-norm
    # reductions of this step (< 1 KiB).
    tensor_parallel = (4 * (CHECKPOINTED_LAYERS // 2) + 1) * activation
    assert tensor_parallel <= comm["all_reduce"] < tensor_parallel + 1024, comm
    # FSDP2 over dp=2: one reduce-scatter of the stage's (tp-local) gradients per step = 2 × the rank's shard.
    local = result["rank_local_parameter_bytes"]  # per global rank: stage 0 holds ranks 0-3, stage 1 ranks 4-7
    assert comm["reduce_scatter"] == 2 * max(local)
    # ZeRO-2, the default under pp: each block gathered once per step, not once per microbatch forward and backward;
    # the last stage also gathers the head's logits over the vocabulary shards (all microbatches' full logits).
    logits = per_replica_batch * config["seq_len"] * config["vocab_size"] * FLOAT_BYTES
    assert comm["all_gather"] == max(2 * max(local[:4]), 2 * max(local[4:]) + logits), comm
    assert 0 < logged["comm/share_of_step"][0][1] < 1


@pytest.mark.slow
def test_memory_and_bubble_are_logged_per_rank(logged_3d) -> None:
    logged, _, _, _ = logged_3d
    for (_, low), (_, high), (_, rank) in zip(
        logged["memory/peak_gib_min"], logged["memory/peak_gib_max"], logged["memory/peak_max_rank"]
    ):
        assert 0 < low <= high and rank in range(8)
    assert all(value == pytest.approx(1 / 3) for _, value in logged["pipeline/bubble_theory"])  # 1F1B, p=2, m=2
    for _, bubble in logged["pipeline/bubble_rank_0"] + logged["pipeline/bubble_rank_1"]:
        assert 0 < bubble < 1


@pytest.mark.slow
def test_timeline_images_and_chrome_traces_after_warm_up_then_every_4_batches(logged_3d) -> None:
    _, _, folder, _ = logged_3d
    batches = 6 * ACCUMULATE_GRAD_BATCHES
    first = 3 * ACCUMULATE_GRAD_BATCHES  # the third optimizer step: schedules built and warmed up
    at = [first] + [batch for batch in range(4, batches + 1, 4) if batch > first]
    optimizer_steps_at = [batch // ACCUMULATE_GRAD_BATCHES for batch in at]
    assert images(folder / "version_0") == optimizer_steps_at == [3, 4, 6]
    for step in optimizer_steps_at:
        events = json.loads((folder / "traces" / f"step_{step}.json").read_text())["traceEvents"]
        actions = sorted((e["tid"], e["name"]) for e in events if e["ph"] == "X")
        assert actions == [(0, "B0"), (0, "B1"), (0, "F0"), (0, "F1"), (1, "B0"), (1, "B1"), (1, "F0"), (1, "F1")]


@pytest.mark.parametrize("name, precision, expected", [
    ("NVIDIA H200", "bf16-mixed", 989e12),   # Lightning's table lists the H200 with its sparse 2.0e15
    ("NVIDIA H100 80GB HBM3", "32-true", 67e12),
    ("NVIDIA H100 80GB HBM3", "16-mixed", 989e12),
    ("NVIDIA A10G", "bf16-mixed", 125e12),   # no preset: the number of Lightning's table
])
def test_mfu_divides_by_the_dense_peak_of_the_gpu(name: str, precision: str, expected: float, monkeypatch) -> None:
    from types import SimpleNamespace

    from lightning_hybrid.planner.hardware_probe import device_peak_flops

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=80 * 2**30))
    assert device_peak_flops(torch.device("cuda", 0), precision) == pytest.approx(expected)
    assert device_peak_flops(torch.device("cpu"), precision) is None
