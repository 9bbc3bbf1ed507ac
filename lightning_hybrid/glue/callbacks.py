"""The callbacks the strategy's features work through, added to the Trainer once at setup (a user's own instance of
one is kept).

Example::

    add_strategy_callbacks(trainer, strategy.options, monitor=True)
"""

from __future__ import annotations

from typing import Union

from lightning.pytorch import Trainer

from lightning_hybrid.glue.checkpoint_records import CheckpointRecords
from lightning_hybrid.glue.model_summary import use_whole_model_summary
from lightning_hybrid.observe.monitor import ParallelMonitor, add_monitor
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.resilience.replicas import add_replica_check
from lightning_hybrid.resilience.watchdog import add_watchdog


def add_strategy_callbacks(trainer: Trainer, options: HybridOptions, monitor: Union[bool, ParallelMonitor]) -> None:
    """What checkpoints record (:class:`CheckpointRecords`), the monitor, the whole-model summary, the watchdog and
    the replica check, as ``options`` and ``monitor`` ask."""
    if not any(isinstance(callback, CheckpointRecords) for callback in trainer.callbacks):
        trainer.callbacks.append(CheckpointRecords())
    add_monitor(trainer, monitor)
    use_whole_model_summary(trainer)  # the summary table counts every pipeline stage, not rank 0's
    add_watchdog(trainer, options.watchdog_timeout)
    add_replica_check(trainer, options.check_replicas_every_n_steps)
