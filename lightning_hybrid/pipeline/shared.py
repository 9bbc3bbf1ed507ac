"""Parameters whose gradients the pipeline itself must combine after each step.

Two kinds (:func:`shared_parameters`):

* a parameter held on **several stages** (:mod:`lightning_hybrid.pipeline.split`): a weight tied between the
  embedding and the head, a table read on both sides of the trunk. Each holding rank computes the gradient of its
  own uses; the sum over the holders is the gradient of the whole model (Megatron's "embedding group", here on a
  process group per set of holding stages). Both copies then take the same optimizer step and stay identical.
* a parameter held **directly by a module that contains the blocks** (``self.pos_embed``): it sits in no stage
  module, so FSDP2 does not reduce it; with data parallelism its gradient is averaged over the data-parallel ranks
  here (and summed over its stages, if several).

Groups are built once, by every rank in the same order (``torch.distributed.new_group`` is collective), over the
ranks with the same data-parallel and tensor-parallel coordinates (FSDP2-managed parameters: their shards
correspond) or the same tensor-parallel coordinate only (parameters outside FSDP2: replicated over data ranks).

Example::

    shared = shared_parameters(module, split, mesh, sharded=True)
    combine_gradients(module, shared)          # after the schedule's backward, every step
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_hybrid.mesh import DATA_REPLICATE, DATA_SHARD, PIPELINE
from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.pipeline.split import StageSplit


@dataclass
class SharedParameter:
    """One parameter the pipeline combines: its names (a tied weight has several; the first is canonical, the
    same on every rank), the group to sum over, what to divide the sum by (data-parallel averaging), whether this
    rank counts it in the total gradient norm (one rank per pipeline does), and a name this rank holds it under (a
    weight tied between blocks on several stages is reachable only under its own block's name here)."""

    names: tuple[str, ...]
    group: Any
    divide_by: int
    counted_here: bool
    held_as: str


def shared_parameters(module: nn.Module, split: StageSplit, schedule: PipelineSchedule, mesh: DeviceMesh,
                      sharded: bool) -> list[SharedParameter]:
    """The parameters of ``module`` (the whole model, before the stages are installed) that this rank holds and
    must combine; ``sharded``: FSDP2 manages the stage modules. Every rank calls it."""
    stage_ranks, local = schedule.stage_ranks(), mesh[PIPELINE].get_local_rank()
    data_size = mesh[DATA_REPLICATE].size() * mesh[DATA_SHARD].size()
    combined = []
    for names in _tied_names(module, split):
        holders = tuple(sorted({stage_ranks[s] for s in split.parameter_stages[names[0]]}))
        managed = sharded and not any(name in split.direct for name in names)
        divide_by = 1 if managed else data_size
        if len(holders) > 1 or divide_by > 1:
            combined.append((names, holders, managed, divide_by))
    groups = _groups(mesh, sorted({(holders, managed) for _, holders, managed, _ in combined}))
    here = {stage for stage in range(split.num_stages) if stage_ranks[stage] == local}
    return [SharedParameter(names, groups[(holders, managed)], divide_by, local == holders[0],
                            _held_here(names, split, here)) for names, holders, managed, divide_by in combined
            if local in holders]


def _held_here(names: tuple[str, ...], split: StageSplit, here: set[int]) -> str:
    """One of ``names`` that this rank's stages hold: not a name inside a block of another stage (a stand-in
    here), unless a module of that block is held here too (one the step calls from outside the block)."""
    def elsewhere(name: str) -> bool:
        unit = next((u for u in split.units if u.block_index is not None and name.startswith(u.name + ".")), None)
        held_too = any(name.startswith(module + ".") and here & set(stages)
                       for module, stages in split.held_inside.items())
        return unit is not None and not here & set(unit.stages) and not held_too

    return next(name for name in names if not elsewhere(name))


def _tied_names(module: nn.Module, split: StageSplit) -> list[tuple[str, ...]]:
    """The names of each parameter outside the blocks, grouped by identity, and of each parameter tied between
    blocks (as the split recorded them), in a global order."""
    in_blocks = {name for names in split.tied_in_blocks for name in names}
    by_identity: dict[int, list[str]] = {}
    for name in split.parameter_stages:
        if name not in in_blocks:
            by_identity.setdefault(id(module.get_parameter(name)), []).append(name)
    return sorted([*(tuple(sorted(names)) for names in by_identity.values()), *split.tied_in_blocks])


def _groups(mesh: DeviceMesh, kinds: list[tuple[tuple[int, ...], bool]]) -> dict[tuple, Optional[Any]]:
    """A process group per (holding pipeline ranks, FSDP-managed) kind, this rank's one of each (``None`` where it
    is not a member): every rank creates every group, in the same order."""
    ranks = mesh.mesh.permute(1, 2, 3, 0)  # (dp_replicate, dp_shard, tp, pp) → global rank
    me = dist.get_rank()
    found: dict[tuple, Optional[Any]] = {}
    for holders, managed in kinds:
        found[(holders, managed)] = None
        if managed:  # same data and tensor coordinates: FSDP2 shards correspond
            member_lists = [row[list(holders)].tolist() for row in ranks.reshape(-1, ranks.shape[-1])]
        else:  # same tensor coordinate: replicated over the data ranks
            by_tensor = ranks.permute(2, 0, 1, 3).reshape(ranks.shape[2], -1, ranks.shape[-1])
            member_lists = [sorted(block[:, list(holders)].reshape(-1).tolist()) for block in by_tensor]
        for members in member_lists:
            group = dist.new_group(members) if len(members) > 1 else None
            if me in members:
                found[(holders, managed)] = group
    return found


def combine_gradients(module: nn.Module, shared: list[SharedParameter]) -> None:
    """Sum each shared parameter's gradient over its group (and divide, for data-parallel averaging), in place.
    Every member takes part: a holder whose uses did not reach the loss (an embedding computed again on a later
    stage, whose output the value received from the stage before replaced) adds zeros."""
    for entry in shared:
        parameter = module.get_parameter(entry.held_as)
        if entry.group is None or not parameter.requires_grad:
            continue
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        parameter.grad = _in_parameter_layout(parameter, parameter.grad)
        local = parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad
        dist.all_reduce(local, group=entry.group)
        if entry.divide_by > 1:
            local.div_(entry.divide_by)


def _in_parameter_layout(parameter: nn.Parameter, grad: Tensor) -> Tensor:
    """``grad`` laid out like ``parameter``, so that the holders' local tensors correspond. Without FSDP2 (which
    redistributes gradients itself) a vocabulary-sharded embedding's weight gradient comes out of DTensor's
    embedding backward ``Replicate()``, the whole vocabulary on every tensor rank, while the head's is ``Shard(0)``:
    summed over the stages holding a tied weight, the first stage's local tensor was the whole matrix and the last
    stage's its slice (gloo: "Received data size doesn't match"). Replicate to Shard is a local slice."""
    if not isinstance(grad, DTensor) or not isinstance(parameter, DTensor) or grad.placements == parameter.placements:
        return grad
    return grad.redistribute(parameter.device_mesh, parameter.placements)


def counted_elsewhere(module: nn.Module, shared: list[SharedParameter]) -> set[int]:
    """``id``\\ s of this rank's parameters that another rank of the pipeline counts in the gradient norm."""
    return {id(module.get_parameter(entry.held_as)) for entry in shared if not entry.counted_here}


def ghost_unread_parameters(module: nn.Module, split: StageSplit, stage_ids: Sequence[int], device: torch.device) -> None:
    """Parameters outside the blocks that none of this rank's stages (``stage_ids``) read, where their module stays
    on this rank: held by a module that contains the blocks (``self.pos_embed``), or by a unit held here for another
    of its parameters (a masked-LM head kept on the first stage for the decoder weight tied to the embedding also
    holds a transform that only the last stage runs). Each is replaced by a non-persistent buffer of the same shape
    and dtype taking no memory, so code that touches it on the way to other units still runs, and the parameter
    lives only where it is read (no stale copy, no gradient, not in this rank's state dict)."""
    local = set(stage_ids)
    held_here = [unit.name + "." for unit in split.units if unit.block_index is None and local & set(unit.stages)]
    for name, stages in split.parameter_stages.items():
        if local & set(stages) or not (name in split.direct or name.startswith(tuple(held_here))):
            continue
        parent_name, _, attribute = name.rpartition(".")
        parent = module.get_submodule(parent_name)
        parameter = getattr(parent, attribute)
        delattr(parent, attribute)
        ghost = torch.zeros((), dtype=parameter.dtype, device=device).expand(parameter.shape)
        parent.register_buffer(attribute, ghost, persistent=False)
