"""What a HybridStrategy run shows on the console, in one process: the model summary counts each parameter once
(tied weights, meta-device models), the progress bar shows one loss, the current step's, and tokens/s over the
monitor's logging window. The pipeline's share of it (the whole model over two stages, tp2 × pp2) is checked on
the recipe's run in ``tests/test_recipe.py``."""

from __future__ import annotations

import itertools
import os
from types import SimpleNamespace
from typing import Iterator

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.model_summary import summarize
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_hybrid import HybridStrategy
from lightning_hybrid.observe import monitor
from lightning_hybrid.observe.profiling import without_kineto_markers
from lightning_hybrid.observe.progress import ProgressFigures, rate_over, shows_own_loss
from lightning_hybrid.glue.model_summary import HybridModelSummary, HybridRichModelSummary
from lightning_hybrid.observe.parameter_counts import WholeModelSummary
from tests.models import LMLightningModule, RandomTokenDataset, build_module, default_config
from tests.observe.drawn_bar import RecordingTQDMProgressBar

BATCH, SEQ = 2, default_config("tied")["seq_len"]
WINDOW = 4  # Trainer(log_every_n_steps=...): the monitor's logging window
STEPS = 10


# ------------------------------------------------------------------------------------------------- summary
@pytest.mark.parametrize("init", ["eager", "meta"])
def test_the_summary_counts_a_tied_weight_once_and_meta_parameters_by_shape(init: str) -> None:
    plain = build_module("tied")  # its head is the token embedding's weight
    assert plain.model.head.weight is plain.model.embed.weight
    expected = summarize(plain, max_depth=2)
    module = build_module("tied", init=init)
    module.configure_model()  # init="meta": the model is built on the meta device here
    summary = WholeModelSummary(module, max_depth=2)
    assert summary.total_parameters == summary.trainable_parameters == expected.total_parameters == 36_800
    assert summary.total_parameters == sum(p.numel() for p in plain.parameters())
    # Per row too: the tied weight in both the embedding's and the head's row, as Lightning counts it.
    assert summary.layer_names == expected.layer_names and summary.param_nums == expected.param_nums


def test_a_frozen_parameter_is_counted_but_not_trainable() -> None:
    module = build_module("tied")
    module.model.embed.weight.requires_grad_(False)
    summary = WholeModelSummary(module)
    assert summary.total_parameters - summary.trainable_parameters == module.model.embed.weight.numel() == 64 * 32


# ------------------------------------------------------------------------------------------- progress bar
def test_the_rate_is_the_windows_items_over_its_time() -> None:
    figures = ProgressFigures()
    assert figures.rate() is None
    rates = []
    for tokens, seconds in [(100, 1.0), (100, 0.25), (300, 0.75), (100, 0.5)]:
        figures.add_batch(tokens, seconds, window=3)
        rates.append(figures.rate(replicas=2))
    # 200/1 s, 400/1.25 s, 1000/2 s, then the first batch leaves the window: 1000/1.5 s (2 replicas each).
    assert rates == pytest.approx([200.0, 320.0, 500.0, 1000 / 1.5])
    assert rate_over([(100, 1.0), (100, 0.25)]) == 160.0  # not the mean of 100/s and 400/s


def test_a_module_showing_any_loss_keeps_it() -> None:
    assert shows_own_loss({"train_loss": 1.0, "v_num": 0})
    assert shows_own_loss({"loss_total": 1.0})
    assert not shows_own_loss({"loss": 1.0, "tokens/s": 10.0, "v_num": 0})  # the monitor's own key


class ShowsItsLoss(LMLightningModule):
    """Puts its training loss in the progress bar itself, as the recipe's module does."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss


def step_seconds(batch: int) -> float:
    """The fake clock's duration of training batch ``batch`` (exact in binary floating point)."""
    return (batch + 1) * 0.125


def fake_clock() -> Iterator[float]:
    """``perf_counter()`` readings: the monitor reads it at each batch's start and end, batch ``i`` lasting
    :func:`step_seconds`."""
    for batch in itertools.count():
        yield 100.0 * batch
        yield 100.0 * batch + step_seconds(batch)


@pytest.mark.usefixtures("one_process_fit")
@pytest.mark.parametrize(("module_class", "loss_key"), [(LMLightningModule, "loss"), (ShowsItsLoss, "train_loss")])
def test_the_bar_shows_one_current_loss_and_tokens_per_second_over_the_window(
    module_class: type, loss_key: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    capfd: pytest.CaptureFixture[str]
) -> None:
    clock = fake_clock()
    monkeypatch.setattr(monitor, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    bar = RecordingTQDMProgressBar()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), max_steps=STEPS, logger=False,
                      log_every_n_steps=WINDOW, enable_checkpointing=False, callbacks=[bar])
    data = RandomTokenDataset(BATCH * STEPS, SEQ, seed=1)
    trainer.fit(module_class(model="tied"), DataLoader(data, batch_size=BATCH))

    assert [record["batch"] for record in bar.records] == list(range(STEPS))
    for record in bar.records:
        assert [key for key in record["drawn"] if "loss" in key] == [loss_key]
        assert record["drawn"][loss_key] == pytest.approx(record["step_loss"], rel=1e-6)  # this batch's, not the last
    # Batches 0 (schedules, warm-up) and 1 (profiled) are not measured; then the last WINDOW measured batches.
    tokens = BATCH * SEQ
    for record in bar.records:
        measured = [b for b in range(2, record["batch"] + 1)][-WINDOW:]
        expected = tokens * len(measured) / sum(map(step_seconds, measured)) if measured else None
        assert record["drawn"].get("tokens/s") == (pytest.approx(expected) if measured else None), record
    summary_types = {type(c) for c in trainer.callbacks if isinstance(c, ModelSummary)}
    assert summary_types <= {HybridModelSummary, HybridRichModelSummary} and summary_types
    assert not any(type(c) in (ModelSummary, RichModelSummary) for c in trainer.callbacks)
    assert ("HybridStrategy: 36,800 parameters in 1 pipeline stage, each on 1 rank (tp 1 × dp 1):\n"
            "  stage 0: 36,800 parameters, held per rank: 36,800") in caplog.messages
    console = capfd.readouterr()  # the file descriptors: what kineto's C++ logging writes goes there
    assert "profiler_st" not in console.err + console.out  # its markers around the profiled batch


def test_the_monitor_is_placed_before_the_progress_bar() -> None:
    bar = RecordingTQDMProgressBar()
    given = monitor.ParallelMonitor()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=given), logger=False,
                      enable_checkpointing=False, callbacks=[bar])
    monitor.add_monitor(trainer, given)
    assert trainer.callbacks.index(given) < trainer.callbacks.index(bar)


def test_only_kinetos_markers_are_dropped_from_standard_error(capfd: pytest.CaptureFixture[str]) -> None:
    with without_kineto_markers():
        os.write(2, b"USDT:2026-12-02 04:25:01 2648:2648 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"[W1202 04:25:01] a real warning\n")
        os.write(2, b"USDT:2026-12-02 04:25:02 2648:2648 SyncActivityProfilerHandler.cpp:59] profiler_stop\n")
    assert capfd.readouterr().err == "[W1202 04:25:01] a real warning\n"


class RecordingLogger(Logger):
    """The metrics every ``log_metrics`` call received, with their step."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict[str, float]]] = []

    name, version = "recording", 0

    def log_hyperparams(self, params: object, *args: object, **kwargs: object) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.logged.append((step, dict(metrics)))


@pytest.mark.usefixtures("one_process_fit")
def test_with_accumulation_the_monitor_logs_on_lightnings_cadence_of_optimizer_steps() -> None:
    """``Trainer(log_every_n_steps=2, accumulate_grad_batches=2)``: Lightning logs every 2 optimizer steps, i.e. every
    4 batches; so does the monitor (8 batches: at steps 2 and 4), not every 2 batches."""
    logger = RecordingLogger()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), max_steps=4, logger=logger,
                      log_every_n_steps=2, accumulate_grad_batches=2, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(LMLightningModule(model="tied"), DataLoader(RandomTokenDataset(16, SEQ, seed=1), batch_size=BATCH))
    assert [step for step, metrics in logger.logged if "throughput/tokens_per_sec" in metrics] == [2, 4]
