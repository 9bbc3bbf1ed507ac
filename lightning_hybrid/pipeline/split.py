"""Split an unmodified model into pipeline stages: what runs and what lives where, decided from one traced step.

The model is cut between its repeated blocks (:func:`lightning_hybrid.probe.blocks.find_block_list`), balanced by
each block's traced FLOPs (or measured time: :mod:`lightning_hybrid.pipeline.timed_split`). Every other module that
holds parameters — embeddings, final norm, head, whatever the user named them — goes with the stages that call it
(the setup probe's record, :mod:`lightning_hybrid.probe.record`): before the first block → the first stage, after the last block → the last
stage, between blocks → every stage. A parameter lives on every stage that reads it, whichever module holds it: a
weight tied between the embedding (first stage) and the head (last stage) lives on both, as do its modules; a table
held by the model itself (``self.pos_embed``) lives where it is read. The runtime sums the gradients of a parameter
held on several stages over them.

Example::

    record = record_step(lightning_module, blocks, run_step=lambda: lightning_module.training_step(batch, 0))
    split = plan_split(lightning_module, "model.layers", blocks, record, num_stages=4)
    split.blocks_per_stage        # e.g. [2, 3, 3, 2]: the head's cost moved a block off the last stage
    split.parameter_stages        # {"model.tok_emb.weight": (0, 3), "model.head.weight": (0, 3), ...} when tied
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from torch import nn

from lightning_hybrid.probe.blocks import BlockList, blocks_holding
from lightning_hybrid.probe.record import AFTER, BEFORE, TRUNK, SetupRecord


@dataclass
class Unit:
    """One piece of the model a stage holds: a block, or a module outside the blocks. ``stages`` hold it;
    on ``computes_on`` its calls compute (elsewhere a stand-in answers: a tied head is held on the first stage for
    its weight but computes on the last)."""

    name: str
    block_index: Optional[int]
    stages: tuple[int, ...]
    computes_on: tuple[int, ...]

    @property
    def stage(self) -> int:
        """The first stage it computes on."""
        return self.computes_on[0]


@dataclass
class StageSplit:
    """The result of :func:`plan_split`: blocks per stage, every unit's stages, and where each parameter outside
    the blocks lives (a block's parameters live with their block)."""

    num_stages: int
    blocks_per_stage: list[int]
    units: list[Unit] = field(default_factory=list)
    #: Name of every parameter outside the blocks (tied weights under each name), and of a block's parameter that
    #: blocks on other stages hold too → the stages that hold it.
    parameter_stages: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: Parameters held directly by a module that contains the blocks (not by any unit) → their stages.
    direct: dict[str, tuple[int, ...]] = field(default_factory=dict)
    #: The names of each parameter that blocks on several stages hold (recorded here: once tensor parallelism
    #: shards one stage's blocks, the names no longer lead to one object on every rank).
    tied_in_blocks: list[tuple[str, ...]] = field(default_factory=list)
    #: A module of a block that the step calls from outside the block on other stages than the block's → those
    #: stages: it is held there too (its parameters, in :attr:`parameter_stages`, are shared like tied weights).
    held_inside: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def block_unit_of(self, name: str) -> Unit:
        """The block unit that contains the module or parameter ``name``."""
        return next(unit for unit in self.units if unit.block_index is not None and name.startswith(unit.name + "."))

    def block_range(self, stage: int) -> range:
        """Indices of the blocks that ``stage`` runs."""
        start = sum(self.blocks_per_stage[:stage])
        return range(start, start + self.blocks_per_stage[stage])


def plan_split(
    root: nn.Module,
    blocks_path: str,
    blocks: BlockList,
    record: SetupRecord,
    num_stages: int,
    blocks_per_stage: Optional[Sequence[int]] = None,
) -> StageSplit:
    """Assign blocks (balanced by traced FLOPs unless ``blocks_per_stage`` is given), outer modules and the
    parameters outside the blocks to stages."""
    check_enough_blocks(blocks_path, len(blocks), num_stages)
    if blocks_per_stage is None:
        counts = flop_balanced_split(blocks, record, num_stages)
    else:
        counts = _checked_split(blocks_per_stage, num_stages, len(blocks))
    split = StageSplit(num_stages=num_stages, blocks_per_stage=counts)
    for stage in range(num_stages):
        split.units += [Unit(blocks.name(i), i, (stage,), (stage,)) for i in split.block_range(stage)]
    # A parameter lives wherever it is read; a module the step never uses stays with the first stage.
    split.parameter_stages = {name: _stages(reads, num_stages) or (0,) for name, reads in record.parameter_reads.items()}
    for name, calls in record.outer_calls.items():
        held = {stage for param, stages in split.parameter_stages.items() if param.startswith(name + ".")
                for stage in stages}
        computes = _stages(calls, num_stages) or (min(held),)
        split.units.append(Unit(name, None, tuple(sorted(held | set(computes))), computes))
    split.direct = {name: split.parameter_stages[name] for name in record.direct_parameters}
    _hold_where_called(root, split, record)
    _share_between_stages(blocks, split)
    return split


def _share_between_stages(blocks: BlockList, split: StageSplit) -> None:
    """A parameter that blocks on several stages hold (one module in each, or modules tied to each other: Zamba2's
    shared transformer block) lives on each of those stages, its gradient summed over them as a tied embedding's
    is (:mod:`.shared`): it is listed under each name with all their stages."""
    stage_of = {index: stage for stage in range(split.num_stages) for index in split.block_range(stage)}
    for key, indices in blocks_holding(blocks).items():
        held = tuple(sorted({stage_of[index] for index in indices}))
        if len(held) > 1:
            names = sorted(f"{blocks.name(index)}.{name}" for index in indices
                           for name, parameter in blocks[index].named_parameters(remove_duplicate=False)
                           if id(parameter) == key)
            split.parameter_stages.update(dict.fromkeys(names, held))
            split.tied_in_blocks.append(tuple(names))


def _hold_where_called(root: nn.Module, split: StageSplit, record: SetupRecord) -> None:
    """Modules of a block called from outside it (:attr:`SetupRecord.block_module_calls`) are also held on the
    stages that call them, as a tied weight is held on the stages that read it."""
    for name, phases in record.block_module_calls.items():
        unit = split.block_unit_of(name)
        extra = set(_stages(phases, split.num_stages)) - set(unit.stages)
        if not extra:
            continue
        split.held_inside[name] = tuple(sorted(extra))
        for parameter, _ in root.get_submodule(name).named_parameters():
            split.parameter_stages[f"{name}.{parameter}"] = tuple(sorted(set(unit.stages) | extra))


def _stages(phases: Iterable[str], num_stages: int) -> tuple[int, ...]:
    """The stages that run ``phases``: the first for code before the blocks, the last for code after them, and
    every stage for code between blocks (each runs some of the blocks)."""
    stages: set[int] = set()
    for phase in phases:
        stages |= {BEFORE: {0}, AFTER: {num_stages - 1}, TRUNK: set(range(num_stages))}[phase]
    return tuple(sorted(stages))


def check_block_runs(runs: Sequence[int]) -> None:
    """Refuse a step whose blocks did not each run once: the pipeline cuts it between blocks."""
    wrong = {index: count for index, count in enumerate(runs) if count != 1}
    if wrong:
        raise ValueError(
            "Pipeline parallelism cuts the model between its blocks, so each block must run exactly once per step;"
            f" in the traced step these blocks ran a different number of times (block: calls): {wrong}. Point"
            " HybridStrategy(blocks=...) at a block list whose blocks each run once, or use pp=1."
        )


def check_enough_blocks(blocks_path: str, num_blocks: int, num_stages: int) -> None:
    """Refuse more stages than blocks: every stage runs at least one block."""
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_stages} pipeline stages (pp × virtual_stages) need at least {num_stages} blocks, but"
            f" '{blocks_path}' has {num_blocks}. Lower pp or virtual_stages, or point HybridStrategy(blocks=...)"
            " at a longer block list."
        )


def flop_balanced_split(blocks: BlockList, record: SetupRecord, num_stages: int) -> list[int]:
    """Blocks per stage balanced by the traced FLOPs (the default split)."""
    return balanced_split(_block_costs(blocks, record), num_stages, record.flops_before, record.flops_after)


def _block_costs(blocks: BlockList, record: SetupRecord) -> list[float]:
    if sum(record.block_flops) > 0:
        return record.block_flops
    # No matrix products counted (FLOP counting covers matmuls, convolutions and attention): balance parameters.
    return [float(sum(p.numel() for p in block.parameters())) for block in blocks]


def balanced_split(costs: Sequence[float], num_stages: int, first_extra: float = 0.0, last_extra: float = 0.0) -> list[int]:
    """Blocks per stage for contiguous stages that minimize the most expensive stage.

    ``first_extra``/``last_extra`` are the costs outside the blocks that the first/last stage also carries (the
    embedding, the head and the loss). Among equally good splits the earliest stages get more blocks.

    Example::

        balanced_split([1, 1, 1, 1], 2, last_extra=1.5)    # [3, 1]
    """
    n = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (first_extra if stage == 0 else 0.0) + (last_extra if stage == num_stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    # best[s][i]: the smallest maximum stage cost when stages s.. cover blocks i..n-1 (each stage ≥ 1 block).
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[num_stages][n] = 0.0
    for stage in range(num_stages - 1, -1, -1):
        remaining = num_stages - stage - 1
        for start in range(n - remaining - 1, -1, -1):
            for end in range(n - remaining, start, -1):  # longest first: ties keep more blocks early
                value = max(stage_cost(stage, start, end), best[stage + 1][end])
                if value < best[stage][start] - 1e-9 * max(1.0, abs(value)):
                    best[stage][start], cut[stage][start] = value, end
    counts, start = [], 0
    for stage in range(num_stages):
        end = cut[stage][start]
        counts.append(end - start)
        start = end
    return counts


def _checked_split(blocks_per_stage: Sequence[int], num_stages: int, num_blocks: int) -> list[int]:
    counts = list(blocks_per_stage)
    if (
        len(counts) != num_stages
        or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
        or sum(counts) != num_blocks
    ):
        raise ValueError(
            f"HybridStrategy(pp_split={counts}) must list the number of blocks of each of the {num_stages} stages"
            f" (pp × virtual_stages), each at least 1, adding up to the {num_blocks} blocks of the model."
        )
    return counts
