"""What the benchmark scripts share: ranks launched, per-rank results collected, rounds alternated, medians and
least-squares lines, aligned Markdown tables.

Ranks start with the test suite's launcher (:func:`tests.helpers.launch_and_wait`): forked from the preloaded
server of :mod:`tests.prewarmed` (torch, Lightning and transformers imported once, not once per rank), each with
the environment ``torchrun`` gives a rank (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, which
Lightning detects and then launches nothing itself; a hand-written loop's ``init_process_group("gloo")`` reads the
same), ``OMP_NUM_THREADS=1``, its output in a log whose tail is raised with the error when a rank fails. A
one-rank launch gets no rank variables: plain Lightning on one process.

Usage, in a benchmark script that is its own worker::

    from benchmarks.harness import launch_ranks, markdown_table, save_rank_result

    def main() -> None:
        ...
        if args.worker:                  # in each rank: measure, then write this rank's result
            save_rank_result(args.out, measure(args.worker, devices=args.devices))
            return
        launched = launch_ranks(Path(__file__), ["--worker", "tp2"], world=2)   # adds --devices 2 --out PATH
        rows = [[rank, f"{result['step_s']:.3f}"] for rank, result in enumerate(launched.ranks)]
        print(markdown_table(["rank", "step s"], rows))

The importing script's parent process stays light: this module imports the launcher (and torch) only when it
launches.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Seconds one launch may take before its ranks are killed (a 4-rank fit on 2 shared cores takes a minute or two).
DEFAULT_TIMEOUT_S = 600.0
T = TypeVar("T")


# ================================================================================================ launching
@dataclass
class Launch:
    """One launch of a script's ranks: what each rank saved (index = global rank) and the wall seconds until the
    last rank exited."""

    ranks: list[Any]
    wall_s: float


def rank_result_path(out: Path, rank: int) -> Path:
    """Where rank ``rank`` saves its result for a launch given ``--out out``: ``<stem>.rank<r><suffix>`` beside
    it (the launcher's logs are ``<stem>.rank<r>.log``)."""
    return out.with_name(f"{out.stem}.rank{rank}{out.suffix}")


def save_rank_result(out: Path, result: Any, rank: int | None = None) -> None:
    """In a rank: write ``result`` where :func:`launch_ranks` reads it — JSON if ``out`` ends in ``.json``, else
    ``torch.save`` (tensors, dataclasses). ``rank`` defaults to the launcher's ``RANK`` (0 on a one-rank launch)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    path = rank_result_path(Path(out), rank)
    if path.suffix == ".json":
        path.write_text(json.dumps(result))
    else:
        import torch

        torch.save(result, path)


def _load(path: Path) -> Any:
    if path.suffix == ".json":
        return json.loads(path.read_text())
    import torch

    return torch.load(path, map_location="cpu", weights_only=False)


def launch_ranks(script: Path, args: Sequence[str | int | os.PathLike[str]], world: int,
                 timeout_s: float = DEFAULT_TIMEOUT_S, suffix: str = ".json") -> Launch:
    """Start ``world`` ranks of ``python script args --devices world --out PATH`` (the worker must accept both),
    wait for all of them, and return what each saved with :func:`save_rank_result` (``suffix`` ``.json`` or
    ``.pt``: how it is written). Raises ``tests.helpers.ScriptError`` with the ranks' log tails if one fails, times
    out or saves nothing."""
    return _launch(script, args, world, timeout_s, suffix, per_rank=True)


def launch_saved_once(script: Path, args: Sequence[str | int | os.PathLike[str]], world: int,
                      timeout_s: float = DEFAULT_TIMEOUT_S, suffix: str = ".pt") -> Any:
    """Like :func:`launch_ranks` for a script whose ranks save one result together to ``--out`` (rank 0 writes it:
    the test suite's rank scripts, ``torch.save``; ``suffix=".json"`` for JSON); returns it."""
    return _launch(script, args, world, timeout_s, suffix, per_rank=False).ranks[0]


def _launch(script: Path, args: Sequence[str | int | os.PathLike[str]], world: int, timeout_s: float, suffix: str,
            per_rank: bool) -> Launch:
    from tests.helpers import launch_and_wait

    with tempfile.TemporaryDirectory(prefix=f"{Path(script).stem}-") as folder:
        out = Path(folder) / f"result{suffix}"
        command = [*map(str, args), "--devices", str(world), "--out", str(out)]
        expected = [rank_result_path(out, rank) for rank in range(world)] if per_rank else [out]
        wall_s = launch_and_wait(command, expected, timeout_s, script=Path(script).resolve())
        return Launch([_load(path) for path in expected], wall_s)


# ================================================================================================ rounds
def alternating(items: Sequence[T], rounds: int) -> Iterator[tuple[int, T]]:
    """``(round, item)`` for every item in every round, the order reversed every other round: drift of a shared
    machine (other jobs, thermal state) then falls on every item alike instead of always on the last ones."""
    for round_index in range(rounds):
        for item in items if round_index % 2 == 0 else items[::-1]:
            yield round_index, item


def median_gap(times: Sequence[float], first: int, stop: int | None = None) -> float:
    """Median of ``times[i] - times[i - 1]`` for ``i`` in ``first .. stop - 1``: the median step of a list of step
    end times, the steps before ``first`` left out (warm-up)."""
    return statistics.median(times[i] - times[i - 1] for i in range(first, len(times) if stop is None else stop))


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ``ys`` over ``xs``."""
    mean_x, mean_y = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return slope, mean_y - slope * mean_x


# ================================================================================================ tables
def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table of ``rows`` (cells formatted with ``str``) under ``header``, every column padded to its
    widest cell so that it reads aligned in a terminal as well as rendered."""
    cells = [[str(cell) for cell in row] for row in rows]
    for row in cells:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under {len(header)} columns: {row}")
    widths = [max(3, len(title), *(len(row[column]) for row in cells)) for column, title in enumerate(header)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(value.ljust(width) for value, width in zip(values, widths)) + " |"

    return "\n".join([line(header), line(["-" * width for width in widths]), *(line(row) for row in cells)])


def revision() -> str:
    """The checkout's ``git describe --always --dirty`` (what a printed table was measured at)."""
    described = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                               text=True)
    return described.stdout.strip() or "unknown revision"
