"""What :class:`~lightning_hybrid.observe.monitor.ParallelMonitor` shows in the progress bar: one loss, and the
throughput over the logging window.

* **One loss, the current step's.** A module that puts a loss of its own in the bar (``self.log("train_loss", loss,
  prog_bar=True)``: any progress-bar key naming a loss, logged during the first training batch) keeps it alone;
  otherwise the monitor shows ``loss``, the loss the training step returned (under pipeline parallelism the last
  stage's, sent to every rank of the pipeline with the step's output, so it is the same step's value).
* **tokens/s** (``samples/s`` for batches without token ids): the tokens of every data-parallel replica in the
  last ``window`` measured training batches divided by those batches' time, ``window`` being the monitor's logging
  interval (``log_every_n_steps``). A single batch's figure jumps with every scheduling hiccup; over the window, at
  each logging step it is the ``throughput/tokens_per_sec`` logged for the same batches. Before the window has
  filled it covers the batches so far.
* Both are logged before the bar draws: Lightning's progress bars draw in their ``on_train_batch_end`` from the
  metrics logged so far, so values logged by a callback after the bar showed one batch late.
  :func:`place_before_progress_bar` puts the monitor in front of it.

Example::

    figures = ProgressFigures()
    figures.add_batch(count=2048, seconds=0.5, window=10)   # per measured batch
    figures.show(trainer, pl_module, outputs, replicas=2)    # in on_train_batch_end, before the bar draws
"""

from __future__ import annotations

from collections import deque
from typing import Any, Iterable, Optional

import lightning.pytorch as pl
from torch import Tensor

#: Progress-bar key of the loss the monitor shows when the module shows none.
LOSS_KEY = "loss"


def rate_over(batches: Iterable[tuple[int, float]], replicas: int = 1) -> float:
    """Items per second over ``(items, seconds)`` batches of one replica, for ``replicas`` replicas: total items
    over total time (not the mean of per-batch rates, which short batches would dominate)."""
    counts, seconds = zip(*batches)
    return sum(counts) * replicas / sum(seconds)


def shows_own_loss(progress_bar_metrics: Iterable[str]) -> bool:
    """Whether the module puts a loss in the progress bar itself (a key that names one, other than the monitor's)."""
    return any("loss" in key.lower() for key in progress_bar_metrics if key != LOSS_KEY)


class ProgressFigures:
    """The monitor's progress-bar figures (see the module docstring): the measured batches of the current window
    and the decision, made on the first training batch, whether to show the step's loss."""

    def __init__(self) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=1)
        self._unit = "tokens/s"
        self._shows_loss: Optional[bool] = None

    def add_batch(self, count: int, seconds: float, window: int, tokens: bool = True) -> None:
        """Record one measured training batch of one replica: ``count`` tokens (samples if not ``tokens``)."""
        if self._recent.maxlen != window:
            self._recent = deque(self._recent, maxlen=window)
        self._recent.append((count, seconds))
        self._unit = "tokens/s" if tokens else "samples/s"

    def rate(self, replicas: int = 1) -> Optional[float]:
        """Items per second of ``replicas`` replicas over the recorded window; ``None`` before any batch."""
        return rate_over(self._recent, replicas) if self._recent else None

    def show(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, replicas: int) -> None:
        """Log this batch's figures to the progress bar (only there: ``logger=False``)."""
        if trainer.progress_bar_callback is None:
            return
        if self._shows_loss is None:  # decided once: the keys logged by the first training step
            self._shows_loss = not shows_own_loss(trainer.progress_bar_metrics)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self._shows_loss and isinstance(loss, Tensor) and loss.numel() == 1:
            pl_module.log(LOSS_KEY, loss.detach(), prog_bar=True, logger=False, on_step=True, on_epoch=False)
        rate = self.rate(replicas)
        if rate is not None:
            pl_module.log(self._unit, rate, prog_bar=True, logger=False, on_step=True, on_epoch=False)


def place_before_progress_bar(trainer: pl.Trainer, callback: pl.Callback) -> None:
    """Move ``callback`` (one of ``trainer.callbacks``) in front of the progress bar, so that what it logs in a
    hook is drawn by the bar in the same hook."""
    bar = trainer.progress_bar_callback
    callbacks = trainer.callbacks
    if bar is None or callbacks.index(callback) < callbacks.index(bar):
        return
    callbacks.remove(callback)
    callbacks.insert(callbacks.index(bar), callback)
