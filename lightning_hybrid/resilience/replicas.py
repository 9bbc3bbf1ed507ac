"""Silent divergence caught: what must be identical on several ranks is compared every N optimizer steps.

Three kinds of copies must stay bit for bit identical, because each copy takes the same reduced gradient and the
same optimizer step; a flipped bit in one copy, a non-deterministic operation or a wrong plan breaks that without
any error, and the copies then drift apart unnoticed:

* **HSDP replicas**: FSDP2's local shards over ``dp_replicate`` (placement ``Replicate()`` on that dimension);
* **tp-replicated** parameters: those tensor parallelism keeps whole on every tp rank (LayerNorms, the bias of a
  row-wise layer: ``Replicate()`` on ``tp``), and parameters outside FSDP2 over the data-parallel ranks;
* **tied copies across pipeline stages** (:mod:`lightning_hybrid.pipeline.shared`): one weight held on several
  stages.

Which mesh dimensions a parameter is replicated over is read from its DTensor placements (a plain tensor, or a
dimension its mesh does not cover, is replicated); tied copies from the pipeline's shared groups. A check takes
an exact fingerprint of each local tensor (:func:`fingerprint`: integer sums of its bytes, so a flipped low bit
shows), gathers the small vector of fingerprints once per replication group (one per replicated mesh dimension,
one per tied group), and agrees on the outcome over all ranks with one all-reduce of a flag. Only when something
differs are every rank's fingerprints gathered, so that each rank raises the same :class:`ReplicaDivergence`
naming the tensors, the kind of copy, and the ranks that disagree with the majority.

Example::

    trainer = Trainer(strategy=HybridStrategy(dp_replicate=2, tp=2, check_replicas_every_n_steps=100), ...)
    # or by hand, on any strategy with a device mesh: plan once, check collectively
    plan = plan_checks(module, strategy.device_mesh)
    check_replicas(plan, strategy.root_device, step)   # raises ReplicaDivergence on every rank
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Optional, Sequence

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement

from lightning_hybrid.checks import check_positive
from lightning_hybrid.mesh import DATA_REPLICATE, DATA_SHARD, PIPELINE, TENSOR

#: How each replicated mesh dimension is named in a divergence report.
KINDS = {PIPELINE: "tied copy across pipeline stages", DATA_REPLICATE: "HSDP replica",
         DATA_SHARD: "data-parallel replica", TENSOR: "tp-replicated"}

# The largest prime below 2**16: a 16-bit word times a weight up to it stays inside int32, so the weighted sum
# needs no int64 temporaries; a chunk of 16 periods bounds the temporaries' memory on large tensors.
_WEIGHT_PERIOD = 65521
_CHUNK = 16 * _WEIGHT_PERIOD
#: A fingerprint as gathered for a report: (tensor names, replicated dimensions, copy key, the two sums).
Record = tuple[tuple[str, ...], tuple[str, ...], tuple[tuple[str, int], ...], tuple[int, int]]


class ReplicaDivergence(RuntimeError):
    """Copies of a parameter that must be identical differ; raised on every rank with the same message.
    :attr:`divergences` lists them."""

    def __init__(self, message: str, divergences: Sequence["Divergence"]) -> None:
        super().__init__(message)
        self.divergences = list(divergences)


@dataclass(frozen=True)
class Divergence:
    """One parameter whose copies differ: its names (tied weights have several), the kinds of copy, the ranks
    that disagree with the majority (all ranks holding a copy when there is no majority), and the majority's
    ranks (empty: no majority, e.g. two copies that differ; either may be the wrong one)."""

    names: tuple[str, ...]
    kinds: tuple[str, ...]
    ranks: tuple[int, ...]
    majority: tuple[int, ...]

    def describe(self) -> str:
        """One line of the report."""
        where = f"{' = '.join(self.names)} ({', '.join(self.kinds)})"
        if self.majority:
            return f"{where}: rank(s) {_listed(self.ranks)} differ from ranks {_listed(self.majority)} (the majority)"
        return (f"{where}: ranks {_listed(self.ranks)} hold {len(self.ranks)} copies with no majority agreeing;"
                " any of them may be the wrong one")


@dataclass(frozen=True)
class CheckedTensor:
    """A parameter this rank holds a copy of: its names, the mesh dimensions it is replicated over (``pp`` for a
    tied copy), and its coordinates on the other dimensions (ranks with the same key hold the same copy)."""

    names: tuple[str, ...]
    parameter: Tensor
    replicated_over: tuple[str, ...]
    copy_key: tuple[tuple[str, int], ...]


@dataclass(frozen=True)
class ReplicationGroup:
    """The ranks along one replicated mesh dimension through this rank (or one tied group), and the tensors they
    must all hold identically, in the same order on every member."""

    dim: str
    group: Any
    tensors: tuple[CheckedTensor, ...]


@dataclass(frozen=True)
class ReplicaPlan:
    """What :func:`check_replicas` compares on this rank (built once by :func:`plan_checks`)."""

    tensors: tuple[CheckedTensor, ...]
    groups: tuple[ReplicationGroup, ...]


# --------------------------------------------------------------------------------------------------- fingerprint
def fingerprint(tensor: Tensor) -> Tensor:
    """Two int64 numbers of the local data's bytes: the sum of its 16-bit words, and their sum weighted by
    position (period 65521). Integer sums are exact in any reduction order, so copies with equal bytes give equal
    numbers on any device; one changed bit changes the first sum, a permutation of words the second. Exact up to
    4 G words (8 GB) per tensor."""
    data = tensor.detach()
    data = data.to_local() if isinstance(data, DTensor) else data
    raw = data.contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int16) if raw.numel() % 2 == 0 else raw
    weights = _position_weights(words.device)
    sums = torch.zeros(2, dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _CHUNK):
        chunk = words[start : start + _CHUNK].to(torch.int32)
        sums[0] += chunk.sum(dtype=torch.int64)
        sums[1] += (chunk * weights[: chunk.numel()]).sum(dtype=torch.int64)
    return sums


@functools.lru_cache(maxsize=4)
def _position_weights(device: torch.device) -> Tensor:
    return (torch.arange(_CHUNK, device=device, dtype=torch.int32) % _WEIGHT_PERIOD) + 1


# ------------------------------------------------------------------------------------------ which dims replicate
def replicated_dims(rank: int, root_ranks: Tensor, root_names: Sequence[str],
                    placements: Sequence[Placement] = (), mesh_ranks: Optional[Tensor] = None) -> tuple[str, ...]:
    """The dimensions of the root mesh (global ranks ``root_ranks``, dimensions ``root_names``), of size > 1 and
    other than ``pp``, over which ``rank``'s copy of a parameter is replicated: those its DTensor mesh
    (``mesh_ranks``, e.g. ``param.device_mesh.mesh``) spans with a ``Replicate()`` placement, and those the mesh
    does not cover. A plain tensor (no placements) is replicated over all of them. Flattened dimensions (a mesh
    over ``dp_replicate × dp_shard``) count for every dimension they span."""
    covered: set[str] = set()
    replicated: set[str] = set()
    if placements:
        assert mesh_ranks is not None
        coordinate = _coordinate(mesh_ranks, rank)
        for dim, placement in enumerate(placements):
            through = list(coordinate)
            through[dim] = slice(None)
            spanned = spanned_dims(mesh_ranks[tuple(through)].reshape(-1).tolist(), root_ranks, root_names)
            covered |= spanned
            if placement.is_replicate():
                replicated |= spanned
    return tuple(name for name, size in zip(root_names, root_ranks.shape)
                 if size > 1 and name != PIPELINE and (name in replicated or name not in covered))


def spanned_dims(ranks: Iterable[int], root_ranks: Tensor, root_names: Sequence[str]) -> set[str]:
    """The root mesh dimensions along which the coordinates of ``ranks`` differ."""
    coordinates = torch.tensor([_coordinate(root_ranks, rank) for rank in ranks])
    varies = (coordinates != coordinates[0]).any(dim=0).tolist()
    return {name for name, differs in zip(root_names, varies) if differs}


def _coordinate(ranks: Tensor, rank: int) -> tuple[int, ...]:
    return tuple((ranks == rank).nonzero()[0].tolist())


# ----------------------------------------------------------------------------------------------------- planning
def plan_checks(module: nn.Module, mesh: DeviceMesh, shared: Sequence[Any] = ()) -> ReplicaPlan:
    """Which of ``module``'s parameters this rank compares, over which groups. ``mesh`` is the strategy's root
    mesh; ``shared`` the pipeline's :class:`~lightning_hybrid.pipeline.shared.SharedParameter` list (tied copies).
    Creates no process group: it uses the mesh's and the pipeline's."""
    rank, root_ranks, root_names = dist.get_rank(), mesh.mesh, tuple(mesh.mesh_dim_names or ())
    here = dict(zip(root_names, _coordinate(root_ranks, rank)))
    tied = _tied_across_stages(module, shared, root_ranks, root_names)
    tensors = []
    for parameter, names in _named_parameters(module):
        placements = tuple(parameter.placements) if isinstance(parameter, DTensor) else ()
        mesh_ranks = parameter.device_mesh.mesh if isinstance(parameter, DTensor) else None
        over = replicated_dims(rank, root_ranks, root_names, placements, mesh_ranks)
        if id(parameter) in tied:
            names, over = tied[id(parameter)][0], (PIPELINE, *over)
        if over:
            key = tuple((name, here[name]) for name in root_names if name not in over)
            tensors.append(CheckedTensor(names, parameter, over, key))
    groups = [ReplicationGroup(dim, mesh[dim].get_group(), tuple(t for t in tensors if dim in t.replicated_over))
              for dim in root_names if dim != PIPELINE]
    for group in dict.fromkeys(group for _, group in tied.values()):  # each tied group once, in the shared order
        members = tuple(t for t in tensors if id(t.parameter) in tied and tied[id(t.parameter)][1] is group)
        groups.append(ReplicationGroup(PIPELINE, group, members))
    return ReplicaPlan(tuple(tensors), tuple(group for group in groups if group.tensors))


def _named_parameters(module: nn.Module) -> Iterator[tuple[Tensor, tuple[str, ...]]]:
    """Each parameter once, with all its names, in the module's order (the same on every rank of a stage)."""
    names: dict[int, list[str]] = {}
    parameters: dict[int, Tensor] = {}
    for name, parameter in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(parameter), []).append(name)
        parameters[id(parameter)] = parameter
    for key, parameter in parameters.items():
        if not parameter.is_meta:
            yield parameter, tuple(sorted(names[key]))


def _tied_across_stages(module: nn.Module, shared: Sequence[Any], root_ranks: Tensor,
                        root_names: Sequence[str]) -> dict[int, tuple[tuple[str, ...], Any]]:
    """``{id(parameter): (names, group)}`` of the shared parameters whose group spans pipeline stages."""
    tied = {}
    for entry in shared:
        if entry.group is None:
            continue
        if PIPELINE in spanned_dims(dist.get_process_group_ranks(entry.group), root_ranks, root_names):
            tied[id(module.get_parameter(entry.held_as))] = (tuple(entry.names), entry.group)
    return tied


# ------------------------------------------------------------------------------------------------------ checking
def check_replicas(plan: ReplicaPlan, device: torch.device, step: int) -> None:
    """Compare every copy of :func:`plan_checks`'s tensors; collective over all ranks, each of which returns, or
    raises the same :class:`ReplicaDivergence`. ``device`` carries the collectives (the rank's own device)."""
    prints = {id(t.parameter): fingerprint(t.parameter).to(device) for t in plan.tensors}
    differs = [_group_differs(group, [prints[id(t.parameter)] for t in group.tensors]) for group in plan.groups]
    flag = torch.tensor([int(any(differs))], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank learns of a difference in any group
    if not flag.item():
        return
    records: list[Record] = [(t.names, t.replicated_over, t.copy_key, tuple(prints[id(t.parameter)].tolist()))
                             for t in plan.tensors]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, records)
    found = divergences(gathered)
    raise ReplicaDivergence(report(found, step), found)


def _group_differs(group: ReplicationGroup, prints: list[Tensor]) -> bool:
    local = torch.stack(prints).reshape(-1)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group.group))]
    dist.all_gather(gathered, local, group=group.group)
    return any(not torch.equal(other, gathered[0]) for other in gathered[1:])


def divergences(records_by_rank: Sequence[Sequence[Record]]) -> list[Divergence]:
    """The parameters whose copies differ, from every rank's records (``records_by_rank[rank]``): ranks with the
    same first name and copy key hold copies of one tensor; the most common fingerprint is the majority's when
    more than half the copies share it."""
    copies: dict[tuple, dict[tuple[int, int], list[int]]] = {}
    described: dict[tuple, tuple[tuple[str, ...], tuple[str, ...]]] = {}
    for rank, records in enumerate(records_by_rank):
        for names, replicated_over, copy_key, sums in records:
            key = (names[0], copy_key)
            copies.setdefault(key, {}).setdefault(tuple(sums), []).append(rank)
            described.setdefault(key, (names, replicated_over))
    found = []
    for key in sorted(copies, key=lambda k: (k[0], k[1])):
        by_print = copies[key]
        if len(by_print) < 2:
            continue
        names, replicated_over = described[key]
        held = sum(len(ranks) for ranks in by_print.values())
        common = max(by_print.values(), key=len)
        majority = tuple(sorted(common)) if 2 * len(common) > held else ()
        ranks = tuple(sorted(r for ranks in by_print.values() for r in ranks if r not in majority))
        kinds = tuple(KINDS.get(dim, f"replicated over {dim}") for dim in replicated_over)
        found.append(Divergence(names, kinds, ranks, majority))
    return found


def report(found: Sequence[Divergence], step: int) -> str:
    """The message every rank raises."""
    lines = "\n".join(f"  {divergence.describe()}" for divergence in found)
    return (f"Replicas diverged (checked after optimizer step {step}): copies of parameters that must be identical"
            " on several ranks differ, from a flipped bit in one copy, a non-deterministic operation or a wrong"
            f" parallel plan. Stopping before they drift further apart:\n{lines}")


def _listed(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


# ------------------------------------------------------------------------------------------------------ callback
class ReplicaCheck(pl.Callback):
    """Runs :func:`check_replicas` after the optimizer step of every ``every_n_steps``-th global step (added by
    ``HybridStrategy(check_replicas_every_n_steps=N)``; usable with any strategy that has a ``device_mesh``).

    Example::

        trainer = Trainer(strategy=HybridStrategy(tp=2), callbacks=[ReplicaCheck(every_n_steps=50)])
    """

    def __init__(self, every_n_steps: int) -> None:
        check_positive("ReplicaCheck", "every_n_steps", every_n_steps)
        self.every_n_steps = every_n_steps
        self._plan: Optional[ReplicaPlan] = None
        #: The global step after which the last check ran (the fit's first step until one has).
        self.last_checked_step = 0

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._plan, self.last_checked_step = None, trainer.global_step  # parameters may be new objects each fit

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self.last_checked_step or step % self.every_n_steps:
            return  # no optimizer step since the last check (accumulation), or not an N-th step
        self.last_checked_step = step
        strategy = trainer.strategy
        if self._plan is None:
            pipeline = getattr(strategy, "pipeline", None)
            self._plan = plan_checks(pl_module, strategy.device_mesh, pipeline.shared if pipeline else ())
        check_replicas(self._plan, strategy.root_device, step)


def add_replica_check(trainer: pl.Trainer, every_n_steps: Optional[int]) -> None:
    """What ``HybridStrategy(check_replicas_every_n_steps=N)`` adds to the trainer's callbacks: a
    :class:`ReplicaCheck` unless one is there already; nothing for ``None``."""
    if every_n_steps is not None and not any(isinstance(c, ReplicaCheck) for c in trainer.callbacks):
        trainer.callbacks.append(ReplicaCheck(every_n_steps))
