"""The figures docs/tuning.md's worked examples quote are the planner's, so that the guide cannot go stale silently.

The guide states them in ``text`` code blocks of this form (a ``$ lightning-hybrid plan ...`` command, continued
with ``\\``, then one line per layout of that plan)::

    $ lightning-hybrid plan --layers 32 ... --global-batch 64
    dp8 tp1 pp1 acc8 z3        #1 of 323 fit   63.08 GiB   88,657 tokens/s   MFU 64.9%
    dp16 tp2 pp1 acc4 z3       out of memory  287.69 GiB   42,186 tokens/s   MFU 64.2%

Each command is run in-process with ``--layout`` and each figure compared with what the planner prints now, to the
digits the guide writes. A rank (``#N of M fit``) costs a whole plan, so the 175B example (35k layouts, about 10 s)
states none; its rank is in its config's ``# predicted:`` line, which the guide quotes verbatim and
tests/test_cluster_configs.py checks against the planner.
"""

from __future__ import annotations

import functools
import re
import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import pytest

from lightning_hybrid.cli import main as lightning_hybrid_main
from lightning_hybrid.planner import search
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.hardware import GIB
from lightning_hybrid.planner.layout import Estimate, parse_layout
from tests.test_cluster_configs import cluster_configs, read_header

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"
FIGURES = re.compile(
    r"(?P<layout>\S.*?)\s{2,}(?:#(?P<rank>\d+) of (?P<feasible>[\d,]+) fit|fits|(?P<oom>out of memory))"
    r"\s+(?P<memory>[\d.]+) GiB\s+(?P<tokens>[\d,]+) tokens/s\s+MFU (?P<mfu>[\d.]+)%$")


def guide_figures() -> list[tuple[str, str]]:
    """``(command, figures line)`` of every layout line under a ``$ lightning-hybrid plan`` in a text block."""
    found, command, block = [], None, False
    for line in GUIDE.read_text().splitlines():
        if line.startswith("```"):
            block, command = line == "```text", None
        elif block and line.startswith("$ lightning-hybrid plan "):
            command = line[2:]
        elif block and command is not None and command.endswith("\\"):
            command = command[:-1].rstrip() + " " + line.strip()
        elif block and command is not None and line.strip():
            found.append((command, line.strip()))
    return found


@functools.cache
def plan_inputs(command: str) -> tuple[Any, ...]:
    """The model, cluster, global batch, precision and strategy options the CLI builds from ``command``."""
    asked: list[tuple[Any, ...]] = []
    original = search.plan
    search.plan = lambda *arguments, **options: asked.append((*arguments, options.get("options") or {})) or []
    try:
        lightning_hybrid_main(shlex.split(command)[1:] + ["--json"])
    finally:
        search.plan = original
    return asked[0]


@functools.cache
def ranked(command: str) -> list[Estimate]:
    model, cluster, batch, precision, options = plan_inputs(command)
    return search.plan(model, cluster, batch, precision, options=options)


def figures_now(command: str, layout_text: str, with_rank: bool) -> tuple[Estimate, Optional[tuple[int, int]]]:
    model, cluster, batch, precision, options = plan_inputs(command)
    layout = parse_layout(layout_text, cluster.gpus)
    result = estimate(model, cluster, replace(layout, **options), batch, precision)
    if not with_rank:
        return result, None
    plan = ranked(command)
    return result, (search.rank_of(result, plan), sum(e.feasible for e in plan))


def describe(layout: str, result: Estimate, rank: Optional[tuple[int, int]]) -> str:
    where = "out of memory" if not result.feasible else f"#{rank[0]} of {rank[1]:,} fit" if rank else "fits"
    return (f"{layout}  {where}  {result.memory.total / GIB:.2f} GiB  {result.tokens_per_second:,.0f} tokens/s"
            f"  MFU {result.mfu:.1%}")


def test_the_guide_states_figures_for_every_worked_example() -> None:
    commands = {command for command, _ in guide_figures()}
    assert len(guide_figures()) >= 20 and len(commands) >= 5, commands


@pytest.mark.parametrize("command, line", guide_figures(), ids=lambda value: value[-60:])
def test_guide_figures_are_the_planners(command: str, line: str, capsys: pytest.CaptureFixture[str]) -> None:
    stated = FIGURES.fullmatch(line)
    assert stated is not None, f"docs/tuning.md: {line!r} does not read as {FIGURES.pattern}"
    result, rank = figures_now(command, stated["layout"], stated["rank"] is not None)
    capsys.readouterr()
    hint = f"docs/tuning.md says\n{line}\nthe planner now gives\n{describe(stated['layout'], result, rank)}"
    assert result.feasible == (stated["oom"] is None), hint
    if stated["oom"]:
        assert any(reason.startswith("out of memory") for reason in result.reasons), hint
    if rank is not None:
        assert rank == (int(stated["rank"]), int(stated["feasible"].replace(",", ""))), hint
    assert f"{result.memory.total / GIB:.2f}" == stated["memory"], hint
    assert f"{result.tokens_per_second:,.0f}" == stated["tokens"], hint
    assert f"{result.mfu * 100:.1f}" == stated["mfu"], hint


@pytest.mark.parametrize("path", cluster_configs(), ids=lambda path: path.name)
def test_the_guide_quotes_each_cluster_configs_predicted_line(path: Path) -> None:
    """The rank and feasible count of each config's layout, which test_cluster_configs.py holds to the planner."""
    assert f"# predicted: {read_header(path).predicted.text}" in GUIDE.read_text(), path.name
