"""Rank processes forked from an interpreter that has already imported torch, Lightning and transformers.

A test that trains on several ranks starts one process per rank. Started as a fresh ``python script.py``, each one
spends ~6 s of CPU importing torch, Lightning and transformers before it does anything; on a 2-core machine an
8-rank run waited ~25 s for its imports alone, and the suite's hundreds of rank starts for many minutes. Here the
standard library's *forkserver* imports those modules once per test session (:data:`PRELOAD`) and forks every
rank from that state, as Linux DataLoader workers are forked after ``import torch``.

A forked rank is made to look like the fresh interpreter it replaces: its own session (``os.killpg(pid)`` ends
what it started), the rank's environment, working directory and argument list, stdin from ``/dev/null``,
stdout and stderr into its log file (or stderr into a second one), ``sys.path[0]`` the script's folder (the
working directory for ``python -m module``), one intra-op thread count as
``OMP_NUM_THREADS`` says, and the script run as ``__main__`` (``runpy``). It ends as multiprocessing children do
(``os._exit``, no ``atexit`` handlers): the scripts save their results first and end with ``os._exit``
themselves. ``LIGHTNING_HYBRID_TEST_FRESH_PROCESSES=1`` starts fresh interpreters instead
(``tests/test_prewarmed.py`` checks both give the same numbers).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import random
import runpy
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

#: What the forkserver imports before it forks any rank: what the test scripts import, and the Hugging Face model
#: families the tests build (transformers imports a family's code on first use).
PRELOAD = [
    "torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.pipelining",
    "torch.distributed.tensor.parallel", "lightning.pytorch", "transformers",
    "transformers.models.gpt2.modeling_gpt2", "transformers.models.llama.modeling_llama",
    "transformers.models.mixtral.modeling_mixtral", "transformers.models.phi3.modeling_phi3",
    "transformers.models.qwen2.modeling_qwen2", "lightning_hybrid.strategy", "tests.models",
]
FRESH_PROCESSES_VARIABLE = "LIGHTNING_HYBRID_TEST_FRESH_PROCESSES"


def forkserver() -> multiprocessing.context.BaseContext:
    """The multiprocessing context whose processes fork from the preloaded server (started on first use)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


class PrewarmedProcess:
    """A script run forked from the forkserver, with the parts of ``subprocess.Popen`` the helpers use."""

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, log: Path,
                 error_log: Path | None = None) -> None:
        self.args = command
        logs = (str(log), str(error_log or log))
        self._process = forkserver().Process(target=_run_script, args=(command[1:], env, str(cwd), *logs))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode


def start_script(command: list[str], env: dict[str, str], cwd: Path, log: Path,
                 error_log: Path | None = None) -> PrewarmedProcess | subprocess.Popen:
    """Start ``command`` (``[python, script, *args]`` or ``[python, "-m", module, *args]``) with ``env`` in ``cwd``,
    output into ``log`` (stderr into ``error_log`` if given), leading its own session: forked from the preloaded
    server, or fresh with :data:`FRESH_PROCESSES_VARIABLE` set."""
    if os.environ.get(FRESH_PROCESSES_VARIABLE) == "1":
        with open(log, "w") as stream, open(error_log or os.devnull, "w") as errors:
            return subprocess.Popen(command, cwd=cwd, env=env, stdout=stream,
                                    stderr=errors if error_log else subprocess.STDOUT, start_new_session=True)
    return PrewarmedProcess(command, env, cwd, log, error_log)


def _run_script(argv: Sequence[str], env: dict[str, str], cwd: str, log: str, error_log: str) -> None:
    """In the forked child: become ``python argv...`` started with ``env`` in ``cwd``, then run it."""
    os.setsid()
    output = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    # One file for both streams shares one offset, as ``2>&1`` does: two opens of it would overwrite each other.
    errors = output if error_log == log else os.open(error_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(output, 1)
    os.dup2(errors, 2)
    for fd in {output, errors}:
        os.close(fd)
    faulthandler.enable()  # a rank that crashes in C (a segfault, an abort) leaves its Python stack in its log
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    random.seed()  # a fresh interpreter seeds from the OS; every fork would share the server's state
    import torch

    if "OMP_NUM_THREADS" in env:  # read by the server at its own start: apply the rank's value
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    if argv[0] == "-m":  # as ``python -m``: the working directory first on sys.path, argv[0] the module's file
        sys.argv = list(argv[1:])
        sys.path.insert(0, cwd)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    script = os.path.abspath(argv[0])
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(script))
    runpy.run_path(script, run_name="__main__")
