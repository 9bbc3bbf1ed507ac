"""Split an unmodified model into pipeline stages: what runs where, decided from one traced step.

The model is cut between its repeated blocks (:func:`lightning_hybrid.parallel.blocks.find_block_list`). Every other
module that holds parameters — embeddings, final norm, head, whatever the user named them — goes with the stage
that runs it: a module the step calls before the first block belongs to the first stage, one it calls after the
last block to the last stage. That is decided by watching one real step (:func:`trace_step`), not by names, and
the same trace measures each block's forward FLOPs so stages can be balanced by cost.

Example::

    trace = trace_step(lightning_module, blocks, run_step=lambda: lightning_module.training_step(batch, 0))
    split = plan_split(lightning_module, "model.layers", blocks, trace, num_stages=4)
    split.blocks_per_stage        # e.g. [2, 3, 3, 2]: the head's cost moved a block off the last stage
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.flop_counter import FlopCounterMode

from lightning_hybrid._compat import tree_leaves

BEFORE, TRUNK, AFTER = "before the blocks", "between blocks", "after the blocks"


@dataclass
class StepTrace:
    """What one step of the model did, as seen from its blocks and the modules around them."""

    block_flops: list[float]
    flops_before: float
    flops_after: float
    #: Name of every parameterized module outside the blocks → the phases in which it was called or its
    #: parameters were read (a weight tied to another module is read without calling its module).
    outer_phases: dict[str, set[str]]
    #: Parameters held directly by a module that also contains the blocks (e.g. a ``pos_embed`` tensor).
    direct_parameters: list[str]


@dataclass
class Unit:
    """One piece of the model that lives on exactly one pipeline stage: a block, or a module outside the blocks."""

    name: str
    block_index: Optional[int]
    stage: int


@dataclass
class StageSplit:
    """The result of :func:`plan_split`: blocks per stage and every unit's stage."""

    num_stages: int
    blocks_per_stage: list[int]
    units: list[Unit] = field(default_factory=list)

    def block_range(self, stage: int) -> range:
        """Indices of the blocks that ``stage`` runs."""
        start = sum(self.blocks_per_stage[:stage])
        return range(start, start + self.blocks_per_stage[stage])


def outer_modules(root: nn.Module, blocks: nn.Module) -> tuple[dict[str, nn.Module], list[str]]:
    """Largest submodules with parameters that do not contain the blocks, and parameters held directly by the
    modules that do (the path from the root down to the block list)."""
    found: dict[str, nn.Module] = {}
    direct: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        direct.extend(prefix + name for name, _ in module.named_parameters(recurse=False))
        for name, child in module.named_children():
            if child is blocks:
                continue
            if any(m is blocks for m in child.modules()):
                visit(child, f"{prefix}{name}.")
            elif any(True for _ in child.parameters()):
                found[prefix + name] = child

    visit(root, "")
    return found, direct


def trace_step(root: nn.Module, blocks: nn.Module, run_step: Callable[[], Any]) -> StepTrace:
    """Run ``run_step`` once (gradients off) and record FLOPs per block and what ran before and after the blocks."""
    outer, direct = outer_modules(root, blocks)
    watch = _StepWatch(list(blocks), outer)
    owner_of = {id(p): name for name, module in outer.items() for p in module.parameters()}
    handles = watch.attach()
    try:
        with torch.no_grad(), watch.counter, _ParameterReads(owner_of, watch.phases, watch.state):
            run_step()
    finally:
        for handle in handles:
            handle.remove()
    _check_block_calls(watch.calls)
    total = watch.counter.get_total_flops()
    return StepTrace(
        block_flops=watch.block_flops,
        flops_before=watch.marks.get("trunk", 0.0),
        flops_after=total - watch.marks.get("after", total),
        outer_phases=watch.phases,
        direct_parameters=direct,
    )


class _StepWatch:
    """Forward hooks that follow one traced step: its phase (before, between, after the blocks), each block's calls
    and FLOPs, and the phases in which each outer module runs."""

    def __init__(self, blocks: list[nn.Module], outer: dict[str, nn.Module]) -> None:
        self.blocks, self.outer = blocks, outer
        self.state = {"phase": BEFORE}  # a dict: _ParameterReads reads the current phase from it
        self.phases: dict[str, set[str]] = {name: set() for name in outer}
        self.calls = [0] * len(blocks)
        self.block_flops = [0.0] * len(blocks)
        self.counter = FlopCounterMode(display=False)
        self.marks: dict[str, float] = {}

    def attach(self) -> list[Any]:
        handles = []
        for index, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._block_started, index)))
            handles.append(block.register_forward_hook(functools.partial(self._block_finished, index)))
        for name, module in self.outer.items():
            handles.append(module.register_forward_pre_hook(functools.partial(self._outer_called, name)))
        return handles

    def _block_started(self, index: int, module: nn.Module, args: Any) -> None:
        self.calls[index] += 1
        self.state["phase"] = TRUNK
        self.marks["block"] = self.counter.get_total_flops()
        if index == 0:
            self.marks["trunk"] = self.marks["block"]

    def _block_finished(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self.block_flops[index] += self.counter.get_total_flops() - self.marks["block"]
        if index == len(self.blocks) - 1:
            self.state["phase"] = AFTER
            self.marks["after"] = self.counter.get_total_flops()

    def _outer_called(self, name: str, module: nn.Module, args: Any) -> None:
        self.phases[name].add(self.state["phase"])


class _ParameterReads(TorchFunctionMode):
    """Records the phase in which each outer module's parameters are used by any torch function."""

    def __init__(self, owner_of: dict[int, str], phases: dict[str, set[str]], state: dict[str, Any]) -> None:
        super().__init__()
        self._owner_of, self._phases, self._state = owner_of, phases, state

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        # Only uses that compute a tensor count: reading metadata (``p.is_meta``, ``p.numel()``) is not a use.
        if any(isinstance(v, torch.Tensor) for v in tree_leaves(result)):
            for value in tree_leaves((args, kwargs or {})):
                if isinstance(value, nn.Parameter) and id(value) in self._owner_of:
                    self._phases[self._owner_of[id(value)]].add(self._state["phase"])
        return result


def _check_block_calls(calls: list[int]) -> None:
    wrong = {index: count for index, count in enumerate(calls) if count != 1}
    if wrong:
        raise ValueError(
            "Pipeline parallelism cuts the model between its blocks, so each block must run exactly once per step;"
            f" in the traced step these blocks ran a different number of times (block: calls): {wrong}. Point"
            " HybridStrategy(blocks=...) at a block list whose blocks each run once, or use pp=1."
        )


def plan_split(
    root: nn.Module,
    blocks_path: str,
    blocks: nn.Module,
    trace: StepTrace,
    num_stages: int,
    blocks_per_stage: Optional[Sequence[int]] = None,
) -> StageSplit:
    """Assign blocks (balanced by traced FLOPs unless ``blocks_per_stage`` is given) and outer modules to stages."""
    num_blocks = len(blocks)
    if num_stages > num_blocks:
        raise ValueError(
            f"{num_stages} pipeline stages (pp × virtual_stages) need at least {num_stages} blocks, but"
            f" '{blocks_path}' has {num_blocks}. Lower pp or virtual_stages, or point HybridStrategy(blocks=...)"
            " at a longer block list."
        )
    if trace.direct_parameters:
        raise ValueError(
            f"Pipeline parallelism places every parameter on one stage by the module that holds it, but"
            f" {trace.direct_parameters} are held directly by a module that also contains the blocks"
            f" ('{blocks_path}'), so no stage can own them alone. Move them into a submodule (e.g. an nn.Module"
            " holding the positional embedding), or use pp=1."
        )
    phase_of = _outer_phases(trace)
    if blocks_per_stage is None:
        counts = balanced_split(_block_costs(blocks, trace), num_stages, trace.flops_before, trace.flops_after)
    else:
        counts = _checked_split(blocks_per_stage, num_stages, num_blocks)
    split = StageSplit(num_stages=num_stages, blocks_per_stage=counts)
    for stage in range(num_stages):
        split.units += [Unit(f"{blocks_path}.{i}", i, stage) for i in split.block_range(stage)]
    split.units += [Unit(name, None, 0 if phase == BEFORE else num_stages - 1) for name, phase in phase_of.items()]
    return split


def _outer_phases(trace: StepTrace) -> dict[str, str]:
    result = {}
    for name, phases in trace.outer_phases.items():
        if TRUNK in phases or len(phases) > 1:
            where = " and ".join(sorted(phases))
            raise ValueError(
                f"Pipeline parallelism needs every module outside the blocks to run on one stage, but '{name}' is"
                f" used {where} (a weight shared between the embedding and the head, or a module reused around"
                " the blocks). Untie the weights or call the module on one side of the blocks only, or use pp=1."
            )
        # A module the step never uses gets no gradient; it stays with the first stage.
        result[name] = next(iter(phases), BEFORE)
    return result


def _block_costs(blocks: nn.Module, trace: StepTrace) -> list[float]:
    if sum(trace.block_flops) > 0:
        return trace.block_flops
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
