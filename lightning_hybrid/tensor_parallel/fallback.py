"""Degrade instead of refusing: what tensor parallelism cannot shard correctly stays whole on every tp rank, and
the run says so.

Where the planner refuses part of a block (:class:`~lightning_hybrid.tensor_parallel.refusal.PlanRefusal`: a
matrix parameter in no linear layer it recognizes, a layer width tp does not divide, a plan check that finds the
block's output changed, even with the weights sharded and the activations gathered), :func:`plan_keeping_whole`
falls back in stages:

1. the modules the refusal names are kept whole — exactly what ``tp_plan={"...": "replicate"}`` does: their
   parameters stay plain tensors, each tp rank computes them on the full (replicated) activations, so their
   gradients are the full ones on every rank — and the block is planned (and, with ``verify_tp_plan``, checked)
   again without them, until what stays sharded passes (a pair that would feed a kept module a shard fails the
   check and is kept whole in turn);
2. a refusal that names no module (the whole plan fails its check though every pair passed alone) keeps the whole
   block structure whole.

Never degraded, the refusal raised as it is: with ``strict`` (``HybridStrategy(tp_strict=True)``), where the
refusal involves a module the user's ``tp_plan`` gives a sharding style (the user's own instruction fails), and
any error that is not a planner's refusal (a bug in the block's forward, a ``tp_plan`` pattern matching nothing).

What was done is reported per block structure (:class:`StructureReport`: the fraction of its parameters tp
shards, the modules kept whole and why, the extra memory that costs per tp rank) in :class:`AppliedPlan`, which is
also the plan as ``{module pattern: style}`` (``HybridStrategy.tp_plan_applied``).

Example::

    plan, kept = plan_keeping_whole(lambda keep: plan_tensor_parallel(..., keep_whole=keep), explicit={},
                                    strict=False)
    kept    # [KeptWhole(modules=("pos",), reason="PositionTable with a 2-D parameter is no linear layer ..."),
            #  KeptWhole(modules=("q", "k", "v", "o"), reason="tp=2 does not divide the layout of 'q': ...")]
    apply_block_plan(block, plan, mesh)
    report = structure_report(block, plan, kept, "model.blocks.*", count=2, tp=2)
    report.fraction, report.extra_bytes      # 0.441 (3,612 of 8,190 parameters), 8736
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Callable, Collection, Iterator, Sequence

from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hybrid.tensor_parallel.block_plan import BlockPlan, PairGroup
from lightning_hybrid.tensor_parallel.overrides import PlanEntry
from lightning_hybrid.tensor_parallel.refusal import PlanRefusal


@dataclass(frozen=True)
class KeptWhole:
    """Modules of a block (names relative to it; ``()``: the whole block) kept whole on every tp rank, and why."""

    modules: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class StructureReport:
    """What tensor parallelism did to one block structure (blocks alike in modules and parameter shapes).

    ``blocks`` names them (``"model.blocks.*"``, or the blocks' names when the model has several structures);
    ``parameters`` and ``sharded`` count elements over all ``count`` blocks (``sharded``: those of parameters tp
    splits over its ranks); ``extra_bytes`` is what keeping ``kept_whole`` whole costs each tp rank over sharding
    them: their parameters' bytes × (1 - 1/tp), summed over the blocks (before FSDP2 divides it over data-parallel
    ranks, and a pipeline over its stages)."""

    blocks: str
    block_class: str
    count: int
    parameters: int
    sharded: int
    kept_whole: tuple[KeptWhole, ...] = ()
    extra_bytes: int = 0
    #: Layers sharded with their activations gathered (no rank can compute a share of the heads there): their
    #: weights are split, what runs between them is computed whole on every tp rank.
    gathered: tuple[str, ...] = ()

    @property
    def fraction(self) -> float:
        """The share of the structure's parameters tensor parallelism shards."""
        return self.sharded / self.parameters if self.parameters else 0.0

    def kept_text(self) -> str:
        """The modules kept whole with their reasons, ``"none"`` without any."""
        if not self.kept_whole:
            return "none"
        return "; ".join(f"{', '.join(kept.modules) or 'the whole block'} ({kept.reason})" for kept in self.kept_whole)

    def describe(self, tp: int) -> str:
        """One console line."""
        line = (f"tensor parallelism (tp={tp}) shards {self.fraction:.1%} of the {self.parameters:,} parameters of"
                f" {self.block_class} × {self.count} ({self.blocks})")
        if self.gathered:
            line += (f"; {', '.join(self.gathered)} sharded with their activations gathered (what runs between them"
                     " is computed whole on every tp rank)")
        if not self.kept_whole:
            return line
        return (f"{line}; kept whole on every tp rank: {self.kept_text()}; +{format_bytes(self.extra_bytes)} per tp"
                " rank. HybridStrategy(tp_strict=True) refuses instead.")


@dataclass(eq=False)
class AppliedPlan(Mapping[str, str]):
    """The tensor-parallel plan applied at setup (``HybridStrategy.tp_plan_applied``): as a mapping, ``{module
    pattern: style}`` (``plan["model.blocks.*.attn.qkv"] == "colwise (strided x3)"``, ``dict(plan)``); and per
    block structure what share of its parameters it shards and what it kept whole (:attr:`structures`), and why
    the embedding and head stayed whole if they did (:attr:`vocab`).

    Example::

        plan = trainer.strategy.tp_plan_applied
        [(s.blocks, round(s.fraction, 3), s.kept_text(), s.extra_bytes) for s in plan.structures]
        # [("model.blocks.*", 0.441, "pos (PositionTable with a 2-D parameter is ...); q, k, v, o (...)", 8736)]
    """

    styles: dict[str, str] = field(default_factory=dict)
    structures: list[StructureReport] = field(default_factory=list)
    vocab: str = ""

    def __getitem__(self, name: str) -> str:
        return self.styles[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.styles)

    def __len__(self) -> int:
        return len(self.styles)

    def merged(self, others: Sequence["AppliedPlan"]) -> "AppliedPlan":
        """This plan completed with the structures and styles only ``others`` (other pipeline stages') planned."""
        structures = {structure.blocks: structure for plan in [self, *others] for structure in plan.structures}
        styles = {name: style for plan in [*others, self] for name, style in plan.styles.items()}
        return AppliedPlan(styles, list(structures.values()), self.vocab)


def format_bytes(count: int) -> str:
    """``11136`` → ``"10.9 KiB"``."""
    size, unit = float(count), "B"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{count} B" if unit == "B" else f"{size:.1f} {unit}"


def plan_keeping_whole(plan: Callable[[Collection[str]], BlockPlan], explicit: Mapping[str, PlanEntry],
                       strict: bool) -> tuple[BlockPlan, list[KeptWhole]]:
    """``plan(keep_whole)`` (the block's plan with the block-relative modules ``keep_whole`` left whole), keeping
    whole what each :class:`PlanRefusal` names until a plan stands, or the whole block when a refusal names nothing
    left to keep whole. ``explicit`` is the user's ``tp_plan`` inside the block (relative names): a refusal
    involving a module it gives a style, or any refusal with ``strict``, is raised."""
    kept: list[KeptWhole] = []
    whole: dict[str, None] = {}
    while True:
        try:
            return plan(tuple(whole)), kept
        except PlanRefusal as refusal:
            involved = refusal.modules or tuple(explicit)  # a refusal naming no module involves the whole block
            if strict or any(explicit.get(name, "replicate") != "replicate" for name in involved):
                raise
            named = [name for name in refusal.modules if name not in whole]
            if not named:
                return BlockPlan(groups=[]), [*kept, KeptWhole((), refusal.reason)]
            whole.update(dict.fromkeys(named))
            kept.append(KeptWhole(tuple(named), refusal.reason))


def structure_report(block: nn.Module, plan: BlockPlan, kept: Sequence[KeptWhole], blocks: str, count: int,
                     tp: int) -> StructureReport:
    """The report of a block structure of ``count`` blocks like ``block`` (``plan`` applied to it)."""
    parameters = list(block.parameters())
    # split over the tp ranks, whatever the placement (a strided shard is no Shard to DTensor's is_shard)
    sharded = [p for p in parameters if isinstance(p, DTensor) and p.to_local().numel() < p.numel()]
    held: dict[int, nn.Parameter] = {}
    for entry in kept:
        for name in entry.modules or ("",):
            held.update((id(p), p) for p in block.get_submodule(name).parameters())
    sharded_ids = {id(p) for p in sharded}
    whole_bytes = sum(p.numel() * p.element_size() for i, p in held.items() if i not in sharded_ids)
    return StructureReport(blocks, type(block).__name__, count, count * sum(p.numel() for p in parameters),
                           count * sum(p.numel() for p in sharded), tuple(kept), count * whole_bytes * (tp - 1) // tp,
                           tuple(name for group in plan.groups if isinstance(group, PairGroup) and group.gathered
                                 for name in group.layers))


def structure_label(blocks_path: str, keys: Sequence[str], structures: int) -> str:
    """How the report names a structure: ``"model.blocks.*"`` when all blocks share one, else its blocks' keys
    (their full names where the blocks sit in several lists, ``blocks_path`` ``"encoder,decoder"``)."""
    if structures == 1 and "," not in blocks_path:
        return f"{blocks_path}.*"
    shown = ",".join(keys[:6]) + (",…" if len(keys) > 6 else "")
    return f"{{{shown}}}" if "," in blocks_path else f"{blocks_path}.{{{shown}}}"

