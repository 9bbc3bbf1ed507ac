"""Every layout of a cluster, estimated and ranked: what ``lightning-hybrid plan`` prints.

Example::

    ranked = plan(ModelShape.from_parameter_count(7e9, 4096), Cluster.preset("h100-sxm", nodes=4), global_batch=256)
    ranked[0].layout, ranked[0].time.step          # the fastest layout that fits, and its predicted step time
    rank_of(estimate(...), ranked)                 # where one layout stands among them (1: the fastest)
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Mapping, Optional, Sequence, Union

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.options.schedules import PLANNED_SCHEDULES
from lightning_hybrid.planner.cost import check_model_fits_cluster, estimate
from lightning_hybrid.planner.layout import CHECKPOINTING, Estimate, Layout
from lightning_hybrid.hardware import Cluster
from lightning_hybrid.planner.model import ModelShape

#: The share of the usable memory a layout must leave free before context parallelism is not tried: the activation
#: model is a few % low without checkpointing (docs/tuning.md, "Leave headroom"), so a layout at the brim is no fit.
CONTEXT_HEADROOM = 0.05


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the degrees a dimension of ``n`` devices can take."""
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(cluster: Cluster, global_batch: int, schedules: Sequence[str] = PLANNED_SCHEDULES,
                      zero_levels: Sequence[int] = (2, 3),
                      checkpointing: Sequence[Union[None, str, int]] = CHECKPOINTING, layers: Optional[int] = None,
                      options: Optional[Mapping[str, Any]] = None, experts: int = 0,
                      contexts: Sequence[int] = (1,)) -> list[Layout]:
    """Every dp_replicate × dp × tp × pp × cp = GPUs (cp of ``contexts``) with each ZeRO level and checkpointing
    choice (and, for a model of ``experts`` routed experts, each ep of :func:`expert_degrees`); with pp > 1, each
    schedule with each microbatch count ≥ pp that divides a replica's batch (the default count if none does) and,
    interleaved, 2 virtual stages (and 3 or 4 where they split ``layers`` evenly); with pp = 1, each
    gradient-accumulation count that divides it (1 written as ``microbatches=None``). ``options``: Layout fields
    every candidate takes (``compile``, ``offload``, ``reduce_dtype``, ``loss_parallel``, ``shard_vocab``)."""
    layouts = []
    for tp, pp, replicate, cp in itertools.product(*[divisors(cluster.gpus)] * 3, contexts):
        if cluster.gpus % (tp * pp * replicate * cp):
            continue
        dp = cluster.gpus // (tp * pp * replicate * cp)
        per_replica = global_batch // (dp * replicate) if global_batch % (dp * replicate) == 0 else 0
        base = Layout(dp=dp, tp=tp, pp=pp, dp_replicate=replicate, cp=cp, **(options or {}))
        if pp > 1:
            variants = pipeline_variants(base, per_replica, schedules, layers)
        else:
            variants = [replace(base, microbatches=k if k > 1 else None) for k in divisors(per_replica) or [1]]
        layouts += [replace(layout, zero=zero, activation_checkpointing=mode, ep=ep)
                    for layout in variants for zero in zero_levels for mode in checkpointing
                    for ep in expert_degrees(dp * cp, experts)]
    return layouts


def context_degrees(model: ModelShape, gpus: int) -> list[int]:
    """The cp a long sequence can be split over: divisors of the GPUs that divide the sequence and the heads."""
    return [cp for cp in divisors(gpus) if model.seq_len % cp == 0 and model.heads % cp == 0]


def expert_degrees(dp: int, experts: int) -> list[int]:
    """The ep a layout of ``dp`` sharding ranks can take for a model of ``experts`` routed experts per MoE block
    (none but 1 for a dense model): divisors of both."""
    return [ep for ep in divisors(dp) if experts % ep == 0] if experts else [1]


def pipeline_variants(base: Layout, per_replica_batch: int, schedules: Sequence[str], layers: Optional[int],
                      microbatches: Optional[int] = None, virtual_stages: Optional[int] = None) -> list[Layout]:
    """``base`` (pp > 1) with each schedule, each microbatch count ≥ pp that divides ``per_replica_batch`` (the
    schedule's default count if none does) and, interleaved, each virtual-stage count :func:`candidate_layouts`
    tries; a given ``microbatches``/``virtual_stages`` is kept instead of varied."""
    counts = [microbatches] if microbatches else [k for k in divisors(per_replica_batch) if k >= base.pp] or [None]
    return [replace(base, pp_schedule=name, microbatches=count, virtual_stages=stages)
            for name in schedules
            for stages in ([virtual_stages] if virtual_stages else _virtual_stages(name, base.pp, layers))
            for count in counts]


def _virtual_stages(schedule: str, pp: int, layers: Optional[int]) -> list[int]:
    if schedule != "interleaved_1f1b":
        return [1]
    # More stages per rank shrink the bubble (÷ v) for v times the messages; beyond the default 2 only even splits
    # (an uneven one leaves ranks idle at every microbatch).
    return [2] + [v for v in (3, 4) if layers is not None and layers % (pp * v) == 0]


def recompute_order(layout: Layout) -> int:
    """0 without checkpointing, 1 selective, 2 every N-th block, 3 every block: how much each recomputes."""
    mode = layout.activation_checkpointing
    return 0 if mode is None else 1 if mode == "selective" else 3 if mode == "every" else 2


def plan(model: ModelShape, cluster: Cluster, global_batch: int, precision: str = "bf16-mixed",
         schedules: Sequence[str] = PLANNED_SCHEDULES, zero_levels: Sequence[int] = (2, 3),
         checkpointing: Sequence[Union[None, str, int]] = CHECKPOINTING,
         options: Optional[Mapping[str, Any]] = None) -> list[Estimate]:
    """Estimate every :func:`candidate_layouts` layout: the feasible ones first, fastest first (ties: fewer
    accumulation steps, less recomputation, less memory, less traffic), then the infeasible ones, those only out of
    memory first, nearest to fitting first. Context parallelism (cp > 1, :func:`context_degrees`) is tried when no
    layout without it fits with :data:`CONTEXT_HEADROOM` of the usable memory free (a sequence whose activations no
    other split brings under the memory, or only to its brim)."""
    check_positive_values("plan", global_batch=global_batch)
    check_model_fits_cluster(model, cluster, precision)
    estimates = _estimates(model, cluster, global_batch, precision, schedules, zero_levels, checkpointing, options)
    roomy = (1 - CONTEXT_HEADROOM) * cluster.usable_memory
    if not any(e.feasible and e.memory.total <= roomy for e in estimates):
        estimates += _estimates(model, cluster, global_batch, precision, schedules, zero_levels, checkpointing,
                                options, [cp for cp in context_degrees(model, cluster.gpus) if cp > 1])
    # At equal predicted time, fewer accumulation steps: smaller microbatches run less efficiently (not modeled);
    # then less recomputation (without the cluster's memory bandwidth selective checkpointing costs no time).
    feasible = sorted((e for e in estimates if e.feasible),
                      key=lambda e: (e.time.step, e.layout.accumulation_steps, recompute_order(e.layout),
                                     e.memory.total, e.time.data_parallel))
    infeasible = sorted((e for e in estimates if not e.feasible),
                        key=lambda e: (len(e.reasons) - e.out_of_memory, e.memory.total, e.time.step))
    return feasible + infeasible


def _estimates(model: ModelShape, cluster: Cluster, global_batch: int, precision: str, schedules: Sequence[str],
               zero_levels: Sequence[int], checkpointing: Sequence[Union[None, str, int]],
               options: Optional[Mapping[str, Any]], contexts: Sequence[int] = (1,)) -> list[Estimate]:
    candidates = candidate_layouts(cluster, global_batch, schedules, zero_levels, checkpointing, model.layers,
                                   options, model.experts, contexts)
    return [estimate(model, cluster, layout, global_batch, precision) for layout in candidates]


def rank_of(candidate: Estimate, ranked: Sequence[Estimate]) -> Optional[int]:
    """Where ``candidate`` stands among the feasible layouts of ``ranked`` (1: none is faster); None when it does not
    fit. It need not be one of them (a microbatch count :func:`plan` does not try)."""
    if not candidate.feasible:
        return None
    return 1 + sum(e.feasible and e.time.step < candidate.time.step and e.layout != candidate.layout for e in ranked)
