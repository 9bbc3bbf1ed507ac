"""Microbatches of batches that differ from step to step: their shapes, and each one's share of the step's loss.

**Shapes.** A torch ``PipelineStage`` fixes the shapes of what it receives when its schedule first runs. With
dynamic padding every batch has its own sequence length, and a last batch may be smaller (torch's schedules then
split it into microbatches of unequal sizes, as ``torch.tensor_split`` does). Before a step whose microbatch
shapes differ from the previous step's, :class:`StageBuffers` runs a *shape pass* per distinct microbatch shape
(the user's step with every unit standing in: no FLOPs, no communication, see
:meth:`~lightning_hybrid.pipeline.dispatch.UnitDispatcher.boundary_shapes`) and gives each stage's receive
buffers the shapes of that step. One schedule per mode, whatever the number of shapes: nothing grows with them.
What a stage receives gets its gradient made contiguous (:func:`received_with_contiguous_gradients`): torch lays
the previous stage's receive buffer for it out like it.

**Regrouping.** :func:`regrouped` deals a batch's samples to other microbatches, for the setup check of what
microbatching changes where no unsplit model exists (:func:`~lightning_hybrid.pipeline.verify.check_regrouped`).

**Loss shares.** The step's loss must be the full batch's, also when its microbatches hold different numbers of
loss terms (padding tokens ignored, a smaller last microbatch). Each microbatch's loss is weighted by its number
of terms: when the step computes its loss with ``cross_entropy`` or ``nll_loss`` and ``reduction="mean"`` (what a
token-mean language-model loss with ``ignore_index=-100`` labels is), the count of targets it averaged over (their
class weights' sum where ``weight`` is given) — otherwise, the microbatch's number of samples. A mean over equal
parts is the mean of the parts; a token mean over padded parts is the weighted mean of their means.

Example::

    with counting_loss_terms() as terms:
        loss = module.training_step(microbatch, 0)
    terms.count                                     # 37.0: the non-ignored targets of its cross_entropy
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_hybrid._compat import tree_flatten, tree_unflatten
from lightning_hybrid._compat.pipelining import resize_stage_buffers, stage_buffers_ready

_MEAN_LOSSES = {F.cross_entropy: inspect.signature(F.cross_entropy), F.nll_loss: inspect.signature(F.nll_loss)}


def _split_leaves(batch: Any, microbatches: int) -> tuple[list[list[Any]], Any]:
    """Each microbatch's leaves and the batch's tree spec (see :func:`split_microbatches`). Each tensor is split once
    for all microbatches: split per microbatch, a step cost grew with the square of their number."""
    leaves, spec = tree_flatten(batch)
    parts = [v.tensor_split(microbatches) if isinstance(v, Tensor) and v.dim() > 0 else [v] * microbatches
             for v in leaves]
    return [[part[index] for part in parts] for index in range(microbatches)], spec


def split_microbatches(batch: Any, microbatches: int) -> list[Any]:
    """The batch's microbatches as torch's schedules split it: every tensor along dimension 0 (``tensor_split``:
    sizes differ by at most one sample), anything else repeated."""
    per_microbatch, spec = _split_leaves(batch, microbatches)
    return [tree_unflatten(leaves, spec) for leaves in per_microbatch]


def regrouped(batch: Any, microbatches: int) -> Optional[Any]:
    """The batch with its samples dealt to the microbatches in turn (sample ``j`` of microbatch ``i`` moves to
    microbatch ``j mod microbatches``), so that every microbatch holds other samples together than before; ``None``
    where microbatches hold one sample each or differ in size (no regrouping then changes what they hold)."""
    size = samples(batch)
    if size % microbatches or size // microbatches < 2:
        return None
    order = torch.arange(size).view(microbatches, -1).t().reshape(-1)
    leaves, spec = tree_flatten(batch)
    moved = [leaf[order.to(leaf.device)] if isinstance(leaf, Tensor) and leaf.dim() > 0 and leaf.shape[0] == size
             else leaf for leaf in leaves]
    return tree_unflatten(moved, spec)


def samples(batch: Any) -> int:
    """The number of samples of a (micro)batch: the smallest first dimension of its tensors."""
    return min(t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0)


class LossTerms(TorchFunctionMode):
    """Counts the terms a ``reduction="mean"`` cross-entropy / NLL loss averages over; ``count`` stays ``None``
    when there is no such call, or when several disagree (which one is the step's loss cannot be told)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: list[float] = []

    @property
    def count(self) -> Optional[float]:
        return self.counts[0] if self.counts and len(set(self.counts)) == 1 else None

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _MEAN_LOSSES:
            bound = _MEAN_LOSSES[func].bind(*args, **kwargs)
            bound.apply_defaults()
            terms = _mean_terms(bound.arguments)
            if terms is not None:
                self.counts.append(terms)
        return func(*args, **kwargs)


def _mean_terms(arguments: dict[str, Any]) -> Optional[float]:
    """What ``reduction="mean"`` divides by (torch's rule), or ``None`` for another reduction."""
    if arguments["reduction"] != "mean" or arguments["size_average"] is not None or arguments["reduce"] is not None:
        return None
    source, target, weight = arguments["input"], arguments["target"], arguments["weight"]
    if target.is_floating_point():  # class probabilities: the mean is over the samples
        return float(source.numel() // source.shape[1]) if source.dim() > 1 else 1.0
    kept = target != arguments["ignore_index"]
    if weight is None:
        return float(kept.sum())
    return float(weight[target[kept]].sum())


@contextlib.contextmanager
def counting_loss_terms() -> Iterator[LossTerms]:
    """Count the loss terms of the code run inside (see :class:`LossTerms`)."""
    with LossTerms() as terms:
        yield terms


class StageBuffers:
    """Fits this rank's stages' receive buffers to each step's microbatch shapes (see the module docstring)."""

    def __init__(self, stages: list[Any], shape_pass: Callable[[Any], dict[int, list[tuple[int, ...]]]]) -> None:
        self._stages = stages
        self._shape_pass = shape_pass
        self._fitted: Optional[tuple] = None

    def fit(self, batch: Any, microbatches: int) -> None:
        """Make the buffers of every microbatch fit the batch's ``microbatches`` (before the schedule runs them)."""
        # From the split leaves: a microbatch is put together only for a shape pass (rare), not every step.
        parts, spec = _split_leaves(batch, microbatches)
        signature = tuple(tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, Tensor)) for leaves in parts)
        if signature == self._fitted:
            return
        if not stage_buffers_ready(self._stages[0]):
            # torch infers the shapes on the schedule's first step from its first microbatch, for all of them.
            if len(set(signature)) > 1:
                raise ValueError(
                    "With pp > 1 the first batch of a fit or evaluation must split into equal microbatches (torch"
                    f" infers the pipeline's shapes from it); its microbatches have shapes {list(signature)}."
                )
        else:
            sends: dict[tuple, dict[int, list[tuple[int, ...]]]] = {}
            for index, shapes in enumerate(signature):
                if shapes not in sends:
                    sends[shapes] = self._shape_pass(tree_unflatten(parts[index], spec))
                for stage in self._stages:
                    received = sends[shapes].get(stage.stage_index - 1, [])
                    resize_stage_buffers(stage, index, received, sends[shapes].get(stage.stage_index, []))
        self._fitted = signature


class _ContiguousGradient(torch.autograd.Function):
    """The identity, its gradient made contiguous: a stage's received activation's gradient is sent back to the
    stage before, whose receive buffer torch lays out like it (``empty_strided``), and process groups receive only
    into dense tensors. A block may read a slice of what it is handed (Zamba2: half of a concatenation), whose
    gradient is a strided view."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor) -> Tensor:
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, gradient: Tensor) -> Tensor:
        return gradient.contiguous()


def received_with_contiguous_gradients(received: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """What a stage received, its gradients contiguous (:class:`_ContiguousGradient`)."""
    return tuple(_ContiguousGradient.apply(t) if t.requires_grad else t for t in received)
