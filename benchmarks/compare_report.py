"""``benchmarks/compare.py``'s figures: each side's launches aggregated over rounds, the pairs' table and notes.

Per launch (one side on one layout in one round; its ranks' :class:`benchmarks.step_window.RankRecord`\\ s):

Step time
    Per rank the median over the timed steps of the time between consecutive step ends, then the maximum over ranks
    (the slowest rank sets the pace). Per side: the median over rounds of those per-launch figures. Sides alternate:
    each round launches every side once, grouped by layout with the HybridStrategy launch in the middle of its group
    (shared by that layout's pairs), and the next round runs the list backwards, so drift of the machine -- other
    jobs share these 2 cores -- falls on both sides of a pair; the ratio is the median over rounds of the per-round
    ratio A/B (its range is printed). Interference from other jobs comes in bursts that can slow a whole launch, and
    only ever adds time, so the table also gives each side's best round (the smallest per-launch median) and their
    ratio: the least disturbed estimate.
CPU time per step
    Per rank the median over the timed steps, summed over ranks.
Peak memory
    The maximum over ranks (the phase of the peak and its breakdown by category: ``--json``).
Communication
    The maximum over ranks per collective type; collectives on 1-rank process groups are listed under the table.
    Next to it the theoretical minimum per rank (E = 4 bytes, P = parameters, b = sequences per data-parallel rank,
    L blocks, T, C sequence and width; :func:`minimum_comm`):

    * dp (ZeRO-3, FSDP): all-gather ``2·P_blocks + P_root`` (blocks gathered in forward and again in backward; the
      root -- embeddings, final norm, head -- stays gathered from forward to backward, as HybridStrategy, FSDP2's
      default and FSDP1 all do; 3·P with the root resharded too), reduce-scatter ``P`` (all × E).
    * dp (DDP): one all-reduce of the gradients, ``P·E``.
    * tp (Megatron): per block 2 all-reduces of ``b·T·C·E`` in forward (after the two row-parallel layers) and 2 in
      backward (input gradients of the two column-parallel layers); embeddings, final norm and head are replicated
      and computed redundantly, their gradients already agree, so nothing else is needed.
    * pp: ``b·T·C·E`` of activations sent forward and as many gradient bytes sent back across each stage boundary,
      i.e. per rank of 2 stages: send ``b·T·C·E`` and receive ``b·T·C·E``.
Same computation
    The loss of step 1 and of the last step on each side (dp: mean over the data-parallel ranks; pp: the last
    stage's mean over microbatches) -- they must agree to float rounding.
Python overhead (``--profile DIR``)
    The Python function calls per timed step, per side, layout and rank, from each rank's cProfile of the first round.
"""

from __future__ import annotations

import os
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from benchmarks.harness import markdown_table, median_gap

FP32 = 4
MiB = 2**20


@dataclass(frozen=True)
class Layout:
    """A data × tensor × pipeline layout both sides of a pair run."""

    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def oversubscribed(self) -> bool:
        return self.world > (os.cpu_count() or 1)


@dataclass(frozen=True)
class Pair:
    """Side ``a`` (HybridStrategy) against side ``b`` on one layout."""

    name: str
    layout: str
    a: str
    b: str


# ================================================================================================ one launch
@dataclass
class SideRun:
    """One side on one layout in one round: the per-rank records (JSON of ``RankRecord``) and what follows from them."""

    side: str
    layout: str
    round: int
    ranks: list[dict[str, Any]]
    wall_s: float
    warmup_steps: int

    def _timed_medians(self, key: str) -> list[float]:
        """Per rank: the median over the timed steps of the time between consecutive step ends (the last two steps
        are the counted and the memory-tracked one)."""
        return [median_gap(record[key], self.warmup_steps, len(record[key]) - 2) for record in self.ranks]

    def step_seconds(self) -> float:
        """Wall time per step: the slowest rank's median."""
        return max(self._timed_medians("step_ends"))

    def cpu_seconds(self) -> float:
        """CPU time per step (all threads of the process), summed over ranks."""
        return sum(self._timed_medians("step_cpu_ends"))

    def loss(self, step: int) -> float:
        """Mean over the ranks that report one (dp ranks: their shard's loss; pp: the last stage)."""
        values = [r["losses"][step] for r in self.ranks if r["losses"][step] is not None]
        return sum(values) / len(values)

    def per_type(self, key: str) -> dict[str, int]:
        """Max over ranks of each collective type's value (``comm_bytes``, ``comm_calls``, ``local_...``)."""
        result: dict[str, int] = {}
        for record in self.ranks:
            for kind, value in record[key].items():
                result[kind] = max(result.get(kind, 0), value)
        return {kind: value for kind, value in result.items() if value}

    def peak_bytes(self) -> int:
        return max(r["peak_bytes"] for r in self.ranks)


# ================================================================================================ theory
def parameter_counts(config: Any) -> dict[str, int]:
    """Total, per-block and outside-the-blocks parameter counts of ``recipes/gpt.py``'s GPT (no model is built)."""
    C, V, T, L = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    root = V * C + T * C + 2 * C + C * V  # wte, wpe, ln_f, lm_head (no bias)
    return {"total": L * per_block + root, "block": per_block, "blocks": L * per_block, "root": root}


def block_parameters_per_tp_rank(tp: int, config: Any) -> int:
    """Parameters of one block a tensor-parallel rank holds under the Megatron plan: column layers' weights and
    biases and row layers' weights sharded, LayerNorms and the row layers' biases whole."""
    C = config.n_embd
    sharded = (3 * C * C + 3 * C) + C * C + (4 * C * C + 4 * C) + 4 * C * C
    whole = 2 * 2 * C + C + C
    return sharded // tp + whole


def minimum_comm(layout: Layout, side: str, config: Any, global_batch: int) -> dict[str, int]:
    """Theoretical minimum bytes per collective type per rank and step (formulas in the module docstring)."""
    counts = parameter_counts(config)
    b = global_batch // layout.dp
    activation = b * config.block_size * config.n_embd * FP32
    result: dict[str, int] = defaultdict(int)
    if layout.tp > 1:
        result["all_reduce"] += 4 * config.n_layer * activation
    if layout.dp > 1:
        blocks = config.n_layer * block_parameters_per_tp_rank(layout.tp, config)
        if side == "ddp":
            result["all_reduce"] += (blocks + counts["root"]) * FP32
        else:
            result["all_gather"] += (2 * blocks + counts["root"]) * FP32
            result["reduce_scatter"] += (blocks + counts["root"]) * FP32
    if layout.pp > 1:
        result["send"] += activation
        result["recv"] += activation
    return dict(result)


# ================================================================================================ aggregated
@dataclass
class SideFigures:
    """One side of a pair over all rounds: times over every round; memory, communication and losses from the
    first (they do not vary between rounds)."""

    step: float
    best: float
    cpu: float
    peak: int
    comm: dict[str, int]
    calls: dict[str, int]
    local: dict[str, int]
    losses: tuple[float, float]  # step 1, last step
    info: dict[str, Any]

    @classmethod
    def of(cls, runs: list[SideRun]) -> "SideFigures":
        first = runs[0]
        last_step = len(first.ranks[0]["losses"]) - 1
        return cls(step=statistics.median(run.step_seconds() for run in runs),
                   best=min(run.step_seconds() for run in runs),
                   cpu=statistics.median(run.cpu_seconds() for run in runs), peak=first.peak_bytes(),
                   comm=first.per_type("comm_bytes"), calls=first.per_type("comm_calls"),
                   local=first.per_type("local_comm_bytes"), losses=(first.loss(0), first.loss(last_step)),
                   info=first.ranks[0]["info"])


@dataclass
class PairResult:
    """One row of the table: a pair's figures aggregated over rounds (see the module docstring)."""

    pair: Pair
    layout: Layout
    a: SideFigures
    b: SideFigures
    ratio: float
    ratio_range: tuple[float, float]
    cpu_ratio: float
    cpu_ratio_range: tuple[float, float]
    minimum: dict[str, int]


def summarize(pair: Pair, layout: Layout, rounds: list[tuple[SideRun, SideRun]],
              minimum: dict[str, int]) -> PairResult:
    """A pair's row from its ``(A, B)`` launches, one per round, and the layout's minimum communication."""
    ratios = [x.step_seconds() / y.step_seconds() for x, y in rounds]
    cpu_ratios = [x.cpu_seconds() / y.cpu_seconds() for x, y in rounds]
    return PairResult(
        pair=pair, layout=layout, a=SideFigures.of([x for x, _ in rounds]), b=SideFigures.of([y for _, y in rounds]),
        ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)),
        cpu_ratio=statistics.median(cpu_ratios), cpu_ratio_range=(min(cpu_ratios), max(cpu_ratios)),
        minimum=minimum,
    )


# ================================================================================================ printed
def _size(value: Optional[int]) -> str:
    if value is None or value == 0:
        return "0"
    if value < 1024:
        return f"{value} B"
    if value < MiB:
        return f"{value / 1024:.1f} KiB"
    return f"{value / MiB:.3f} MiB"


_COMM_ORDER = ("all_gather", "reduce_scatter", "all_reduce", "send", "recv", "broadcast", "all_to_all", "barrier")


def comm_cell(a: SideFigures, b: SideFigures, minimum: dict[str, int]) -> str:
    """One line per collective type: ``bytes A (calls) / bytes B (calls) / minimum bytes``."""
    kinds = set(a.comm) | set(b.comm) | set(minimum) | set(a.calls) | set(b.calls)

    def side(figures: SideFigures, kind: str) -> str:
        count = figures.calls.get(kind, 0)
        return _size(figures.comm.get(kind)) + (f" ({count}×)" if count else "")

    ordered = sorted(kinds, key=lambda k: _COMM_ORDER.index(k) if k in _COMM_ORDER else 99)
    return "<br>".join(f"{kind}: {side(a, kind)} / {side(b, kind)} / {_size(minimum.get(kind))}"
                       for kind in ordered) or "none"


HEADER = ["pair (A = hybrid vs B)", "layout", "step time A / B ms", "ratio A/B (range over rounds)",
          "best round A / B ms", "ratio", "CPU time per step A / B ms", "ratio (range)", "peak memory A / B MiB",
          "ratio", "communication per step per rank, A / B / minimum", "loss step 1, A / B", "loss last step, A / B"]


def _row(r: PairResult) -> list[str]:
    note = f" ({r.layout.world} ranks on {os.cpu_count()} cores: oversubscribed)" if r.layout.oversubscribed else ""
    (a1, an), (b1, bn) = r.a.losses, r.b.losses
    return [r.pair.b, r.layout.name + note, f"{r.a.step * 1e3:.0f} / {r.b.step * 1e3:.0f}",
            f"{r.ratio:.3f} ({r.ratio_range[0]:.3f}–{r.ratio_range[1]:.3f})",
            f"{r.a.best * 1e3:.0f} / {r.b.best * 1e3:.0f}", f"{r.a.best / r.b.best:.3f}",
            f"{r.a.cpu * 1e3:.0f} / {r.b.cpu * 1e3:.0f}",
            f"{r.cpu_ratio:.3f} ({r.cpu_ratio_range[0]:.3f}–{r.cpu_ratio_range[1]:.3f})",
            f"{r.a.peak / MiB:.2f} / {r.b.peak / MiB:.2f}", f"{r.a.peak / r.b.peak:.3f}",
            comm_cell(r.a, r.b, r.minimum), f"{a1:.5f} / {b1:.5f}", f"{an:.5f} / {bn:.5f}"]


def format_table(results: list[PairResult]) -> str:
    """The Markdown table printed to stdout (and copied into BENCHMARKS.md)."""
    return markdown_table(HEADER, [_row(r) for r in results])


def _pair_notes(r: PairResult) -> list[str]:
    lines = []
    for step, label in ((0, "step 1"), (1, "the last step")):
        a, b = r.a.losses[step], r.b.losses[step]
        if abs(a - b) > 1e-3 * abs(b):
            lines.append(f"- {r.pair.name}: WARNING: the losses of {label} differ ({a:.6f} vs {b:.6f}):"
                         " the two sides do not compute the same thing")
    if r.a.local or r.b.local:
        def listed(sizes: dict[str, int]) -> str:
            return ", ".join(f"{kind} {_size(value)}" for kind, value in sizes.items()) or "none"

        lines.append(f"- {r.pair.name}: collectives on 1-rank groups (no data moved): A {listed(r.a.local)};"
                     f" B {listed(r.b.local)}")
    split_a, split_b = r.a.info.get("blocks_per_stage"), r.b.info.get("blocks_per_stage")
    if split_a and split_b:
        lines.append(f"- {r.pair.name}: blocks per stage {split_a} (A), {split_b} (B)"
                     + ("" if split_a == split_b else " -- WARNING: the two sides cut the model differently"))
    return lines


def format_notes(results: list[PairResult]) -> str:
    """What the table leaves out: collectives on 1-rank groups, the pipeline cuts, losses that disagree."""
    return "\n".join(line for r in results for line in _pair_notes(r))


def format_python_calls(profile_dir: Path, timed_steps: int, layouts: list[str], sides: list[str]) -> str:
    """Python function calls per timed step, per side, layout and rank (first round): deterministic, unlike time on
    a shared machine, and a direct measure of framework overhead in Python."""
    import pstats

    rows = []
    for layout_name in layouts:
        for side in sides:
            files = sorted(profile_dir.glob(f"{side}-{layout_name}-round1-rank*.pstats"))
            if files:
                calls = [pstats.Stats(str(f)).total_calls / timed_steps for f in files]  # type: ignore[attr-defined]
                rows.append([side, layout_name, " / ".join(f"{c:,.0f}" for c in calls)])
    return markdown_table(["side", "layout", "Python function calls per step, by rank"], rows)
