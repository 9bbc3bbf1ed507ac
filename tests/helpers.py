"""Helpers for the equivalence tests: run ``tests/equivalence.py`` in a subprocess and compare two results."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.equivalence import sweep_out
from tests.prewarmed import PrewarmedProcess, forkserver, start_script

T = TypeVar("T")
#: Whose environment the ranks a test starts get: torchrun's variables or srun's (see :func:`rank_environment`).
Launcher = Literal["torchrun", "srun"]
#: A started rank or launcher agent: forked from the preloaded server, or a fresh process.
RankProcess = PrewarmedProcess | subprocess.Popen

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPT = REPO_ROOT / "tests" / "equivalence.py"

#: Seconds allowed for one script run. A 4-process fit of the tiny models took 20-70 s on 2 CPU cores when every
#: rank was a fresh interpreter importing torch and Lightning; the margin covers slow CI machines.
DEFAULT_TIMEOUT_S = 300.0
_TAIL_CHARS = 6000
#: A traceback's last line: ``SomeError: message``.
_ERROR_LINE = re.compile(r"^[A-Za-z_.]*(Error|Exception|Interrupt)\b")
#: Arguments of ``equivalence.py`` for a shorter run that keeps what the default 6 steps over 64 samples check:
#: 4 optimizer steps over 48 samples are epoch 0 (3 steps: the warm-up's learning rates and the first constant one),
#: its validation, and a step of epoch 1 (the sampler reshuffled by ``set_epoch``): 8 micro-batches instead of 12.
#: Multi-rank runs of these tiny models are bound by their steps (a 4-rank tp2 × pp2 micro-batch takes about a
#: second of the 2 cores), so a sweep takes about a third less. Not fewer: after 3 steps GPT-2's attention output
#: bias had moved too little from zero to stand above rounding (1.3e-5 relative under tp2, the worst of the zoo's
#: layouts 3e-6 after 4 or 6 steps). Both sides of a comparison must use it.
SHORT_STEPS = 4
SHORT_RUN: list[str | int] = ["--steps", SHORT_STEPS, "--num-samples", 48]


class ScriptError(RuntimeError):
    """The equivalence script failed or timed out; the message carries the tail of its output."""


def run_script(
    args: Sequence[str | int | os.PathLike[str]], nprocs_timeout: float = DEFAULT_TIMEOUT_S,
    launcher: Launcher = "torchrun",
) -> dict[str, Any]:
    """Run ``tests/equivalence.py`` with ``args`` (must include ``--out PATH``) and load its result.

    The ranks (``--devices``) start together as separate processes with the environment ``torchrun`` or SLURM
    would give them (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``), which Lightning detects and then
    does not launch processes itself; they fork from the preloaded server of :mod:`tests.prewarmed` instead of
    each importing torch and Lightning (~6 s of CPU per process here). (The recipe test covers Lightning's own
    launcher.)
    ``--devices × --num-nodes`` ranks start; ``launcher="srun"`` gives them the variables srun sets instead
    (see :func:`rank_environment`).
    ``OMP_NUM_THREADS=1`` because several ranks share few cores and oversubscription makes gloo runs crawl.
    Returns the saved dict with ``run_s`` (wall time until every rank exited) added.
    """
    args = [str(a) for a in args]
    out, run_s = _launch(args, nprocs_timeout, launcher=launcher)
    result: dict[str, Any] = torch.load(out, map_location="cpu", weights_only=False)
    result["run_s"] = run_s
    return result


def run_rank_script(script: Path, args: Sequence[str | int | os.PathLike[str]],
                    nprocs_timeout: float = DEFAULT_TIMEOUT_S) -> Any:
    """Like :func:`run_script` for another script that takes ``--devices N`` and ``--out PATH``: its ranks start
    together the same way; returns what it saved to ``--out``."""
    out, _ = _launch([str(a) for a in args], nprocs_timeout, script=script)
    return torch.load(out, map_location="cpu", weights_only=False)


def run_sweep(
    args: Sequence[str | int | os.PathLike[str]], entries: Sequence[dict[str, Any]],
    nprocs_timeout: float = DEFAULT_TIMEOUT_S,
) -> list[dict[str, Any]]:
    """Like :func:`run_script`, training once per ``HybridStrategy`` keyword dict in ``entries`` in the same
    processes (``equivalence.py --sweep``); returns one result per entry."""
    args = [str(a) for a in args] + ["--sweep", json.dumps(list(entries))]
    out, run_s = _launch(args, nprocs_timeout, outputs=len(entries))
    results = []
    for index in range(len(entries)):
        result = torch.load(sweep_out(out, index), map_location="cpu", weights_only=False)
        result["run_s"] = run_s / len(entries)
        results.append(result)
    return results


def _launch(args: list[str], nprocs_timeout: float, outputs: int = 0, script: Path = SCRIPT,
            launcher: Launcher = "torchrun") -> tuple[Path, float]:
    """Start every rank of ``script args`` (default ``equivalence.py``), wait for all; returns ``(--out path,
    seconds)``."""
    if "--out" not in args:
        raise ValueError("run_script needs --out PATH among the arguments")
    out = Path(args[args.index("--out") + 1])
    expected = [sweep_out(out, index) for index in range(outputs)] if outputs else [out]
    return out, launch_and_wait(args, expected, nprocs_timeout, script, launcher)


def launch_and_wait(args: list[str], expected: Sequence[Path], timeout_s: float, script: Path = SCRIPT,
                    launcher: Launcher = "torchrun") -> float:
    """Start every rank of ``script args`` (:func:`start_ranks`: ``args`` holds ``--out PATH``, beside which the
    rank logs go), wait for all, and return the wall seconds until every rank exited. Raises :class:`ScriptError`
    with the logs' tails if a rank timed out or failed or a path of ``expected`` was not written (each is removed
    first: a stale result from an earlier run is never read)."""
    out = Path(args[args.index("--out") + 1])
    for path in expected:
        path.unlink(missing_ok=True)
    start = time.perf_counter()
    procs, logs = start_ranks(args, out, script, launcher)
    command = " ".join(procs[0].args)
    if not wait_or_kill(procs, timeout_s):
        raise ScriptError(f"timed out after {timeout_s:.0f}s: {command}\n{_tails(logs)}")
    run_s = time.perf_counter() - start
    failed = [rank for rank, proc in enumerate(procs) if proc.returncode != 0]
    if failed or not all(path.exists() for path in expected):
        raise ScriptError(f"ranks {failed} failed after {run_s:.1f}s ({_exits(procs, logs, failed)}): {command}\n"
                          f"{_tails(logs)}")
    return run_s


def wait_or_kill(procs: Sequence[RankProcess], timeout_s: float) -> bool:
    """Wait for every process; past ``timeout_s`` kill each one's process group (each must lead one:
    ``start_new_session=True``) and every process below it, so no rank or torchrun worker outlives the test.
    ``False`` if it timed out."""
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        return True
    except subprocess.TimeoutExpired:
        # Found before any is killed: a killed agent's workers are re-parented and no longer below it.
        below = [pid for proc in procs for pid in _descendants(proc.pid)]
        for pid in [proc.pid for proc in procs] + below:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # what it started in its group (a worker leads its own)
        for proc in procs:
            proc.wait()
        return False


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``. torchrun starts each worker in a session of its own, so killing the
    agent's process group leaves the workers running; they are found by their parent ids in ``/proc``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            # "pid (command) state ppid ...": the command may hold spaces and parentheses, so split after it.
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, pending = [], [pid]
    while pending:
        below = children.get(pending.pop(), [])
        found += below
        pending += below
    return found


def rank_environment(rank: int, devices: int, num_nodes: int, port: int, launcher: Launcher) -> dict[str, str]:
    """The variables a launcher gives global rank ``rank`` of ``num_nodes`` nodes × ``devices`` processes, ranks
    numbered node by node. ``"torchrun"``: what Lightning's default environment reads (``NODE_RANK`` included).
    ``"srun"``: what ``srun --nodes N --ntasks-per-node D`` sets and ``SLURMEnvironment`` reads (it takes the main
    address from the node list); ``MASTER_PORT`` too, which it would otherwise derive from the job id."""
    node_rank, local_rank = divmod(rank, devices)
    if launcher == "srun":
        return {"SLURM_NTASKS": str(devices * num_nodes), "SLURM_NTASKS_PER_NODE": str(devices),
                "SLURM_NNODES": str(num_nodes), "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank),
                "SLURM_NODEID": str(node_rank), "SLURM_JOB_NAME": "equivalence", "SLURM_NODELIST": "127.0.0.1",
                "MASTER_PORT": str(port)}
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(devices * num_nodes),
            "NODE_RANK": str(node_rank), "RANK": str(rank), "LOCAL_RANK": str(local_rank)}


def start_ranks(args: list[str], out: Path, script: Path = SCRIPT,
                launcher: Launcher = "torchrun") -> tuple[list[RankProcess], list[Path]]:
    """Start every rank (``--devices`` × ``--num-nodes``) of ``script args`` (default ``equivalence.py``) without
    waiting, with :func:`rank_environment`'s variables, forked from the preloaded server (:mod:`tests.prewarmed`);
    rank ``r`` writes its output to ``<out stem>.rank<r>.log`` beside ``out`` and leads its own process group
    (``os.killpg`` ends it with anything it started)."""
    devices = int(args[args.index("--devices") + 1]) if "--devices" in args else 1
    num_nodes = int(args[args.index("--num-nodes") + 1]) if "--num-nodes" in args else 1
    world_size, port = devices * num_nodes, free_port()
    command = [sys.executable, str(script), *args]
    out.parent.mkdir(parents=True, exist_ok=True)
    logs = [out.with_name(f"{out.stem}.rank{rank}.log") for rank in range(world_size)]
    procs = []
    for rank, log in enumerate(logs):
        rank_env = launch_env()
        if world_size > 1:
            rank_env.update(rank_environment(rank, devices, num_nodes, port, launcher))
        procs.append(start_script(command, rank_env, REPO_ROOT, log))
    return procs, logs


def run_package_command(args: Sequence[str | os.PathLike[str]],
                        timeout_s: float = 180.0) -> subprocess.CompletedProcess:
    """``python -m lightning_hybrid ARGS`` (the package's command line) in the repository root, forked from the
    preloaded server like the ranks are (a fresh interpreter spends ~6 s of CPU on its imports before it parses an
    argument); returns its exit status, stdout and stderr as ``subprocess.run(capture_output=True)`` does."""
    command = [sys.executable, "-m", "lightning_hybrid", *map(str, args)]
    with tempfile.TemporaryDirectory() as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        process = start_script(command, launch_env(), REPO_ROOT, out, err)
        if not wait_or_kill([process], timeout_s):
            tail = err.read_text()[-_TAIL_CHARS:]
            raise ScriptError(f"timed out after {timeout_s:.0f}s: {' '.join(command)}\n{tail}")
        return subprocess.CompletedProcess(command, process.returncode, out.read_text(), err.read_text())


def torchrun_command(args: Sequence[str | int | os.PathLike[str]], nnodes: int, node_rank: int, nproc_per_node: int,
                     rdzv_endpoint: str, max_restarts: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` over ``tests/equivalence.py args`` for node ``node_rank`` of ``nnodes``,
    meeting the other nodes' agents through a c10d rendezvous at ``rdzv_endpoint`` (as on a cluster)."""
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", "equivalence"]
    if nnodes > 1:
        # Every "node" is this host, so each agent would find the endpoint's address to be its own and try to host
        # the rendezvous store; on a cluster only the endpoint's node does. Say so, as its hostname would there.
        rendezvous += ["--rdzv-conf", f"is_host={int(node_rank == 0)}"]
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(nproc_per_node), "--max-restarts", str(max_restarts), *rendezvous, str(SCRIPT),
            *map(str, args)]


def run_torchrun(args: Sequence[str | int | os.PathLike[str]], max_restarts: int = 0, nnodes: int = 1,
                 nproc_per_node: int = 2, timeout_s: float = 600.0) -> tuple[list[subprocess.CompletedProcess], float]:
    """One torchrun agent per node (``nnodes`` of them on this host, as ``nnodes`` machines would run them) over
    ``tests/equivalence.py args``; returns each agent's finished process (stdout and stderr together, as
    ``stdout``) and the wall seconds until all exited. Past ``timeout_s`` every agent's process group (the agent
    and its workers) is killed and :class:`ScriptError` raised."""
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [torchrun_command(args, nnodes, node, nproc_per_node, endpoint, max_restarts) for node in range(nnodes)]
    # LOGLEVEL=INFO: torchrun then says when it restarts the worker group. Files, not pipes: an agent blocked on a
    # full pipe nobody reads would stall the whole job.
    env = {**launch_env(), "LOGLEVEL": "INFO"}
    outputs = [tempfile.TemporaryFile("w+") for _ in commands]
    start = time.perf_counter()
    agents = [subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=output, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True) for command, output in zip(commands, outputs)]
    finished = wait_or_kill(agents, timeout_s)
    seconds = time.perf_counter() - start
    done = []
    for command, agent, output in zip(commands, agents, outputs):
        output.seek(0)
        done.append(subprocess.CompletedProcess(command, agent.returncode, stdout=output.read(), stderr=""))
        output.close()
    if not finished:
        tails = "\n".join(f"--- node {node} (tail) ---\n{d.stdout[-_TAIL_CHARS:]}" for node, d in enumerate(done))
        raise ScriptError(f"timed out after {timeout_s:.0f}s: {' '.join(commands[0])}\n{tails}")
    return done, seconds


def launch_env() -> dict[str, str]:
    """The environment for ranks started by a test: this checkout importable, one OpenMP thread each (several ranks
    share few cores and oversubscription makes gloo runs crawl), and no rank variables of an outer launcher (nor
    SLURM's: inside a SLURM job Lightning would take the job's ranks for the test's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env["OMP_NUM_THREADS"] = "1"
    for var in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "PL_GLOBAL_SEED",
                "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        env.pop(var, None)
    for var in [name for name in env if name.startswith("SLURM_")]:
        env.pop(var)
    return env


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def param_extended_if(extended: bool, *values: Any) -> Any:
    """``values`` as one pytest parameter, marked ``extended`` (left out of the default run; ``-m extended``) if
    ``extended``."""
    return pytest.param(*values, marks=[pytest.mark.extended] if extended else [])


def _exits(procs: Sequence[Any], logs: list[Path], failed: list[int]) -> str:
    """Each failed rank's exit status (a signal by name) and the last error line of its log, first in the message:
    a long report may be cut before the tails that would say why a rank ended."""
    parts = []
    for rank in failed:
        code = procs[rank].returncode
        status = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"exit code {code}"
        text = logs[rank].read_text(errors="replace") if logs[rank].exists() else ""
        errors = [line for line in text.splitlines()
                  if _ERROR_LINE.match(line) or line.startswith(("Fatal Python error", "[lightning-hybrid watchdog]"))]
        parts.append(f"rank {rank}: {status}" + (f", {errors[-1][:300]}" if errors else ", no error line"))
    return "; ".join(parts)


def _tails(logs: list[Path]) -> str:
    """The end of rank 0's output and of every other rank's that mentions an error."""
    parts = []
    for rank, log in enumerate(logs):
        text = log.read_text(errors="replace") if log.exists() else ""
        if rank == 0 or "Error" in text:
            parts.append(f"--- rank {rank} (tail) ---\n{text[-_TAIL_CHARS:]}")
    return "\n".join(parts)


def relative_difference(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max|a - b| / max(max|a|, floor)`` in float64: one scale per tensor, so near-zero entries do not blow it
    up. Complex tensors (rotary tables) compare as their real and imaginary parts."""
    a, b = (torch.view_as_real(t) if t.is_complex() else t for t in (a, b))
    a64, b64 = a.detach().double(), b.detach().double()
    if a64.numel() == 0:
        return 0.0
    scale = max(a64.abs().max().item(), floor)
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
    # A parameter whose exact gradient is zero (an attention key's bias: softmax ignores what it adds to all of a
    # query's scores) keeps its zero initialization up to rounding noise that Adam amplifies (to 1e-10 after six
    # steps), different noise for every batch split. No tensor that really trains stays that small: Adam moves
    # each entry by about the learning rate per step, whatever the gradient's size above ``adam_eps``. So a
    # tensor is measured at least against the smallest learning rate of the run.
    floor = min(ref.get("learning_rates") or [0.0])
    param_diffs = {
        name: relative_difference(params_ref[name], params_par[name], floor)
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

    Compared: every logged micro-batch ``train_loss``, every ``val_loss``, the ``test_loss``, the summed ``tokens``
    metric, the number of optimizer steps, the hooks fired around backward and the optimizer step with the learning
    rate at each step, the prediction shapes, every parameter of the full state dict (same names, shapes,
    dtypes, and ``relative_difference <= rtol``), and that ranks holding the same parameter agree exactly.
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
    # Ranks that hold the same parameter (tensor-parallel copies of a norm, data-parallel replicas, gathered
    # shards) apply identical reduced gradients, so they must agree bit for bit.
    if par.get("replica_max_abs_diff", 0.0) != 0.0:
        problems.append(f"ranks holding the same parameter differ by up to {par['replica_max_abs_diff']:.3e}")
    if not all(math.isfinite(x) for x in par["losses"]):
        problems.append(f"non-finite losses: {par['losses']}")
    if not report["loss_max_rel"] <= rtol:
        pairs = ", ".join(f"{a:.7f}/{b:.7f}" for a, b in zip(ref["losses"], par["losses"]))
        problems.append(f"train losses differ by {report['loss_max_rel']:.3e} (ref/par: {pairs})")
    # What callbacks receive as ``outputs`` is rank 0's own loss: the global one only without data parallelism.
    single_replica = par.get("args", {}).get("dp_size", 1) == 1
    outputs_ref, outputs_par = ref.get("step_outputs", []), par.get("step_outputs", [])
    outputs_differ = len(outputs_ref) != len(outputs_par) or any(
        not abs(a - b) <= rtol * abs(a) for a, b in zip(outputs_ref, outputs_par)
    )
    if single_replica and outputs_differ:
        problems.append(f"training_step outputs seen by callbacks differ: {outputs_ref} vs {outputs_par}")
    # A metric's on_step value is the rank's own batch in Lightning (torchmetrics syncs at compute()): with data
    # parallelism only the epoch values are the global ones.
    metric_keys = ref.get("metric_values", {}).keys() | par.get("metric_values", {}).keys()
    if not single_replica:
        metric_keys = {key for key in metric_keys if key.endswith("_epoch") or key.startswith("validation:val_")}
    for key in metric_keys:
        want, got = ref.get("metric_values", {}).get(key, []), par.get("metric_values", {}).get(key, [])
        if len(want) != len(got) or any(not abs(a - b) <= rtol * max(abs(a), 1e-12) for a, b in zip(want, got)):
            problems.append(f"logged metric {key} differs: {want} vs {got}")
    if ref.get("tokens") != par.get("tokens"):
        problems.append(f"summed metric 'tokens' differs: {ref.get('tokens')} vs {par.get('tokens')}")
    if "test_loss" in ref and not abs(ref["test_loss"] - par["test_loss"]) <= rtol * abs(ref["test_loss"]):
        problems.append(f"test losses differ: {ref['test_loss']} vs {par['test_loss']}")
    for key in ("hook_calls", "grads_after_backward", "learning_rates"):
        if key in ref and key in par and ref[key] != par[key]:
            problems.append(f"{key} differ: {ref[key]} vs {par[key]}")
    if not report["val_loss_max_rel"] <= rtol:
        problems.append(f"val losses differ: {ref['val_losses']} vs {par['val_losses']}")
    bad = {n: d for n, d in report["param_diffs"].items() if not d <= rtol}  # `not <=` also catches NaN
    if bad:
        listed = ", ".join(f"{n}={d:.2e}" for n, d in sorted(bad.items(), key=lambda item: -item[1]))
        problems.append(f"{len(bad)} parameters differ by more than rtol={rtol:g}: {listed}")
    if problems:
        raise AssertionError("parallel run is not equivalent to the reference:\n  " + "\n  ".join(problems))
    return report


def cached_runs(make: Callable[[str, Path], T], folders: Any, prefix: str) -> Callable[[str], T]:
    """``get(key)`` = ``make(key, fresh folder)``, computed once per key: module- or session-scoped fixtures
    share one launch between tests. ``folders`` is pytest's ``tmp_path_factory``."""
    cache: dict[str, T] = {}

    def get(key: str) -> T:
        if key not in cache:
            cache[key] = make(key, folders.mktemp(f"{prefix}_{key}"))
        return cache[key]

    return get


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag of a TensorBoard folder: ``{tag: [(step, value), ...]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def on_two_ranks(worker: Callable[..., None], *args: Any) -> dict[str, Any]:
    """Run ``worker(rank, results, *args)`` in two processes (forked from the preloaded server of
    :mod:`tests.prewarmed`) joined by a gloo process group, and return
    what they put into the shared dict ``results``. ``worker`` must be a module-level function (it is pickled)."""
    return on_ranks(2, worker, *args)


def on_ranks(world_size: int, worker: Callable[..., None], *args: Any) -> dict[str, Any]:
    """:func:`on_two_ranks` on ``world_size`` processes."""
    forkserver()  # the ranks fork from the preloaded server instead of each importing torch afresh
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank_process, args=(world_size, free_port(), worker, args, results), nprocs=world_size,
                           start_method="forkserver")
        return dict(results)


def _rank_process(rank: int, world_size: int, port: int, worker: Callable[..., None], args: tuple,
                  results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        worker(rank, results, *args)
    finally:
        dist.barrier()  # leave together: gloo aborts a process whose peer tears down mid-conversation
        dist.destroy_process_group()
    # The work is done and reported: skip the interpreter's teardown, in which gloo's threads occasionally abort
    # the process ("terminate called without an active exception"), which would fail a test that passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
