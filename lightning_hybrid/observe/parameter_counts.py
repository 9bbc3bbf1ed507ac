"""The whole model's parameters under a parallel layout, and what each pipeline stage holds per rank.

Lightning's ``ModelSummary`` counts ``pl_module.parameters()`` of global rank 0. A DTensor counts at its global size
there, but under pipeline parallelism rank 0 holds only its stages, so the table showed about half the model at
pp=2. :class:`WholeModelSummary` is Lightning's summary with its counts taken over the whole pipeline: every rank of
rank 0's pipeline sends the global sizes of the parameters it holds, by name, and each parameter is counted once (a
weight tied between the first and the last stage included; a DTensor at its global size, whatever its tensor or
data shards; a meta-device parameter at its shape's size). :func:`describe_shares` gives one line per stage::

    HybridStrategy: 817,920 parameters in 2 pipeline stages, each on 2 ranks (tp 2 × dp 1):
      stage 0: 412,928 parameters, held per rank: 211,712
      stage 1: 404,992 parameters, held per rank: 203,776

"held per rank" is what one rank stores: its tensor-parallel and FSDP2 shards, plus its copy of a weight tied
across stages (counted in the first stage's parameters only, so the stages add up to the total). The summary
callbacks print both (:mod:`lightning_hybrid.glue.model_summary`); TensorBoard's ``run/stages`` text too
(:mod:`lightning_hybrid.observe.run_record`).

Example::

    summary = summarize_whole_model(trainer, pl_module)        # collective: every rank calls it
    summary.total_parameters, summary.trainable_parameters, summary.param_nums
    print(describe_shares(summary, trainer))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.utilities.model_summary import ModelSummary as LightningSummary
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.parameter import UninitializedParameter

from lightning_hybrid.parallel.expert_step import spread_norms


@dataclass(frozen=True)
class HeldParameter:
    """One parameter a rank holds: its global element count, whether it trains, and every name it has there."""

    size: int
    trainable: bool
    names: tuple[str, ...]


@dataclass(frozen=True)
class RankShare:
    """What one rank holds: its pipeline stages, the global elements of the parameters it counts, and the elements
    it stores."""

    stages: tuple[int, ...]
    counted: int
    held: int


def global_size(parameter: Tensor) -> int:
    """Elements of the whole parameter: a DTensor's global size, a meta tensor's shape; 0 for a lazy parameter
    whose shape is not known yet (as Lightning counts it)."""
    if isinstance(parameter, UninitializedParameter) and not isinstance(parameter, DTensor):
        return 0
    return parameter.numel()


def local_size(parameter: Tensor) -> int:
    """Elements this rank stores of the parameter (its shard of a DTensor)."""
    return parameter.to_local().numel() if isinstance(parameter, DTensor) else global_size(parameter)


def held_parameters(module: nn.Module, pipeline: Optional[Any] = None) -> dict[str, HeldParameter]:
    """This rank's parameters by a name that is the same on every rank holding them: a weight shared by pipeline
    stages under the pipeline's name for it (its names differ between the stages: ``wte.weight``, ``head.weight``),
    any other parameter under its first name."""
    shared = {id(module.get_parameter(entry.held_as)): entry.names[0] for entry in pipeline.shared} if pipeline else {}
    names: dict[int, list[str]] = {}
    parameters: dict[int, Tensor] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
        parameters[id(parameter)] = parameter
    return {
        shared.get(key, names[key][0]): HeldParameter(global_size(p), p.requires_grad, tuple(names[key]))
        for key, p in parameters.items()
    }


def _pipeline_parameters(module: nn.Module, pipeline: Optional[Any], spread: bool) -> list[dict[str, HeldParameter]]:
    """:func:`held_parameters` of every rank of this rank's pipeline (just this rank's without a pipeline); of
    every rank with ``spread`` (experts spread whole over the ep ranks: each holds some of them)."""
    own = held_parameters(module, pipeline)
    if (pipeline is None and not spread) or not dist.is_initialized():
        return [own]
    group = None if spread else pipeline.pp_group
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, own, group=group)
    return gathered


def _rank_shares(module: nn.Module, pipeline: Optional[Any]) -> list[RankShare]:
    """Every rank's :class:`RankShare`, in global rank order."""
    elsewhere = pipeline.counted_elsewhere() if pipeline is not None else set()
    parameters = list(module.parameters())
    own = RankShare(
        stages=tuple(pipeline.stage_ids) if pipeline is not None else (0,),
        counted=sum(global_size(p) for p in parameters if id(p) not in elsewhere),
        held=sum(local_size(p) for p in parameters),
    )
    if not dist.is_initialized():
        return [own]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, own)
    return gathered


class WholeModelSummary(LightningSummary):
    """Lightning's model summary (the same table, ``example_input_array`` sizes and FLOPs) with the whole model's
    parameter counts: per row, in total and trainable, each parameter counted once over the pipeline's ranks.
    :attr:`shares` holds every rank's :class:`RankShare`. ``spread``: expert parallelism spread experts whole over
    ranks (each counts its own; the table counts every rank's). Collective: every rank constructs it."""

    def __init__(self, model: pl.LightningModule, max_depth: int = 1, pipeline: Optional[Any] = None,
                 spread: bool = False) -> None:
        super().__init__(model, max_depth=max_depth)
        by_name: dict[str, HeldParameter] = {}
        for rank_parameters in _pipeline_parameters(model, pipeline, spread):
            by_name.update(rank_parameters)
        self._whole = by_name
        self.shares = _rank_shares(model, pipeline)

    def _row_count(self, row: str) -> int:
        prefix = row + "."
        return sum(p.size for p in self._whole.values() if any(name.startswith(prefix) for name in p.names))

    @property
    def param_nums(self) -> list[int]:
        return [self._row_count(row) for row in self.layer_names]

    @property
    def total_parameters(self) -> int:
        return sum(p.size for p in self._whole.values())

    @property
    def trainable_parameters(self) -> int:
        return sum(p.size for p in self._whole.values() if p.trainable)


def summarize_whole_model(trainer: pl.Trainer, module: pl.LightningModule, max_depth: int = 1) -> WholeModelSummary:
    """The :class:`WholeModelSummary` of ``module`` as ``trainer``'s strategy laid it out (collective)."""
    return WholeModelSummary(module, max_depth, getattr(trainer.strategy, "pipeline", None),
                             spread=bool(spread_norms(trainer.strategy)))


def describe_shares(summary: WholeModelSummary, trainer: pl.Trainer) -> str:
    """The lines printed after the table: the total, then each pipeline stage's parameters and what one of its
    ranks holds (a range where the ranks' shards differ in size)."""
    by_stages: dict[tuple[int, ...], list[RankShare]] = {}
    for share in summary.shares:
        by_stages.setdefault(share.stages, []).append(share)
    dims = getattr(trainer.strategy, "dims", None)
    layout = f" (tp {dims.tp} × dp {dims.data_parallel_size})" if dims is not None else ""
    ranks = len(summary.shares) // len(by_stages)
    lines = [f"HybridStrategy: {summary.total_parameters:,} parameters in {len(by_stages)} pipeline stage"
             f"{'s' if len(by_stages) > 1 else ''}, each on {ranks} rank{'s' if ranks > 1 else ''}{layout}:"]
    for stages, shares in sorted(by_stages.items()):
        held = sorted({share.held for share in shares})
        held_text = f"{held[0]:,}" if len(held) == 1 else f"{held[0]:,}–{held[-1]:,}"
        label = "stage" if len(stages) == 1 else "stages"
        lines.append(f"  {label} {'+'.join(map(str, stages))}: {shares[0].counted:,} parameters,"
                     f" held per rank: {held_text}")
    return "\n".join(lines)
