"""Lightning precision plugins for the hybrid strategy: dtype handling and gradient clipping over the whole mesh.

With FSDP2 the ``bf16-mixed`` flag is served by FSDP2's :class:`~torch.distributed.fsdp.MixedPrecisionPolicy`
(see :func:`lightning_hybrid.parallel.sharding.mixed_precision_policy`), not by autocast:

================  ======================  =================  ===================  ==================
precision         sharded parameters      compute / gather   gradient reduction   optimizer state
================  ======================  =================  ===================  ==================
``32-true``       fp32                    fp32               fp32                 fp32
``bf16-mixed``    fp32 (master weights)   bf16               fp32                 fp32
``bf16-true``     bf16                    bf16               bf16                 bf16
``16-true``       fp16                    fp16               fp16                 fp16
================  ======================  =================  ===================  ==================

Gradient clipping by norm must see every gradient of the model. Tensor-parallel parameters are DTensors on the
data × tensor mesh while the rest live on the data mesh only, and ``torch.nn.utils.clip_grad_norm_`` refuses to
combine norms from different meshes (torch issue 180346), so :func:`clip_grad_norm_` computes one norm per mesh
and combines them. The norm stays on the device from the per-mesh norms through the pipeline's all-reduce (on the
strategy's device, the plugin's ``device``) to the scaling: clipping never waits for the device.
"""

from __future__ import annotations

import math
import sys
from collections import defaultdict
from typing import Any, Container, Iterable, Optional, Union

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_hybrid.options import SUPPORTED_PRECISION



def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pipeline_group: Optional[dist.ProcessGroup] = None,
    counted_elsewhere: Container[int] = (), device: Optional[torch.device] = None,
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of the model, over every mesh (and pipeline stage): a scalar tensor
    on the gradients' device, on ``device`` when it is combined over ``pipeline_group``. Nothing here reads a value
    back to the host (``float(norm)`` does: call it only where the number is needed, e.g. logging).

    Works when parameters are spread over several device meshes (and plain tensors): the per-mesh norms are
    computed by DTensor, which reduces over each mesh, and combined here. With pipeline stages, each rank holds
    other parameters, so the norms of all ranks of ``pipeline_group`` are combined too, on ``device``: pass the
    device the strategy computes on, the one its collectives need (NCCL refuses a CPU tensor), which a rank
    holding no gradient (a frozen stage) or holding them in CPU memory (offload) cannot tell from its gradients.
    Every rank of the mesh must call it (it communicates). A parameter held by several stages (a tied weight)
    counts once: the ranks that do not count it pass its ``id`` in ``counted_elsewhere``.

    Example::

        norm = total_grad_norm(module.parameters(), pipeline_group=pp_mesh.get_group(), device=torch.device("cuda", 0))
    """
    with_grads = [p for p in parameters if p.grad is not None and id(p) not in counted_elsewhere]
    here = with_grads[0].grad.device if with_grads else device or torch.device("cpu")
    norms = []
    for group in _by_mesh(with_grads).values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norms.append((norm.full_tensor() if isinstance(norm, DTensor) else norm).float().to(here))
    total = torch.linalg.vector_norm(torch.stack(norms), ord=norm_type) if norms else torch.zeros((), device=here)
    if pipeline_group is not None:  # a no-op move on the compute device; offloaded (CPU) gradients' norm goes there
        total = _combine_over_stages(total.to(device or here), norm_type, pipeline_group)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    counted_elsewhere: Container[int] = (),
    device: Optional[torch.device] = None,
) -> torch.Tensor:
    """Clip gradients in place to a total ``norm_type`` norm of ``max_norm``; returns the total norm
    (:func:`total_grad_norm`). The scaling runs where the gradients are: no host synchronization.

    Example::

        clip_grad_norm_(module.parameters(), 1.0, pipeline_group=pp_group, device=strategy.root_device)
    """
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, pipeline_group, counted_elsewhere, device)
    for group in _by_mesh([p for p in parameters if p.grad is not None]).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def _by_mesh(parameters: list[torch.Tensor]) -> dict[object, list[torch.Tensor]]:
    by_mesh: dict[object, list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        by_mesh[grad.device_mesh if isinstance(grad, DTensor) else None].append(parameter)
    return by_mesh


def _combine_over_stages(local: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Every stage's norm combined; ``local`` stays on its device (the collective's), so the host never waits."""
    if math.isinf(norm_type):
        combined = local.clone()
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
        return combined
    powered = local.double() ** norm_type  # double: the sum must not round differently per stage count
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).float()


class _MeshClipping:
    """Mixin: clip by the norm over all meshes (and pipeline stages) instead of Lightning's ``clip_grad_norm_``."""

    #: Set by the strategy when pp > 1 (a :class:`~lightning_hybrid.pipeline.runtime.Pipeline`): the norm adds up
    #: over the stages of the pipeline, each tied weight once.
    pipeline: Optional[Any] = None
    #: Set by the strategy at setup: the device it computes on, where the norm is reduced over the pipeline.
    device: Optional[torch.device] = None

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        pipeline = self.pipeline
        group, elsewhere = (pipeline.pp_group, pipeline.counted_elsewhere()) if pipeline is not None else (None, ())
        clip_grad_norm_(self.main_params(optimizer), clip_val, pipeline_group=group,  # type: ignore[attr-defined]
                        counted_elsewhere=elsewhere, device=self.device)


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
