"""The setup probe leaves training as single-device Lightning would have it: the data (the dataloader hook called
once, no batch lost from a stream that cannot rewind), the random streams, BatchNorm's statistics, and inputs
converted by the precision plugin before the probe sees them.

Two launches (``tests/glue/setup_probe_runs.py``): the single-device references in one process, every parallel
case in one launch of 2 ranks. What each layout must keep:

* tp2 draws exactly what one device draws (the model's dropout acts on activations every tensor-parallel rank
  holds whole), so its losses, parameters, BatchNorm statistics and random state after fit equal one device's;
* pp2 cannot: each stage runs on a rank of its own and draws from that rank's generator, and BatchNorm normalizes
  each microbatch by its own statistics (as under gradient accumulation). What must hold there is that setup
  changed nothing: every rank's random state when the first batch starts is one device's, and the BatchNorm
  statistics when training starts are the initial ones.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid import HybridStrategy
from tests.glue.setup_probe_runs import SEQ, VOCAB, ProbeLM, Record
from tests.helpers import relative_difference, run_rank_script

SCRIPT = Path(__file__).with_name("setup_probe_runs.py")
SAMPLES, BATCH = 16, 4


# ------------------------------------------------------------------------------------- in one process
def _batches() -> list[tuple[torch.Tensor, ...]]:
    tokens = torch.randint(0, VOCAB, (SAMPLES, SEQ + 1), generator=torch.Generator().manual_seed(1))
    ids = torch.arange(SAMPLES)
    return [(tokens[i:i + BATCH, :-1], tokens[i:i + BATCH, 1:], ids[i:i + BATCH]) for i in range(0, SAMPLES, BATCH)]


def _fit(data: Any, folder: Path, ckpt_path: str | None = None, callbacks: tuple = (),
         **trainer_kwargs: Any) -> Record:
    """A one-device fit whose logger makes the strategy run the setup probe (the monitor's prediction)."""
    record, module = Record(), ProbeLM(dropout=0.0, batch_norm=False)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), logger=TensorBoardLogger(folder),
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[record, *callbacks],
                      **trainer_kwargs)
    trainer.fit(module, train_dataloaders=data, ckpt_path=ckpt_path)
    assert module.step_calls == len(record.batch_ids) + 1  # the probe's one run, then one per batch
    return record


@pytest.mark.usefixtures("one_process_fit")
def test_a_generator_keeps_the_batch_the_probe_took(tmp_path: Path) -> None:
    def generator() -> Iterator[tuple[torch.Tensor, ...]]:
        yield from _batches()

    record = _fit(generator(), tmp_path, max_epochs=1, enable_checkpointing=False)
    assert record.batch_ids == [batch[2].tolist() for batch in _batches()]


class Batches:
    """An iterable that starts over at every ``iter()``."""

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        return iter(_batches())


@pytest.mark.usefixtures("one_process_fit")
def test_an_iterable_that_starts_over_is_iterated_from_its_start(tmp_path: Path) -> None:
    record = _fit(Batches(), tmp_path, max_epochs=1, enable_checkpointing=False)
    assert record.batch_ids == [batch[2].tolist() for batch in _batches()]


@pytest.mark.usefixtures("one_process_fit")
def test_a_resumed_run_starts_at_the_restored_position_not_at_the_probes_batch(tmp_path: Path) -> None:
    # The probe takes the first batch of the epoch before the checkpoint restores the loader's position; the loop
    # must start where the checkpoint left off (mid-epoch), as it would without the probe.
    tokens, targets, ids = (torch.cat(parts) for parts in zip(*_batches()))
    loader = DataLoader(TensorDataset(tokens, targets, ids), batch_size=BATCH)
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "checkpoints", save_last=True, every_n_train_steps=2)
    first = _fit(loader, tmp_path, max_steps=2, callbacks=(checkpoints,))
    resumed = _fit(loader, tmp_path, max_steps=4, ckpt_path=str(tmp_path / "checkpoints" / "last.ckpt"))
    assert len(first.batch_ids) == len(resumed.batch_ids) == 2
    # The rest of the same epoch's order (Lightning's sampler shuffles): every sample once over the two runs.
    assert sorted(i for batch in first.batch_ids + resumed.batch_ids for i in batch) == list(range(SAMPLES))


# ------------------------------------------------------------------------------------- on two ranks
@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("setup_probe")
    results = run_rank_script(SCRIPT, ["--cases", "single", "single_stream", "single_bf16",
                                       "--out", folder / "single.pt"])
    results.update(run_rank_script(SCRIPT, ["--cases", "tp2", "pp2", "tp2_stream", "tp2_bf16", "pp2_bf16",
                                            "--devices", 2, "--out", folder / "parallel.pt"], nprocs_timeout=600))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2", "pp2", "tp2_stream", "tp2_bf16", "pp2_bf16"])
def test_the_dataloader_hook_is_called_as_often_as_on_one_device(runs: dict[str, Any], case: str) -> None:
    single = runs["single" + case[3:]]["ranks"][0]["dataloader_calls"]
    assert single == 1
    assert [rank["dataloader_calls"] for rank in runs[case]["ranks"]] == [single, single]


@pytest.mark.slow
def test_a_stream_that_cannot_rewind_loses_no_batch(runs: dict[str, Any]) -> None:
    every_sample = [list(range(start, start + BATCH)) for start in range(0, SAMPLES, BATCH)]
    assert runs["single_stream"]["ranks"][0]["batch_ids"] == every_sample
    for rank in runs["tp2_stream"]["ranks"]:
        assert rank["batch_ids"] == every_sample
    assert len(runs["tp2_stream"]["losses"]) == SAMPLES // BATCH


@pytest.mark.slow
def test_tensor_parallel_setup_leaves_dropout_and_batch_norm_as_on_one_device(runs: dict[str, Any]) -> None:
    single, tp2 = runs["single"], runs["tp2"]
    for rank in tp2["ranks"]:
        assert torch.equal(rank["rng_first"], single["ranks"][0]["rng_first"])
        assert torch.equal(rank["rng_end"], single["ranks"][0]["rng_end"])  # the same masks drawn, step by step
    assert len(tp2["losses"]) == len(single["losses"]) == SAMPLES // BATCH
    for got, want in zip(tp2["losses"], single["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)
    assert tp2["state"].keys() == single["state"].keys()
    assert "norm_in.running_mean" in single["state"] and float(single["state"]["norm_in.num_batches_tracked"]) == 4
    for name, want in single["state"].items():
        assert relative_difference(tp2["state"][name], want) <= 1e-5, name


@pytest.mark.slow
def test_pipeline_setup_leaves_the_random_streams_and_batch_norm_untouched(runs: dict[str, Any]) -> None:
    single = runs["single"]["ranks"][0]
    initial = {"running_mean": torch.zeros(32), "running_var": torch.ones(32), "num_batches_tracked": torch.tensor(0)}
    for rank in runs["pp2"]["ranks"]:
        assert torch.equal(rank["rng_first"], single["rng_first"])
    first_stage = runs["pp2"]["ranks"][0]["bn_at_start"]  # the BatchNorm runs before the blocks: stage 0
    assert set(first_stage) == set(initial)
    for name, value in initial.items():
        assert torch.equal(first_stage[name], value), name
    assert torch.equal(single["bn_at_start"]["num_batches_tracked"], torch.tensor(0))


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2_bf16", "pp2_bf16"])
def test_bf16_true_setup_sees_the_inputs_the_steps_see(runs: dict[str, Any], case: str) -> None:
    # Float inputs (features, latents, audio) are converted by the precision plugin before each step; the setup
    # probe runs the step on them converted the same way (every training_step call, the probe's included).
    assert runs["single_bf16"]["ranks"][0]["dtypes"] == ["torch.bfloat16"]
    for rank in runs[case]["ranks"]:
        assert rank["dtypes"] == ["torch.bfloat16"]
    assert len(runs[case]["losses"]) == SAMPLES // BATCH
    for got, want in zip(runs[case]["losses"], runs["single_bf16"]["losses"]):
        assert abs(got - want) <= 2e-2 * abs(want)  # bf16 rounding of sharded and split sums
