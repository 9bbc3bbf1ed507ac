"""torchmetrics objects under the hybrid layout: what Lightning's documented ``self.log("acc", self.acc)`` needs.

* **Reduction over data-parallel ranks only.** A ``Metric`` syncs its states over its ``process_group`` (the whole
  job by default) when it computes. Tensor-parallel and pipeline ranks of one data-parallel replica update it with
  the same samples, so over the whole job they would be counted tp × pp times; :func:`sync_over` points every
  metric of the module at the data-parallel group, as the strategy's own ``reduce`` does for logged tensors.
* **Pipelined steps.** Only the last stage computes predictions, once per microbatch, while every rank logs (rank 0
  holds the logger) and a step's value must be that of the whole batch. Inside the pipelined step the metric calls
  are recorded instead of run (:func:`recording_metric_calls`; a call of the metric still returns its value on the
  microbatch, computed on a clean copy); afterwards the last stage's calls are sent to every rank of the pipeline
  and replayed there with their inputs concatenated over the microbatches (:func:`combine_metric_calls`,
  :func:`replay_metric_calls`): every rank's metric then holds the states a single device would, and Lightning's
  ``on_step`` value, ``on_epoch`` ``compute()`` and ``reset()`` work unchanged.

Example::

    sync_over(lightning_module, data_mesh.get_group())
    calls: list = []
    with recording_metric_calls(lightning_module, calls):   # per step, on the pipeline's stages
        lightning_module.training_step(microbatch, 0)
    replay_metric_calls(lightning_module, combine_metric_calls(per_microbatch_calls), device)   # on every rank
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_hybrid._compat import tree_flatten, tree_map, tree_unflatten

#: One recorded call: (the metric's name in the module, "forward" or "update", args, kwargs).
MetricCall = tuple[str, str, tuple, dict]


@dataclass(frozen=True)
class MetricRef:
    """A ``Metric`` passed to ``self.log`` in a pipelined step, by its name in the LightningModule."""

    name: str


def metrics_of(module: nn.Module) -> dict[str, Metric]:
    """Every torchmetrics ``Metric`` in ``module``, by name (metric collections' members included)."""
    return {name: m for name, m in module.named_modules() if isinstance(m, Metric)}


def sync_over(module: nn.Module, group: Any) -> None:
    """Make every metric of ``module`` sync its states over ``group`` (the data-parallel ranks)."""
    for metric in metrics_of(module).values():
        metric.process_group = group


@contextlib.contextmanager
def recording_metric_calls(module: nn.Module, calls: list[MetricCall]) -> Iterator[None]:
    """Within the context, calling a metric of ``module`` or its ``update`` appends the call (inputs detached, on
    CPU) to ``calls`` and leaves the metric unchanged; a call returns the metric's value on those inputs alone."""
    metrics = metrics_of(module)
    clean = {name: _clean_copy(metric) for name, metric in metrics.items()}
    # torchmetrics keeps a wrapped ``update`` per instance: the originals are put back as they were.
    originals = {name: {key: vars(metric).get(key) for key in ("forward", "update")} for name, metric in metrics.items()}
    for name, metric in metrics.items():
        metric.forward = _recorder(name, "forward", calls, clean[name])  # instance attributes shadow the methods
        metric.update = _recorder(name, "update", calls, None)
    try:
        yield
    finally:
        for name, metric in metrics.items():
            for key, original in originals[name].items():
                if original is None:
                    delattr(metric, key)
                else:
                    setattr(metric, key, original)


def _clean_copy(metric: Metric) -> Metric:
    group, metric.process_group = metric.process_group, None  # a process group cannot be deep-copied
    try:
        copy = metric.clone()
    finally:
        metric.process_group = group
    copy.dist_sync_on_step = False  # computed on the stage's ranks alone: no collective there
    return copy


def _recorder(name: str, method: str, calls: list[MetricCall], clean: Any) -> Callable[..., Any]:
    def record(*args: Any, **kwargs: Any) -> Any:
        calls.append((name, method, *tree_map(_to_cpu, (args, kwargs))))
        if clean is None:
            return None
        clean.reset()
        return clean(*args, **kwargs)

    return record


def combine_metric_calls(per_microbatch: list[list[MetricCall]]) -> list[MetricCall]:
    """The step's calls: the k-th call of each microbatch merged into one, tensor inputs concatenated along
    dimension 0 (the microbatches' samples, in order), other inputs taken from the first microbatch."""
    if not per_microbatch:
        return []
    combined = []
    for calls in zip(*per_microbatch):
        name, method = calls[0][0], calls[0][1]
        flat = [tree_flatten((call[2], call[3])) for call in calls]
        leaves = [torch.cat(values) if isinstance(values[0], Tensor) and values[0].dim() > 0 else values[0]
                  for values in zip(*(leaves for leaves, _ in flat))]
        args, kwargs = tree_unflatten(leaves, flat[0][1])
        combined.append((name, method, args, kwargs))
    return combined


def replay_metric_calls(module: nn.Module, calls: list[MetricCall], device: torch.device) -> None:
    """Run the recorded calls on ``module``'s own metrics, inputs moved to ``device``."""
    for name, method, args, kwargs in calls:
        args, kwargs = tree_map(lambda v: v.to(device) if isinstance(v, Tensor) else v, (args, kwargs))
        getattr(module.get_submodule(name), method)(*args, **kwargs)


def _to_cpu(value: Any) -> Any:
    return value.detach().cpu() if isinstance(value, Tensor) else value
