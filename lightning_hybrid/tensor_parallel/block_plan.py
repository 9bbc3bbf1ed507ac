"""Automatic tensor parallelism for unmodified blocks.

Megatron-style tensor parallelism shards a *pair* of linear layers: the first column-wise (each rank computes some
output features), the second row-wise (each rank consumes those features and the partial results are summed).
Which layers pair up follows from data flow, so :func:`plan_block` reads it from a trace of one block
(:mod:`lightning_hybrid.tensor_parallel.dataflow`):

* a linear layer fed by the block's residual stream is a column candidate;
* a linear layer fed only by column candidates (through attention, activations, products) is row-wise;
* a column candidate is kept only if everything that consumes its output is row-wise.

Fused projections (q|k|v in one layer) are sharded with torch's strided placement so that each rank gets whole
heads of q, k *and* v; integer attributes the forward reads to reshape (head counts, widths) are set to their
per-rank values. Where the trace leaves a choice open (which factor of a reshape is the head count, whether a value
that matches a head count is one), :func:`plan_block` lists the candidates and the caller keeps the first whose
sharded block computes what the unsharded one does (:func:`lightning_hybrid.tensor_parallel.apply.plan_tensor_parallel`,
which also applies the plan). Nothing here touches a device mesh.

Example::

    custom, candidates = plan_block(block, trace_block(block, args, kwargs), tp_size=2)
    plan = BlockPlan(groups=[options[0] for options in candidates], custom=custom)
    print(plan.describe("model.blocks.*"))      # {"model.blocks.*.attn.qkv": "colwise (strided x3)", ...}
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Collection, Iterator, Mapping, Union

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from lightning_hybrid.tensor_parallel.attributes import attribute_subsets, attributes_to_scale
from lightning_hybrid.tensor_parallel.dataflow import BlockTrace
from lightning_hybrid.tensor_parallel.experts import ONCE, ExpertLayout, expert_layouts, holds_expert_stack
from lightning_hybrid.tensor_parallel.heads import ColumnShard, add_head_ratios, column_options
from lightning_hybrid.tensor_parallel.per_head import (PerHead, channel_counts, head_counts, holds_tables_per_head,
                                                       is_under, per_head_parameters)
from lightning_hybrid.tensor_parallel.overrides import PlanEntry
from lightning_hybrid.tensor_parallel.refusal import PlanRefusal

# Trials per pair group while settling ambiguous choices (split factor, which attributes to rescale).
_MAX_TRIALS = 32


@dataclass
class PairGroup:
    """Column layers and the row layers that consume them (e.g. q, k, v → o), plus the attributes to rescale."""

    columns: dict[str, ColumnShard]
    rows: list[str]
    owner: str
    #: ``(object path, attribute)`` of integer attributes set to their per-rank value on each rank.
    scaled_attributes: list[tuple[str, str]] = field(default_factory=list)
    #: Global size → per-rank size for sizes that do not simply divide by tp (key/value groups shared by ranks).
    sizes: dict[int, int] = field(default_factory=dict)
    #: The group's layers whose weight is stored ``(in, out)`` (Hugging Face's ``Conv1D``; see :mod:`.tp_layers`).
    transposed: frozenset[str] = frozenset()
    #: Weights sharded but activations whole: each column's output is all-gathered, each row reads the whole input
    #: (Hugging Face's ``colwise_rep``/``rowwise_rep``): right whatever the forward does between them.
    gathered: bool = False
    #: Parameters holding a value per head (attention sinks, position tables), sharded with the heads.
    per_head: list[PerHead] = field(default_factory=list)
    #: Whole layers the rows read directly (a latent projection's rotary key part): each rank back-propagates its
    #: heads' share, so their output gradients are summed over the ranks once, and the columns reading only them
    #: (``partial_inputs``, their up-projections) leave their input gradients partial.
    whole_inputs: list[str] = field(default_factory=list)
    partial_inputs: frozenset[str] = frozenset()
    #: Modules computing on those whole layers' outputs (a latent norm): their parameters' gradients are partial
    #: sums too, summed over the ranks.
    summed_modules: list[str] = field(default_factory=list)
    #: Layers whose output the forward changes in place: a torch style hands out a view autograd forbids that of.
    written_in_place: frozenset[str] = frozenset()

    @property
    def layers(self) -> list[str]:
        return [*self.columns, *self.rows]

    def per_rank(self, value: int, tp: int) -> int:
        """The per-rank value of a rescaled attribute holding ``value``."""
        return self.sizes.get(value, value // tp)


@dataclass
class ExpertGroup:
    """A module of stacked experts sharded along each expert's hidden width (:mod:`.tp_experts`)."""

    name: str
    layout: ExpertLayout
    scaled_attributes: list[tuple[str, str]] = field(default_factory=list)

    @property
    def layers(self) -> list[str]:
        return [self.name]

    def per_rank(self, value: int, tp: int) -> int:
        return value // tp

    def describe(self) -> str:
        dims = ", ".join(f"{name} whole (added by one rank)" if dim == ONCE else
                         f"{name} dim {dim}" + (f" (strided x{pieces})" if pieces > 1 else "")
                         for name, dim, pieces in self.layout)
        return f"experts ({dims})"


Group = Union[PairGroup, ExpertGroup]


@dataclass
class BlockPlan:
    """Tensor-parallel plan of one block, in module names relative to the block."""

    groups: list[Group]
    custom: dict[str, ParallelStyle] = field(default_factory=dict)

    def without(self, modules: Collection[str]) -> "BlockPlan":
        """The plan less the groups and styles of layers inside ``modules`` (sharded with another block)."""
        def inside(name: str) -> bool:
            return any(name == module or name.startswith(module + ".") for module in modules)

        return BlockPlan([group for group in self.groups if not any(inside(name) for name in group.layers)],
                         {name: style for name, style in self.custom.items() if not inside(name)})

    def describe(self, prefix: str = "") -> dict[str, str]:
        """The plan as ``{module name: style}``, the same form :class:`HybridStrategy`'s ``tp_plan`` accepts."""
        at = (prefix + ".") if prefix else ""
        described: dict[str, str] = {}
        for group in self.groups:
            if isinstance(group, ExpertGroup):
                described[at + group.name] = group.describe()
                continue
            for name, shard in group.columns.items():
                if name in self.custom:
                    continue
                described[at + name] = ("colwise (output gathered)" if group.gathered else shard.describe()
                                        + (" (input gradient summed at its source)" if name in group.partial_inputs else ""))
            described.update({at + name: "whole (gradient summed over tp)" for name in group.summed_modules})
            described.update({f"{at}{holder + '.' if holder else ''}{name}": f"per head (dim {dim})"
                              for holder, name, dim in group.per_head})
            row_style = "rowwise (input whole)" if group.gathered else "rowwise"
            described.update({at + name: row_style for name in group.rows if name not in self.custom})
        for group in self.groups:
            described.update({f"{at}{obj}.{attr}" if obj else at + attr: "÷tp" for obj, attr in group.scaled_attributes})
        described.update({at + name: type(style).__name__ for name, style in self.custom.items()})
        return described


# ----------------------------------------------------------------------------------------------------- planning
def plan_block(
    block: nn.Module,
    trace: BlockTrace,
    tp_size: int,
    overrides: Mapping[str, PlanEntry] | None = None,
) -> tuple[dict[str, ParallelStyle], list[list[Group]]]:
    """Classify the block's linear layers; return the user's explicit styles and, per pair group (and module of
    stacked experts), the candidate shardings to verify (most likely first).

    ``overrides`` maps block-relative module names (already resolved from user patterns) to a style.
    """
    overrides = dict(overrides or {})
    experts = [name for name, module in block.named_modules()
               if name not in overrides and name not in trace.linears and holds_expert_stack(module)]
    skip = {**overrides, **dict.fromkeys(experts, "experts")}
    roles = _classify(trace, overrides)
    _reject_unplannable_modules(block, trace, skip, [name for name, role in roles.items() if role == "colwise"])
    custom = {name: style for name, style in overrides.items() if isinstance(style, ParallelStyle)}
    candidates = _pair_candidates(block, trace, roles, tp_size, {*skip, *trace.linears, *trace.opaque}, overrides)
    return custom, candidates + [_expert_candidates(block, trace, name, tp_size) for name in experts]


def _pair_candidates(block: nn.Module, trace: BlockTrace, roles: dict[str, str], tp: int, skip: set[str],
                     overrides: Mapping[str, PlanEntry]) -> list[list[Group]]:
    """Per pair group, its candidate shardings; then each linear layer in no pair (its output read by more than
    row layers: an adaLN modulation) sharded alone with its output gathered, but not a router (trace.selected)."""
    candidates: list[list[Group]] = [
        [_with_whole_inputs(group, trace, roles) for group in _group_candidates(block, trace, columns, rows, tp, skip)]
        for columns, rows in _pair_groups(trace, roles)
    ]
    unpaired = [name for name, role in roles.items()
                if role == "replicate" and name not in overrides and name not in trace.selected]
    candidates += [[group] for name in unpaired if (group := _gathered_candidate(trace, [name], [], tp))]
    return [[dataclasses.replace(group, written_in_place=frozenset(trace.written_in_place & set(group.layers)))
             for group in options] for options in candidates]


def _expert_candidates(block: nn.Module, trace: BlockTrace, name: str, tp: int) -> list[Group]:
    """Layouts of a module of stacked experts, each with the attributes to try rescaling."""
    module = block.get_submodule(name)
    stream_widths = {use.in_features for use in trace.linears.values()
                     if any(source.startswith("arg") for source in use.sources)}
    layouts = expert_layouts(module, stream_widths, tp)
    if not layouts:
        raise PlanRefusal(
            f"tp={tp} does not divide the experts' hidden width in {type(module).__name__} {name!r} (parameter"
            f" shapes {[tuple(p.shape) for p in module.parameters(recurse=False)]}). Choose a tp that divides it,"
            f" or pass tp_plan={{'*.{name}': 'replicate'}} to keep the experts whole.",
            modules=(name,), reason=f"tp={tp} does not divide the experts' hidden width",
        )
    groups: list[Group] = []
    for layout in layouts:
        sizes = {module.get_parameter(param).shape[dim] // pieces for param, dim, pieces in layout if dim != ONCE}
        likely, doubtful = attributes_to_scale(trace, name, sizes, set(), block)
        groups += [ExpertGroup(name, layout, list(subset)) for subset in attribute_subsets(likely, doubtful)]
    return groups[:_MAX_TRIALS]


def _classify(trace: BlockTrace, overrides: Mapping[str, PlanEntry]) -> dict[str, str]:
    """Assign ``colwise``/``rowwise``/``replicate`` to every traced linear, demoting pairs that cannot hold. A row
    layer reads at least one column's shards; what else it reads must be whole (a rotary key part every head
    shares, another row's reduced output: a state-space mixer's ``x_proj``, read by its scan)."""
    stream = {source for source in trace.output_sources if source.startswith("arg")}
    fixed = {**{name: _role_of(entry) for name, entry in overrides.items()},
             **dict.fromkeys(_latent_projections(trace, stream), "replicate")}
    roles: dict[str, str] = {}
    for name, use in trace.linears.items():
        producers = [source for source in use.sources if source in trace.linears]
        if name in fixed:
            roles[name] = fixed[name]
        elif use.sources & stream or not any(roles[p] == "colwise" for p in producers):
            roles[name] = "colwise"
        else:
            roles[name] = "rowwise"
    changed = True
    while changed:  # demote until every column feeds only rows and every row reads columns and whole values
        changed = False
        for name, role in roles.items():
            if name in fixed:
                continue
            producers = {roles[s] for s in trace.linears[name].sources if s in trace.linears}
            ok = (
                all(roles.get(user) == "rowwise" for user in trace.consumers(name))
                and bool(trace.consumers(name))
                if role == "colwise"
                else role != "rowwise" or ("colwise" in producers and producers <= {"colwise", "replicate", "rowwise"})
            )
            if not ok:
                roles[name], changed = "replicate", True
    return roles


def _latent_projections(trace: BlockTrace, stream: set[str]) -> list[str]:
    """Low-rank down-projections of the stream (multi-head latent attention's ``q_a_proj``, ``kv_a_proj``): narrower
    than their input, read by linear layers only, one of them a wider layer reading nothing else (its
    up-projection; a multi-query key projection is read by the output projection with q and v). They stay whole
    per rank (sharded alone, their small output gathered), so that the up-projections are the columns, sharded by
    heads; what the heads read of them directly (the rotary key part) gets its gradient summed over the ranks."""
    def up_projection(name: str, user: str) -> bool:
        return trace.linears[user].sources == {name} and trace.linears[user].out_features > trace.linears[name].out_features

    return [name for name, use in trace.linears.items()
            if use.sources & stream and use.out_features < use.in_features and trace.consumers(name)
            and all(user in trace.linears for user in trace.consumers(name))
            and any(up_projection(name, user) for user in trace.consumers(name))]


def _with_whole_inputs(group: PairGroup, trace: BlockTrace, roles: dict[str, str]) -> PairGroup:
    """``group`` with the whole layers its rows read directly, and its rows whose reduced output its layers read
    (by heads only: gathered, everything is whole)."""
    whole = sorted({s for row in group.rows for s in trace.linears[row].sources if roles.get(s) == "replicate"}
                   | {s for name in group.layers for s in trace.linears[name].sources if s in group.rows},
                   key=list(trace.linears).index)
    if group.gathered or not whole:
        return group
    partial = frozenset(name for name in group.columns if trace.linears[name].sources <= set(whole))
    summed = [name for name, sources in trace.module_inputs.items() if sources and sources <= set(whole)]
    return dataclasses.replace(group, whole_inputs=whole, partial_inputs=partial, summed_modules=summed)


def _role_of(entry: PlanEntry) -> str:
    if isinstance(entry, ColwiseParallel):
        return "colwise"
    if isinstance(entry, RowwiseParallel):
        return "rowwise"
    if isinstance(entry, ParallelStyle):
        return "replicate"
    return entry


def _pair_groups(trace: BlockTrace, roles: dict[str, str]) -> Iterator[tuple[list[str], list[str]]]:
    """Connected components of column → row edges, in execution order."""
    seen: set[str] = set()
    for name in trace.linears:
        if roles[name] != "rowwise" or name in seen:
            continue
        rows, columns, frontier = {name}, set(), [name]
        while frontier:
            current = frontier.pop()
            if roles[current] == "rowwise":  # its column producers (what else it reads is whole)
                new = {s for s in trace.linears[current].sources if roles.get(s) == "colwise"} - columns
                columns |= new
            else:
                new = {u for u in trace.consumers(current) if u in trace.linears} - rows
                rows |= new
            frontier.extend(new)
        seen |= rows
        order = list(trace.linears)
        yield sorted(columns, key=order.index), sorted(rows, key=order.index)


def _reject_unplannable_modules(block: nn.Module, trace: BlockTrace, overrides: Mapping[str, PlanEntry],
                                columns: list[str]) -> None:
    """Matrix-shaped parameters outside the traced linear layers cannot be sharded automatically unless they hold
    a table per head, or per channel of ``columns`` beside them (a mixer's convolution): refuse, naming the module
    (the strategy keeps it whole; ``tp_strict=True`` asks the user what to do)."""
    heads = head_counts(trace)
    for name, module in block.named_modules():
        beside = [column for column in columns if is_under(name, _common_owner([column]))]
        if name in trace.linears or name in trace.opaque or isinstance(module, nn.Linear) or name in overrides \
                or holds_tables_per_head(module, heads | channel_counts(trace, beside)):
            continue
        own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
        if own:
            what = f"{type(module).__name__} with a {own[0].dim()}-D parameter is no linear layer the planner recognizes"
            raise PlanRefusal(
                f"Tensor parallel planning cannot shard {type(module).__name__} {name!r} in"
                f" {type(block).__name__} (it has a {own[0].dim()}-D parameter and is no linear layer the planner recognizes). Add an"
                f" entry for it to HybridStrategy(tp_plan=...), e.g. tp_plan={{'*.{name}': 'replicate'}} to keep it"
                " whole on every tensor-parallel rank, or a torch ParallelStyle.",
                modules=(name,), reason=what,
            )


def _group_candidates(
    block: nn.Module, trace: BlockTrace, columns: list[str], rows: list[str], tp_size: int, skip: set[str]
) -> list[PairGroup]:
    """All plausible ways to shard one pair group, most likely first; the last one shards the weights with the
    activations between them gathered (:func:`_gathered_candidate`), for forwards that cannot run on a share of
    the heads."""
    gathered = _gathered_candidate(trace, columns, rows, tp_size)
    try:
        by_heads = _head_candidates(block, trace, columns, rows, tp_size, skip)
    except PlanRefusal:
        if gathered is None:
            raise
        by_heads = []
    return by_heads[:_MAX_TRIALS] + ([gathered] if gathered else [])


def _head_candidates(
    block: nn.Module, trace: BlockTrace, columns: list[str], rows: list[str], tp_size: int, skip: set[str]
) -> list[PairGroup]:
    """The group's shardings by heads: each rank computes its heads between the columns and the rows (with the
    parameters held per head sharded too, then without them)."""
    group_heads = max((cut.factors[-2] for cut in trace.cuts if cut.linear in columns and len(cut.factors) > 1),
                      default=0)
    try:
        shard_options = [column_options(trace, name, tp_size, group_heads) for name in columns]
    except PlanRefusal as refusal:  # a column that cannot be sharded leaves its whole pair group unsharded
        raise PlanRefusal(str(refusal), modules=[*columns, *rows], reason=refusal.reason) from None
    owner = _common_owner([*columns, *rows])
    transposed = frozenset(name for name in [*columns, *rows] if trace.linears[name].transposed)
    called = {*trace.linears, *trace.module_inputs}
    groups = []
    for choice in itertools.product(*shard_options):
        columns_map = {name: shard for name, (shard, _, _, _) in zip(columns, choice)}
        sizes = {trace.linears[r].in_features: trace.linears[r].in_features // tp_size for r in rows}
        kept: set[int] = set()
        for _, option_sizes, option_kept, _ in choice:
            sizes.update(option_sizes)
            kept |= option_kept
        add_head_ratios(sizes, kept, [heads for *_, option_heads in choice for heads in option_heads])
        likely, doubtful = attributes_to_scale(trace, owner, set(sizes), kept, block)
        uneven = {value: size for value, size in sizes.items() if size != value // tp_size}
        heads = {count for *_, option_heads in choice for count, _ in option_heads} | channel_counts(trace, columns)
        per_head = per_head_parameters(block, owner, heads, tp_size, skip, called)
        for subset in attribute_subsets(likely, doubtful):
            groups += [PairGroup(columns_map, rows, owner, list(subset), transposed=transposed, sizes=uneven,
                                 per_head=tables) for tables in ([per_head, []] if per_head else [[]])]
    return groups


def _gathered_candidate(trace: BlockTrace, columns: list[str], rows: list[str], tp: int) -> PairGroup | None:
    """Every weight of the group sharded, each column's output all-gathered, each row reading its part of the
    whole input: what runs between them sees the unsharded tensors, so nothing in the forward needs to know (a
    head size derived from the input width, a norm over the whole projection, a table per head, a state-space
    scan). ``None`` where tp does not divide a width, or a layer is stored transposed."""
    linears = [trace.linears[name] for name in [*columns, *rows]]
    if any(use.transposed for use in linears) or any(trace.linears[name].out_features % tp for name in columns) \
            or any(trace.linears[name].in_features % tp for name in rows):
        return None
    return PairGroup({name: ColumnShard() for name in columns}, rows, _common_owner([*columns, *rows]),
                     gathered=True)


def _common_owner(names: list[str]) -> str:
    parts = [name.split(".")[:-1] for name in names]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)
