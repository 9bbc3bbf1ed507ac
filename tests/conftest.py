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

ReferenceFn = Callable[[str, int], dict[str, Any]]


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker too; registering it here keeps `--strict-markers` happy when the tests
    # run without the project's configuration (e.g. `pytest tests/` from a bare checkout).
    config.addinivalue_line("markers", "slow: multi-process runs that take tens of seconds each")


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> ReferenceFn:
    """``reference_run(model, dp_size)``: the cached result of ``equivalence.py --reference``."""
    cache: dict[tuple[str, int], dict[str, Any]] = {}
    directory = tmp_path_factory.mktemp("reference")

    def get(model: str, dp_size: int) -> dict[str, Any]:
        key = (model, dp_size)
        if key not in cache:
            out = directory / f"{model}_dp{dp_size}.pt"
            cache[key] = run_script(["--model", model, "--reference", "--dp", dp_size, "--devices", 1, "--out", out])
        return cache[key]

    return get
