"""Shared fixtures for the test suite.

The reference runs (plain single-process Lightning) are the expensive shared input of every equivalence test,
so they are computed once per pytest session and cached per ``(model, data-parallel size)``: the data order,
and therefore the reference numbers, depend only on those two (see ``tests/equivalence.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.helpers import SHORT_RUN, cached_runs, run_script, run_sweep

ReferenceFn = Callable[..., dict[str, Any]]


def pytest_configure(config: pytest.Config) -> None:
    # pyproject.toml registers the marker too; registering it here keeps `--strict-markers` happy when the tests
    # run without the project's configuration (e.g. `pytest tests/` from a bare checkout).
    config.addinivalue_line("markers", "slow: multi-process runs that take tens of seconds each")


@pytest.fixture()
def one_process_fit() -> Iterator[None]:
    """For a test that fits with ``devices=1`` in the pytest process: afterwards the fit's one-rank process group
    is destroyed (later in-process tests make their own) and the launch variables Lightning left behind
    (``LOCAL_RANK``, ``MASTER_PORT``, ...) are removed: a later multi-process launch would inherit ``LOCAL_RANK`` and
    take itself for an already launched rank (hang)."""
    environment = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environment)


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory) -> ReferenceFn:
    """``reference_run(model, dp_size, layers=None, init="eager", short=False)``: the cached result of
    ``equivalence.py --reference`` (``layers`` overrides the model's number of blocks; ``init`` is ``--init``,
    ``"per_module"`` being the single-device counterpart of a meta-device model; ``short``: the harness's short run,
    ``SHORT_RUN``)."""
    cache: dict[tuple[str, int, int | None, str, bool], dict[str, Any]] = {}
    directory = tmp_path_factory.mktemp("reference")

    def get(model: str, dp_size: int, layers: int | None = None, init: str = "eager",
            short: bool = False) -> dict[str, Any]:
        key = (model, dp_size, layers, init, short)
        if key not in cache:
            out = directory / f"{model}_dp{dp_size}_layers{layers}_{init}{'_short' if short else ''}.pt"
            extra = ["--init", init] + ([] if layers is None else ["--layers", layers]) + (SHORT_RUN if short else [])
            cache[key] = run_script(
                ["--model", model, "--reference", "--dp", dp_size, "--devices", 1, *extra, "--out", out]
            )
        return cache[key]

    return get


#: Layouts × strategy options of :func:`meta_init_runs`: a meta-device GPT (4 blocks) materialized by the strategy,
#: with activation checkpointing modes and CPU offload, under tensor × data and tensor × pipeline parallelism (and,
#: with the first dp2 × tp2 entry, ``loss_parallel``; with the last tp2 × pp2 entry, built under
#: ``trainer.init_module(empty_init=True)``).
META_INIT_LAYOUTS: dict[str, tuple[list[str | int], list[dict[str, Any]]]] = {
    "dp2_tp2": (
        ["--dp", 2, "--tp", 2, "--devices", 4],
        # loss_parallel rides on the first entry: dp2 x tp2 equivalence of the sharded-logits loss, no extra fit.
        [{"activation_checkpointing": "every", "loss_parallel": True},
         {"offload": True, "activation_checkpointing": "selective"}],
    ),
    "tp2_pp2": (
        ["--tp", 2, "--pp", 2, "--devices", 4],
        [
            {"pp_schedule": "interleaved_1f1b", "microbatches": 4, "activation_checkpointing": 2},
            {"pp_schedule": "interleaved_zero_bubble", "offload": True, "activation_checkpointing": "every"},
            # Built in the module's __init__ under trainer.init_module(empty_init=True) instead of configure_model.
            {"module": {"init": "init_module"}},
        ],
    ),
}
META_INIT_LAYERS = 4


@pytest.fixture(scope="session")
def meta_init_runs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[dict[str, Any]]]:
    """``meta_init_runs(layout)``: one result per entry of ``META_INIT_LAYOUTS[layout]``, all trained in one launch
    (shared by the initialization, activation-checkpointing and offload tests). The short run (``SHORT_RUN``, its
    references ``reference_run(..., short=True)``): the tp2 × pp2 launch's interleaved pipeline is bound by its
    steps."""
    def run(layout: str, folder: Path) -> list[dict[str, Any]]:
        args, entries = META_INIT_LAYOUTS[layout]
        return run_sweep(
            ["--model", "gpt", "--init", "meta", "--layers", META_INIT_LAYERS, *args, *SHORT_RUN,
             "--out", folder / "run.pt"],
            entries,
        )

    return cached_runs(run, tmp_path_factory, "meta")


#: Layouts of :func:`uninterrupted` runs and of the runs resuming from their checkpoints (``tests/checkpoint/test_checkpoint.py``).
CHECKPOINTED_LAYOUTS: dict[str, list[str | int]] = {
    "dp2_tp2_pp2": ["--dp", 2, "--tp", 2, "--pp", 2, "--devices", 8],
    "tp2_pp2": ["--tp", 2, "--pp", 2, "--devices", 4],
    "dp2_tp2": ["--dp", 2, "--tp", 2, "--devices", 4],
    "dp4": ["--dp", 4, "--devices", 4],
    "pp4": ["--pp", 4, "--devices", 4],
}
CHECKPOINTED_LAYERS = 4


@pytest.fixture(scope="session")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[dict[str, Any], Path]]:
    """``uninterrupted(layout)``: (result, checkpoint folder) of a 6-step GPT run (4 blocks) that saved a sharded
    checkpoint at the end of epoch 0 (step 4). Shared: the 8-rank run is also the pipeline tests' 3D GPT run and,
    logging to TensorBoard (``result["tensorboard"]``), the monitoring tests' run."""

    def run(layout: str, folder: Path) -> tuple[dict[str, Any], Path]:
        logged = ["--tensorboard", folder / "tb"] if layout == "dp2_tp2_pp2" else []
        result = run_script(["--model", "gpt", "--layers", CHECKPOINTED_LAYERS, *CHECKPOINTED_LAYOUTS[layout],
                             *logged, "--checkpoint-dir", folder / "checkpoints", "--out", folder / "run.pt"])
        result["tensorboard"] = folder / "tb"
        return result, folder / "checkpoints" / "epoch=0-step=4.ckpt"

    return cached_runs(run, tmp_path_factory, "uninterrupted")
