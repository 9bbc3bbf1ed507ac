"""Lightning semantics of a pipelined step: the batch split into microbatches, the step's output, ``self.log``.

Each microbatch's loss is scaled in the schedule's loss function (see :mod:`lightning_hybrid.pipeline.runtime`);
what Lightning sees of the step is put together here: the values the last stage's ``self.log`` calls produced are
combined over microbatches (by their ``reduce_fx``; means weighted by each microbatch's loss terms, see
:mod:`lightning_hybrid.pipeline.microbatches`) and replayed on every rank, so rank 0's logger and the callbacks see
them; the step's output (scalars averaged over microbatches with the same weights, batched tensors concatenated)
is returned on every rank.

Example::

    logs: list = []
    with recording_logs(module, logs):           # per step (each microbatch takes its part)
        output = module.training_step(microbatch, 0)
    for name, value, kwargs in combine_logs(per_microbatch_logs, weights=[37.0, 41.0]):
        original_log(module)(name, value, **kwargs)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

from lightning_hybrid._compat import tree_flatten, tree_unflatten
from lightning_hybrid.pipeline.metric_calls import MetricRef, metrics_of, recording_metric_calls
from lightning_hybrid.probe.blocks import detached


def check_batch(batch: Any, microbatches: int) -> None:
    """Refuse a batch with fewer samples than ``microbatches`` (a smaller last batch splits into unequal parts)."""
    sizes = {t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise ValueError("With pp > 1 the batch must contain tensors to split into microbatches along dimension 0.")
    size = min(sizes)
    if size < microbatches:
        raise ValueError(
            f"A batch of {size} samples cannot be split into {microbatches} microbatches"
            f" (HybridStrategy(microbatches={microbatches})). Use batches of at least that many samples, and"
            " drop_last=True in the DataLoader if the last batch of the dataset is smaller."
        )


def to_cpu(value: Any) -> Any:
    """A tensor detached and on CPU (to be sent as an object); anything else unchanged."""
    return value.detach().cpu() if isinstance(value, Tensor) else value


def _weighted_mean(values: Tensor, weights: list[float]) -> Tensor:
    share = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    return (values.double() * share.view(-1, *[1] * (values.dim() - 1))).sum(0).to(values.dtype)


def combine_outputs(outputs: list[Any], step_name: str, weights: list[float]) -> Any:
    """Scalars are means weighted by the microbatches' loss terms (``weights``); batched tensors concatenate."""
    if not outputs or outputs[0] is None:
        return None
    flat = [tree_flatten(o)[0] for o in outputs]
    spec = tree_flatten(outputs[0])[1]
    combined = []
    for values in zip(*flat):
        first = values[0]
        if isinstance(first, Tensor) and first.dim() == 0:
            combined.append(_weighted_mean(torch.stack(values), weights))
        elif isinstance(first, Tensor):
            combined.append(torch.cat(values))
        else:
            combined.append(values[-1])
    return tree_unflatten(combined, spec)


_REDUCTIONS = {"mean": torch.mean, "sum": torch.sum, "max": torch.amax, "min": torch.amin}


def combine_logs(per_microbatch: list[list[tuple[str, Any, dict]]], weights: list[float]) -> list[tuple[str, Any, dict]]:
    """One ``self.log`` call per name whose value is the microbatch values reduced by the call's ``reduce_fx``
    ("mean": weighted by the microbatches' loss terms, ``weights``)."""
    calls: dict[str, list[tuple[Any, dict, float]]] = {}
    for logs, weight in zip(per_microbatch, weights, strict=True):
        for name, value, kwargs in logs:
            calls.setdefault(name, []).append((value, kwargs, weight))
    combined = []
    for name, entries in calls.items():
        kwargs = dict(entries[-1][1])
        if isinstance(entries[-1][0], MetricRef):  # the metric itself: its calls are replayed, then it is logged
            combined.append((name, entries[-1][0], kwargs))
            continue
        reduce = _reduction(kwargs.get("reduce_fx", "mean"), name)
        values = torch.stack([torch.as_tensor(to_cpu(v), dtype=torch.float64) for v, _, _ in entries])
        value = _weighted_mean(values, [w for _, _, w in entries]) if reduce is torch.mean else reduce(values, 0)
        first = entries[0][0]
        value = value.to(first.dtype) if isinstance(first, Tensor) else value.item()
        if "batch_size" in kwargs:
            kwargs["batch_size"] = sum(e[1]["batch_size"] for e in entries)
        combined.append((name, value, kwargs))
    return combined


def _reduction(reduce_fx: Any, name: str) -> Callable[..., Tensor]:
    key = reduce_fx if isinstance(reduce_fx, str) else getattr(reduce_fx, "__name__", "")
    key = {"amax": "max", "amin": "min"}.get(key, key)
    if key not in _REDUCTIONS:
        raise ValueError(
            f"self.log({name!r}, reduce_fx={reduce_fx!r}): with pp > 1 the strategy combines a step's microbatch"
            " values itself and knows 'mean', 'sum', 'max' and 'min'."
        )
    return _REDUCTIONS[key]


@contextlib.contextmanager
def recording_logs(module: Any, logs: list) -> Iterator[None]:
    """Collect ``self.log(name, value, ...)`` calls of the step instead of logging them (a torchmetrics ``Metric``
    as a :class:`~lightning_hybrid.pipeline.metric_calls.MetricRef` to it)."""
    metric_names = {id(metric): name for name, metric in metrics_of(module).items()}

    def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError("With pp > 1, pass self.log options by keyword (e.g. self.log(name, value, sync_dist=True)).")
        if id(value) in metric_names:
            value = MetricRef(metric_names[id(value)])
        elif not isinstance(value, (Tensor, float, int)):
            raise TypeError(
                f"self.log({name!r}, ...) got a {type(value).__name__}: with pp > 1 only tensors, numbers and"
                " torchmetrics metrics of the module can be logged from a pipelined step."
            )
        logs.append((name, detached(value), kwargs))

    previous = vars(module).get("log")  # an enclosing recording (a step run at setup, logs muted) comes back
    module.log = record  # an instance attribute shadows LightningModule.log for the step's duration
    try:
        yield
    finally:
        if previous is None:
            del module.log
        else:
            module.log = previous


def original_log(module: Any) -> Callable[..., None]:
    """``LightningModule.log`` bound to ``module``, whatever :func:`recording_logs` put in its place."""
    return type(module).log.__get__(module)


@contextlib.contextmanager
def muted_logs(module: Any) -> Iterator[None]:
    """Run a step outside Lightning's loops (setup-time tracing) with its ``self.log`` calls ignored and its
    torchmetrics metrics left unchanged."""
    with recording_logs(module, []), recording_metric_calls(module, []):
        yield
