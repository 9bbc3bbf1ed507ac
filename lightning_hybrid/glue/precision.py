"""Lightning precision plugins for the hybrid strategy: dtype handling and gradient clipping over the whole mesh.

With FSDP2 the ``bf16-mixed`` flag is served by FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`
(see :func:`lightning_hybrid.parallel.fsdp.mixed_precision_policy`), not by autocast:

================  ======================  =================  ===================  ==================
precision         sharded parameters      compute / gather   gradient reduction   optimizer state
================  ======================  =================  ===================  ==================
``32-true``       fp32                    fp32               fp32                 fp32
``bf16-mixed``    fp32 (master weights)   bf16               fp32                 fp32
``bf16-true``     bf16                    bf16               bf16                 bf16
``16-true``       fp16                    fp16               fp16                 fp16
================  ======================  =================  ===================  ==================

Gradient clipping by norm (``gradient_clip_val``) goes through
:func:`lightning_hybrid.parallel.grad_norm.clip_grad_norm_`: every gradient of the model, over every mesh and
pipeline stage, on the strategy's device (the plugin's ``device``).
"""

from __future__ import annotations

import sys
from typing import Any, Optional, Union

import torch
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch.optim import Optimizer

from lightning_hybrid.options.hybrid_options import SUPPORTED_PRECISION
from lightning_hybrid.parallel.grad_norm import clip_grad_norm_


class _MeshClipping:
    """Mixin: clip by the norm over all meshes (and pipeline stages) instead of Lightning's ``clip_grad_norm_``."""

    #: Set by the strategy when pp > 1 (a :class:`~lightning_hybrid.pipeline.runtime.Pipeline`): the norm adds up
    #: over the stages of the pipeline, each tied weight once.
    pipeline: Optional[Any] = None
    #: Set by the strategy at setup: the device it computes on, where the norm is reduced over the pipeline.
    device: Optional[torch.device] = None
    #: Set by the strategy at setup with ep > 1: experts spread whole over the ep ranks add their norms over them.
    experts: Optional[Any] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        pipeline = self.pipeline
        group, elsewhere = (pipeline.pp_group, pipeline.counted_elsewhere()) if pipeline is not None else (None, ())
        clip_grad_norm_(self.main_params(optimizer), clip_val, pipeline_group=group,  # type: ignore[attr-defined]
                        counted_elsewhere=elsewhere, device=self.device,
                        spread=self.experts.spread_norms if self.experts is not None else {})


class HybridPrecision(_MeshClipping, Precision):
    """``32-true`` and ``bf16-mixed`` (bf16 handled by FSDP2's mixed-precision policy, so no autocast)."""

    def __init__(self, precision: str = "32-true") -> None:
        super().__init__()
        self.precision = precision  # type: ignore[assignment]


class HybridHalfPrecision(_MeshClipping, HalfPrecision):
    """``bf16-true`` / ``16-true``: parameters, gradients and optimizer state all in bf16 / fp16 (no loss scaling,
    as in Lightning's ``HalfPrecision``)."""


def precision_plugin_for(flag: str) -> Precision:
    """The plugin that serves a Lightning precision flag under :class:`HybridStrategy`."""
    if flag not in SUPPORTED_PRECISION:
        raise ValueError(
            f"HybridStrategy does not support precision={flag!r}. Choose one of {', '.join(SUPPORTED_PRECISION)}."
        )
    if flag in ("bf16-true", "16-true"):
        return HybridHalfPrecision(flag)  # type: ignore[arg-type]
    return HybridPrecision(flag)


def serving_plugin(plugin: Precision | None) -> Precision | None:
    """The plugin :class:`HybridStrategy` uses for the one Lightning hands it (``None`` stays ``None``)."""
    refuse_standalone_lightning(plugin)
    # Lightning hands ModelParallelStrategy an autocast plugin for bf16-mixed; FSDP2's policy does that job here.
    if plugin is not None and not isinstance(plugin, (HybridPrecision, HybridHalfPrecision)):
        plugin = precision_plugin_for(getattr(plugin, "precision", "32-true"))
    return plugin


_STANDALONE_PACKAGE_MESSAGE = (
    "HybridStrategy is built on `lightning.pytorch` (the `lightning` package) and was given to a Trainer of the"
    " standalone `pytorch_lightning` package, whose classes are separate. Import Trainer and LightningModule from"
    " lightning.pytorch: `from lightning.pytorch import Trainer, LightningModule`."
)


def refuse_standalone_lightning(plugin: object) -> None:
    """Stop with a message naming the fix when a ``pytorch_lightning.Trainer`` hands the strategy its plugin."""
    if type(plugin).__module__.startswith("pytorch_lightning."):
        raise ValueError(_STANDALONE_PACKAGE_MESSAGE)


def let_standalone_trainer_reach_precision(strategy_class: type) -> None:
    """Make a ``pytorch_lightning.Trainer`` accept ``strategy_class`` far enough to hand it a precision plugin,
    where :func:`refuse_standalone_lightning` explains the problem; otherwise it rejects the strategy with a
    generic "invalid strategy"."""
    standalone = sys.modules.get("pytorch_lightning.strategies")
    if standalone is not None:
        standalone.Strategy.register(strategy_class)
