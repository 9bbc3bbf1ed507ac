"""How a column-parallel layer's output features are dealt to tensor-parallel ranks: whole heads of every piece.

A layer's output may be one block of heads (``q_proj``), equal fused pieces (q|k|v, gate|up) or unequal ones
(grouped-query q|k|v). What the block's forward does to the output, recorded by
:mod:`lightning_hybrid.tensor_parallel.dataflow` (splits, slices, reshapes into heads), tells which layouts are
possible; :func:`column_options` lists them with the sizes that become per-rank, for
:mod:`lightning_hybrid.tensor_parallel.block_plan` to pair with the attributes the forward reads.

* Equal pieces, each with a head count tp divides: a (strided) ``Shard`` of the weight.
* Unequal pieces, or fewer key/value heads than ranks: :attr:`ColumnShard.heads`; the weight stays whole and each
  rank computes its query heads and the key/value groups they attend to (see
  :func:`lightning_hybrid.tensor_parallel.layers.select_rows`).

Example::

    column_options(trace, "attn.qkv", tp=2, group_heads=4)[0][0]
    # ColumnShard(split_factor=1, heads=((32, 4), (16, 2), (16, 2)))     q: 4 heads, k and v: 2 groups
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from lightning_hybrid.tensor_parallel.dataflow import BlockTrace, FeatureCut
from lightning_hybrid.tensor_parallel.refusal import PlanRefusal


@dataclass(frozen=True)
class ColumnShard:
    """How a column-parallel layer's output rows are dealt to ranks."""

    #: The output is ``split_factor`` equal pieces (q|k|v); each rank gets its chunk of every piece.
    split_factor: int = 1
    #: ``(width, heads)`` of each piece when the pieces cannot share one shard layout (grouped-query q|k|v, fewer
    #: key/value heads than ranks): the weight stays whole and each rank computes the rows of :meth:`spans`.
    heads: tuple[tuple[int, int], ...] = ()

    def spans(self, rank: int, tp: int) -> tuple[tuple[int, int], ...]:
        """``(start, stop)`` output rows rank ``rank`` computes: its share of every piece's heads, or, for a piece
        with fewer heads than ranks, the one head its share of the largest piece attends to."""
        spans, offset = [], 0
        for width, count in self.heads:
            head_size, per_rank = width // count, max(count // tp, 1)
            first = rank * count // tp
            spans.append((offset + first * head_size, offset + (first + per_rank) * head_size))
            offset += width
        return tuple(spans)

    def describe(self) -> str:
        if self.heads:
            return "colwise (heads " + " | ".join(str(count) for _, count in self.heads) + ")"
        return "colwise" + (f" (strided x{self.split_factor})" if self.split_factor > 1 else "")

ColumnOption = tuple[ColumnShard, dict[int, int], frozenset[int], tuple[tuple[int, int], ...]]


def add_head_ratios(sizes: dict[int, int], kept: set[int], heads: list[tuple[int, int]]) -> None:
    """Query heads per key/value group (``num_key_value_groups``) change when ranks share a group, else stay."""
    for (many, many_local), (few, few_local) in itertools.permutations(heads, 2):
        if many > few and many % few == 0 and many_local % few_local == 0:
            ratio, local_ratio = many // few, many_local // few_local
            if ratio == local_ratio:
                kept.add(ratio)
            else:
                sizes.setdefault(ratio, local_ratio)


def column_options(trace: BlockTrace, name: str, tp: int, group_heads: int) -> list[ColumnOption]:
    """``(shard, {global size: per-rank size}, sizes that stay, ((heads, per-rank heads), ...))`` for each way to
    deal whole heads of ``name``'s output; ``group_heads`` is the most heads any column of its group has."""
    width = trace.linears[name].out_features
    cuts = [cut for cut in trace.cuts if cut.linear == name]
    pieces = _pieces(cuts, width)
    shapes = {cut.factors for cut in cuts if cut.factors}
    options = _even_options(width, pieces, shapes, tp) if len(set(pieces)) <= 1 else []
    options += _head_options(pieces or (width,), shapes, tp, group_heads)
    if not options:
        heads = " or ".join(f"{' × '.join(map(str, f))}" for f in shapes)
        detail = f"its output is reshaped into {heads}" if heads else f"it has {width} output features"
        detail += f" in pieces {list(pieces)}" if len(set(pieces)) > 1 else ""
        raise PlanRefusal(
            f"tp={tp} does not divide the layout of {name!r}: {detail}. Choose a tp that divides the number of"
            f" heads (and key/value heads) and the layer widths, or pass tp_plan={{'*.{name}': 'replicate'}}.",
            modules=(name,), reason=f"tp={tp} does not divide the layout of {name!r}: {detail}",
        )
    return list({(o[0], tuple(o[1].items()), o[2], o[3]): o for o in options}.values())


def _pieces(cuts: list[FeatureCut], width: int) -> tuple[int, ...]:
    """Widths of the pieces the output is cut into (``split``/``chunk``, or slices that tile it); ``()`` if none."""
    split = next((cut.pieces for cut in cuts if cut.pieces), ())
    if split:
        return split
    bounds = sorted({cut.span for cut in cuts if cut.span})
    if len(bounds) > 1 and bounds[0][0] == 0 and bounds[-1][1] == width and all(
            a[1] == b[0] for a, b in zip(bounds, bounds[1:])):
        return tuple(stop - start for start, stop in bounds)
    return ()


def _even_options(width: int, pieces: tuple[int, ...], shapes: set[tuple[int, ...]], tp: int) -> list[ColumnOption]:
    """Equal pieces (or none), each dealt to ranks in equal contiguous chunks: a (strided) ``Shard``."""
    base = len(pieces) or 1
    piece_width = width // base
    options: list[ColumnOption] = []
    for factors in shapes:
        # Shard one non-innermost factor (the innermost is the head size); try the innermost candidates first.
        for index in reversed(range(len(factors) - 1)):
            if factors[index] % tp:
                continue
            split = base * math.prod(factors[:index])
            kept = frozenset({*factors[:index], *factors[index + 1:], split} - {1})
            scaled = {width, piece_width, factors[index], *pieces} - kept
            heads = ((factors[index], factors[index] // tp),)
            options.append((ColumnShard(split), {v: v // tp for v in scaled}, kept, heads))
    if not shapes and piece_width % tp == 0:
        scaled = {width, piece_width, *pieces} - {base}
        options.append((ColumnShard(base), {v: v // tp for v in scaled}, frozenset({base} - {1}), ()))
    return options


def _head_options(pieces: tuple[int, ...], shapes: set[tuple[int, ...]], tp: int,
                  group_heads: int) -> list[ColumnOption]:
    """Pieces of unequal head counts (grouped-query q|k|v) or with fewer heads than ranks: each rank computes its
    q heads and the key/value groups they attend to (a group shared by several ranks is computed by each)."""
    options: list[ColumnOption] = []
    for head_size in dict.fromkeys(factors[-1] for factors in shapes if len(factors) == 2):
        counts = [piece // head_size for piece in pieces]
        if any(piece % head_size for piece in pieces) or group_heads % tp:
            continue
        local = [n // tp if n % tp == 0 else 1 if (tp % n == 0 and group_heads % n == 0) else 0 for n in counts]
        if 0 in local or (len(set(pieces)) <= 1 and all(n % tp == 0 for n in counts)):
            continue  # not dealable, or an even Shard already covers it
        sizes = {n: m for n, m in zip(counts, local)} | {n * head_size: m * head_size for n, m in zip(counts, local)}
        sizes[sum(pieces)] = sum(local) * head_size
        kept = frozenset({head_size, *(value for value, size in sizes.items() if size == value)})
        shard = ColumnShard(heads=tuple(zip(pieces, counts)))
        changed = {value: size for value, size in sizes.items() if size != value}
        options.append((shard, changed, kept, tuple(zip(counts, local))))
    return options
