"""Every layout of a cluster, estimated and ranked: what ``lightning-hybrid plan`` prints.

Example::

    ranked = plan(ModelShape.from_parameter_count(7e9, 4096), Cluster.preset("h100-sxm", nodes=4), global_batch=256)
    ranked[0].layout, ranked[0].time.step          # the fastest layout that fits, and its predicted step time
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional, Sequence

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.pipeline.schedules import PLANNED_SCHEDULES
from lightning_hybrid.plan.cost import check_model_fits_cluster, estimate
from lightning_hybrid.plan.layout import CHECKPOINTING, Estimate, Layout
from lightning_hybrid.plan.hardware import Cluster
from lightning_hybrid.plan.model import ModelShape


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the degrees a dimension of ``n`` devices can take."""
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(cluster: Cluster, global_batch: int, schedules: Sequence[str] = PLANNED_SCHEDULES,
                      zero_levels: Sequence[int] = (2, 3),
                      checkpointing: Sequence[Optional[str]] = CHECKPOINTING) -> list[Layout]:
    """Every dp_replicate × dp × tp × pp = GPUs with each ZeRO level and checkpointing choice; with pp > 1, each
    schedule with each microbatch count ≥ pp that divides a replica's batch (the default count if none does); with
    pp = 1, each gradient-accumulation count that divides it (1 written as ``microbatches=None``)."""
    layouts = []
    for tp, pp, replicate in itertools.product(divisors(cluster.gpus), repeat=3):
        if cluster.gpus % (tp * pp * replicate):
            continue
        dp = cluster.gpus // (tp * pp * replicate)
        per_replica = global_batch // (dp * replicate) if global_batch % (dp * replicate) == 0 else 0
        base = Layout(dp=dp, tp=tp, pp=pp, dp_replicate=replicate)
        if pp > 1:
            counts = [k for k in divisors(per_replica) if k >= pp] or [None]
            variants = [replace(base, pp_schedule=name, microbatches=count,
                                virtual_stages=2 if name == "interleaved_1f1b" else 1)
                        for name in schedules for count in counts]
        else:
            variants = [replace(base, microbatches=k if k > 1 else None) for k in divisors(per_replica) or [1]]
        layouts += [replace(layout, zero=zero, activation_checkpointing=mode)
                    for layout in variants for zero in zero_levels for mode in checkpointing]
    return layouts


def _recompute_order(layout: Layout) -> int:
    """0 without checkpointing, 1 selective, 2 every N-th block, 3 every block: how much each recomputes."""
    mode = layout.activation_checkpointing
    return 0 if mode is None else 1 if mode == "selective" else 3 if mode == "every" else 2


def plan(model: ModelShape, cluster: Cluster, global_batch: int, precision: str = "bf16-mixed",
         schedules: Sequence[str] = PLANNED_SCHEDULES, zero_levels: Sequence[int] = (2, 3),
         checkpointing: Sequence[Optional[str]] = CHECKPOINTING) -> list[Estimate]:
    """Estimate every :func:`candidate_layouts` layout: the feasible ones first, fastest first (ties: fewer
    accumulation steps, less memory, less traffic), then the infeasible ones, those only out of memory first,
    nearest to fitting first."""
    check_positive_values("plan", global_batch=global_batch)
    check_model_fits_cluster(model, cluster, precision)
    candidates = candidate_layouts(cluster, global_batch, schedules, zero_levels, checkpointing)
    estimates = [estimate(model, cluster, layout, global_batch, precision) for layout in candidates]
    # At equal predicted time, fewer accumulation steps: smaller microbatches run less efficiently (not modeled);
    # then less recomputation (without the cluster's memory bandwidth selective checkpointing costs no time).
    feasible = sorted((e for e in estimates if e.feasible),
                      key=lambda e: (e.time.step, e.layout.accumulation_steps, _recompute_order(e.layout),
                                     e.memory.total, e.time.data_parallel))
    infeasible = sorted((e for e in estimates if not e.feasible),
                        key=lambda e: (len(e.reasons) - e.out_of_memory, e.memory.total, e.time.step))
    return feasible + infeasible
