"""The model summary callbacks of a parallel run: Lightning's ``ModelSummary`` and ``RichModelSummary`` counting
the whole model over every pipeline stage (:class:`~lightning_hybrid.observe.parameter_counts.WholeModelSummary`),
with one line per stage after the table (:func:`~lightning_hybrid.observe.parameter_counts.describe_shares`).
``HybridStrategy`` puts them in place of Lightning's own at setup (:func:`use_whole_model_summary`), keeping their
options.

Example::

    Trainer(strategy=HybridStrategy(pp=2), callbacks=[HybridModelSummary(max_depth=2)])
"""

from __future__ import annotations

from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_hybrid._compat import summary_depth
from lightning_hybrid.observe.parameter_counts import WholeModelSummary, describe_shares, summarize_whole_model


class _WholeModelCounts:
    """What both summary callbacks change: the summary they build, and the stage lines after the table."""

    _whole_model: Optional[WholeModelSummary] = None

    # Lightning's ModelSummary builds its summary in this one overridable factory (its DeepSpeed variant is chosen
    # there); everything the table and the totals print comes from the object returned.
    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> WholeModelSummary:
        self._whole_model = summarize_whole_model(trainer, pl_module, summary_depth(self))
        return self._whole_model

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._whole_model = None
        super().on_fit_start(trainer, pl_module)  # type: ignore[misc]
        if self._whole_model is not None:  # None: max_depth=0 turned the summary off
            rank_zero_info(describe_shares(self._whole_model, trainer))


class HybridModelSummary(_WholeModelCounts, ModelSummary):
    """Lightning's ``ModelSummary`` callback counting the whole model (see the module docstring).

    Example::

        Trainer(strategy=HybridStrategy(pp=2), callbacks=[HybridModelSummary(max_depth=2)])
    """


class HybridRichModelSummary(_WholeModelCounts, RichModelSummary):
    """Lightning's ``RichModelSummary`` callback counting the whole model (see the module docstring)."""


#: Lightning's summary callback classes and what :func:`use_whole_model_summary` makes of them.
_WHOLE_MODEL_CLASSES: dict[type, type] = {ModelSummary: HybridModelSummary, RichModelSummary: HybridRichModelSummary}


def use_whole_model_summary(trainer: pl.Trainer) -> None:
    """Make the trainer's Lightning summary callback (``ModelSummary`` or ``RichModelSummary``, the default one or
    the user's) count the whole model. Its class is swapped in place, which keeps its ``max_depth`` and options; a
    subclass of the user's own is left as it is."""
    for callback in trainer.callbacks:
        replacement = _WHOLE_MODEL_CLASSES.get(type(callback))
        if replacement is not None:
            callback.__class__ = replacement
