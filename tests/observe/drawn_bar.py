"""Progress bars that record what they draw after each training batch, next to the loss the step returned: the
console tests compare the two. ``RecordingRichProgressBar(path)`` is given to a recipe on its command line
(``--trainer.callbacks+=tests.observe.drawn_bar.RecordingRichProgressBar --trainer.callbacks.path=drawn.json``) and
writes its records as JSON on global rank 0 at the end of training; ``RecordingTQDMProgressBar`` keeps them in
memory for an in-process fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar


class _RecordsDrawnMetrics:
    """After the bar's own ``on_train_batch_end``, what it drew (its numeric metrics) and the step's loss."""

    records: list[dict]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]
        drawn = self.get_metrics(trainer, pl_module)  # type: ignore[attr-defined]
        self.records.append({"batch": batch_idx, "step_loss": float(outputs["loss"]),
                             "drawn": {key: value for key, value in drawn.items() if isinstance(value, (int, float))}})


class RecordingTQDMProgressBar(_RecordsDrawnMetrics, TQDMProgressBar):
    """Lightning's tqdm bar, recording each training batch's drawn metrics in :attr:`records`."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records = []


class RecordingRichProgressBar(_RecordsDrawnMetrics, RichProgressBar):
    """Lightning's Rich bar (the recipes' default), writing each training batch's drawn metrics to ``path``."""

    def __init__(self, path: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.path = path
        self.records = []

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)
        if self.path is not None and trainer.is_global_zero:
            Path(self.path).write_text(json.dumps(self.records))
