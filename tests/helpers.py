"""Helpers for the equivalence tests: run ``tests/equivalence.py`` in a subprocess and compare two results."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "tests" / "equivalence.py"

#: Seconds allowed for one script run. A 4-process fit of the tiny models took 20-70 s on 2 CPU cores (mostly
#: 4 interpreters importing torch and Lightning, and gloo ranks sharing cores); the margin covers slow CI machines.
DEFAULT_TIMEOUT_S = 300.0
_TAIL_CHARS = 6000


class ScriptError(RuntimeError):
    """The equivalence script failed or timed out; the message carries the tail of its output."""


def run_script(
    args: Sequence[str | int | os.PathLike[str]], nprocs_timeout: float = DEFAULT_TIMEOUT_S
) -> dict[str, Any]:
    """Run ``tests/equivalence.py`` with ``args`` (must include ``--out PATH``) and load its result.

    The script runs in a fresh interpreter because Lightning's launcher re-executes ``sys.argv`` to start the
    other ranks. ``OMP_NUM_THREADS=1`` because several ranks share few cores and oversubscription makes gloo
    runs crawl. Returns the saved dict with ``run_s`` (wall time of the whole subprocess) added.
    """
    args = [str(a) for a in args]
    if "--out" not in args:
        raise ValueError("run_script needs --out PATH among the arguments")
    out = Path(args[args.index("--out") + 1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    # Lightning picks a free port itself when MASTER_PORT is unset; an inherited one could collide with another
    # test's run. Likewise rank variables from an outer launcher would confuse the child's launcher.
    for var in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED"):
        env.pop(var, None)
    command = [sys.executable, str(SCRIPT), *args]
    out.unlink(missing_ok=True)  # never load a stale result from an earlier run
    start = time.perf_counter()
    # A new session makes the script the leader of a process group that also holds the ranks Lightning's launcher
    # starts, so a timeout can end all of them; killing only the direct child would orphan hung ranks.
    proc = subprocess.Popen(
        command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=nprocs_timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise ScriptError(
            f"timed out after {nprocs_timeout:.0f}s: {' '.join(command)}\n"
            f"--- stdout (tail) ---\n{stdout[-_TAIL_CHARS:]}\n--- stderr (tail) ---\n{stderr[-_TAIL_CHARS:]}"
        ) from None
    run_s = time.perf_counter() - start
    if proc.returncode != 0 or not out.exists():
        raise ScriptError(
            f"exit code {proc.returncode} after {run_s:.1f}s: {' '.join(command)}\n"
            f"--- stdout (tail) ---\n{stdout[-_TAIL_CHARS:]}\n--- stderr (tail) ---\n{stderr[-_TAIL_CHARS:]}"
        )
    result: dict[str, Any] = torch.load(out, map_location="cpu", weights_only=False)
    result["run_s"] = run_s
    return result


def relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max|a - b| / max|a|`` in float64: one scale per tensor, so near-zero entries do not blow it up."""
    a64, b64 = a.detach().double(), b.detach().double()
    if a64.numel() == 0:
        return 0.0
    scale = a64.abs().max().item()
    diff = (a64 - b64).abs().max().item()
    if scale == 0.0:
        return diff  # an all-zero reference tensor: fall back to the absolute difference
    return diff / scale


def compare_results(ref: dict[str, Any], par: dict[str, Any]) -> dict[str, Any]:
    """Differences between two script results (no assertion): losses, val losses and per-parameter values."""
    losses_ref, losses_par = ref["losses"], par["losses"]
    loss_diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses_ref, losses_par)]
    val_diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(ref["val_losses"], par["val_losses"])]
    params_ref, params_par = ref["params"], par["params"]
    param_diffs = {
        name: relative_difference(params_ref[name], params_par[name])
        for name in params_ref
        if name in params_par and params_ref[name].shape == params_par[name].shape
    }
    return {
        "num_losses": (len(losses_ref), len(losses_par)),
        "num_val_losses": (len(ref["val_losses"]), len(par["val_losses"])),
        "loss_max_rel": max(loss_diffs, default=0.0),
        "val_loss_max_rel": max(val_diffs, default=0.0),
        "param_diffs": param_diffs,
        "param_max_rel": max(param_diffs.values(), default=0.0),
        "missing": sorted(set(params_ref) - set(params_par)),
        "unexpected": sorted(set(params_par) - set(params_ref)),
        "shape_mismatch": sorted(
            name
            for name in params_ref
            if name in params_par and params_ref[name].shape != params_par[name].shape
        ),
    }


def assert_equivalent(ref: dict[str, Any], par: dict[str, Any], rtol: float = 1e-5) -> dict[str, Any]:
    """Assert ``par`` trained to the same numbers as ``ref``; print and return the measured differences.

    Compared: every logged micro-batch ``train_loss``, every ``val_loss``, the number of optimizer steps, and
    every parameter of the full state dict (same names, shapes, dtypes, and ``relative_difference <= rtol``).
    """
    report = compare_results(ref, par)
    worst = sorted(report["param_diffs"].items(), key=lambda item: item[1], reverse=True)[:3]
    print(
        f"[assert_equivalent] loss max rel {report['loss_max_rel']:.3e}, val_loss max rel "
        f"{report['val_loss_max_rel']:.3e}, param max rel {report['param_max_rel']:.3e} "
        f"(worst: {', '.join(f'{n}={d:.2e}' for n, d in worst)}); rtol={rtol:g}"
    )
    problems: list[str] = []
    if report["missing"] or report["unexpected"] or report["shape_mismatch"]:
        problems.append(
            f"state dict keys differ: missing={report['missing']} unexpected={report['unexpected']} "
            f"shape mismatch={report['shape_mismatch']}"
        )
    dtype_mismatch = [n for n in report["param_diffs"] if ref["params"][n].dtype != par["params"][n].dtype]
    if dtype_mismatch:
        problems.append(f"dtypes differ for {dtype_mismatch}")
    if ref.get("global_step") != par.get("global_step"):
        problems.append(f"optimizer steps differ: {ref.get('global_step')} vs {par.get('global_step')}")
    if len(set(report["num_losses"])) > 1 or len(set(report["num_val_losses"])) > 1:
        problems.append(f"loss counts differ: train {report['num_losses']}, val {report['num_val_losses']}")
    if not all(math.isfinite(x) for x in par["losses"]):
        problems.append(f"non-finite losses: {par['losses']}")
    if not report["loss_max_rel"] <= rtol:
        pairs = ", ".join(f"{a:.7f}/{b:.7f}" for a, b in zip(ref["losses"], par["losses"]))
        problems.append(f"train losses differ by {report['loss_max_rel']:.3e} (ref/par: {pairs})")
    if ref.get("tokens") != par.get("tokens"):
        problems.append(f"summed metric 'tokens' differs: {ref.get('tokens')} vs {par.get('tokens')}")
    if "test_loss" in ref and not abs(ref["test_loss"] - par["test_loss"]) <= rtol * abs(ref["test_loss"]):
        problems.append(f"test losses differ: {ref['test_loss']} vs {par['test_loss']}")
    if not report["val_loss_max_rel"] <= rtol:
        problems.append(f"val losses differ: {ref['val_losses']} vs {par['val_losses']}")
    bad = {n: d for n, d in report["param_diffs"].items() if not d <= rtol}  # `not <=` also catches NaN
    if bad:
        listed = ", ".join(f"{n}={d:.2e}" for n, d in sorted(bad.items(), key=lambda item: -item[1]))
        problems.append(f"{len(bad)} parameters differ by more than rtol={rtol:g}: {listed}")
    if problems:
        raise AssertionError("parallel run is not equivalent to the reference:\n  " + "\n  ".join(problems))
    return report
