"""Shared fixtures for the test suite.

The reference runs (plain single-process Lightning) are the expensive shared input of every equivalence test,
so they are computed once per pytest session and cached per ``(model, data-parallel size)``: the data order,
and therefore the reference numbers, depend only on those two (see ``tests/equivalence.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.helpers import run_script

ReferenceFn = Callable[..., dict[str, Any]]


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker too; registering it here keeps `--strict-markers` happy when the tests
    # run without the project's configuration (e.g. `pytest tests/` from a bare checkout).
    config.addinivalue_line("markers", "slow: multi-process runs that take tens of seconds each")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> ReferenceFn:
    """``reference_run(model, dp_size, layers=None)``: the cached result of ``equivalence.py --reference``
    (``layers`` overrides the model's number of blocks)."""
    cache: dict[tuple[str, int, int | None], dict[str, Any]] = {}
    directory = tmp_path_factory.mktemp("reference")

    def get(model: str, dp_size: int, layers: int | None = None) -> dict[str, Any]:
        key = (model, dp_size, layers)
        if key not in cache:
            out = directory / f"{model}_dp{dp_size}_layers{layers}.pt"
            extra = [] if layers is None else ["--layers", layers]
            cache[key] = run_script(
                ["--model", model, "--reference", "--dp", dp_size, "--devices", 1, *extra, "--out", out]
            )
        return cache[key]

    return get
