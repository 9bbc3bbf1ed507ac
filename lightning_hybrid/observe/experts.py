"""What expert parallelism did, for the monitor: tokens per expert, imbalance, all-to-all bytes and time.

Every split layer's :class:`~lightning_hybrid.expert_parallel.exchange.ExchangeStats` counts, on each rank, the
tokens its router sent to each expert and the rows, bytes and seconds of its exchanges. :func:`take_expert_figures`
reads and resets them (each rank, at the monitor's logging step); rank 0 combines every rank's with
:func:`expert_metrics` into TensorBoard scalars:

* ``experts/tokens_per_batch/expert_<e>``: tokens routed to expert ``e`` per batch, summed over the layers and the
  data-parallel ranks;
* ``experts/imbalance_over_experts``: the busiest expert's tokens over the mean (1 = balanced), worst layer;
* ``experts/imbalance_over_ranks``: the busiest ep rank's tokens (those its experts received) over the mean, worst
  layer;
* ``experts/all_to_all_bytes_per_batch``: bytes a rank sends to other ranks per batch, forward and backward (the
  rank that sends the most), and ``experts/all_to_all_forward_share_of_step``: seconds in the forward exchanges
  over the step time, mean over ranks (the backward's run inside autograd and are not timed).

Example::

    figures = take_expert_figures(trainer.strategy)         # every rank
    metrics = expert_metrics(gathered, batches=4, seconds=2.0, tensor_parallel=1)   # rank 0
"""

from __future__ import annotations

from typing import Any, Optional

import torch

#: One rank's figures: layer → (tokens per expert, ep size, bytes sent, seconds in exchanges).
Figures = dict[str, tuple[list[int], int, int, float]]


def take_expert_figures(strategy: Any) -> Optional[Figures]:
    """This rank's figures since the last call, reset (``None`` without expert parallelism)."""
    applied = getattr(strategy, "experts_applied", None)
    if applied is None or not applied.groups:
        return None
    figures = {}
    for name, group in applied.groups.items():
        stats = group.stats.take()
        tokens = stats.tokens_per_expert.tolist() if stats.tokens_per_expert is not None else [0] * group.count
        figures[name] = (tokens, group.size, stats.bytes_sent, stats.seconds)
    return figures


def expert_metrics(per_rank: list[Optional[Figures]], batches: int, seconds: float,
                   tensor_parallel: int) -> dict[str, float]:
    """Every rank's figures (as gathered on rank 0) over ``batches`` batches that took ``seconds``; tensor-parallel
    ranks route the same tokens, so counts are divided by ``tensor_parallel``."""
    ranks = [figures for figures in per_rank if figures]
    if not ranks or batches == 0:
        return {}
    per_layer: dict[str, torch.Tensor] = {}
    sizes: dict[str, int] = {}
    for figures in ranks:
        for name, (tokens, size, _, _) in figures.items():
            counts = torch.tensor(tokens, dtype=torch.float64)
            per_layer[name] = per_layer[name] + counts if name in per_layer else counts
            sizes[name] = size
    totals = sum(per_layer.values()) / (tensor_parallel * batches)
    metrics = {f"experts/tokens_per_batch/expert_{e}": float(count) for e, count in enumerate(totals)}
    metrics["experts/imbalance_over_experts"] = max(_imbalance(counts) for counts in per_layer.values())
    metrics["experts/imbalance_over_ranks"] = max(_imbalance(counts.view(sizes[name], -1).sum(1))
                                                  for name, counts in per_layer.items())
    sent = [sum(layer[2] for layer in figures.values()) for figures in ranks]
    metrics["experts/all_to_all_bytes_per_batch"] = max(sent) / batches
    if seconds > 0:
        exchanged = [sum(layer[3] for layer in figures.values()) for figures in ranks]
        metrics["experts/all_to_all_forward_share_of_step"] = sum(exchanged) / len(exchanged) / seconds
    return metrics


def _imbalance(counts: torch.Tensor) -> float:
    mean = float(counts.mean())
    return float(counts.max()) / mean if mean > 0 else 1.0
