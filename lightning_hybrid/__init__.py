"""lightning-hybrid: data × tensor × pipeline parallelism for unmodified LightningModules.

Example::

    from lightning.pytorch import Trainer
    from lightning_hybrid import HybridStrategy

    trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp=4))   # dp=2 × tp=4
    trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy=HybridStrategy(tp=4, pp=8))
    trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))  # planned
    trainer.fit(MyLightningModule())

The exports load on first use, so ``lightning-hybrid plan`` and ``lightning-hybrid export`` start without
Lightning's strategy machinery. The strategy registers itself as ``Trainer(strategy="hybrid")`` when it loads:
at ``import lightning_hybrid`` if Lightning is already imported (the usual order), else on first use of
``HybridStrategy``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

#: Public name → module that defines it.
_EXPORTS = {
    "Cluster": "lightning_hybrid.hardware",
    "HybridOptions": "lightning_hybrid.options.hybrid_options",
    "HybridStrategy": "lightning_hybrid.strategy",
    "ParallelDims": "lightning_hybrid.mesh",
    "ParallelMonitor": "lightning_hybrid.observe.monitor",
    "PipelineSchedule": "lightning_hybrid.options.schedules",
}

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_hybrid' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if "lightning.pytorch" in sys.modules:  # a training script: register Trainer(strategy="hybrid") now
    importlib.import_module("lightning_hybrid.strategy")
