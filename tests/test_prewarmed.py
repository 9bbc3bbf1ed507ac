"""Ranks forked from the preloaded server (``tests/prewarmed.py``) behave as the fresh interpreters they replace."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ScriptError, launch_and_wait, launch_env, run_script, wait_or_kill
from tests.prewarmed import FRESH_PROCESSES_VARIABLE, PrewarmedProcess

_PROBE = """
import json, os, sys, torch
print("to the log")
print("error to the log", file=sys.stderr)
json.dump({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "variable": os.environ.get("PROBE"),
           "leads_session": os.getsid(0) == os.getpid(), "threads": torch.get_num_threads(),
           "main": __name__, "stdin": sys.stdin.read()}, open(sys.argv[1], "w"))
sys.exit(int(sys.argv[2]))
"""


def _start_probe(tmp_path: Path, exit_code: int, extra_env: dict[str, str]) -> tuple[PrewarmedProcess, Path]:
    script, facts = tmp_path / "probe.py", tmp_path / "facts.json"
    script.write_text(_PROBE)
    env = {**launch_env(), **extra_env}
    process = PrewarmedProcess([sys.executable, str(script), str(facts), str(exit_code)], env, tmp_path,
                               tmp_path / "probe.log")
    return process, facts


def test_a_forked_rank_gets_the_arguments_environment_folder_output_and_exit_code_of_a_fresh_one(
    tmp_path: Path,
) -> None:
    (tmp_path / "work").mkdir()
    process, facts = _start_probe(tmp_path / "work", 3, {"PROBE": "seen"})
    assert process.wait(timeout=60) == 3
    got = json.loads(facts.read_text())
    assert got == {"argv": [str(tmp_path / "work" / "probe.py"), str(facts), "3"], "cwd": str(tmp_path / "work"),
                   "path0": str(tmp_path / "work"), "variable": "seen", "leads_session": True, "threads": 1,
                   "main": "__main__", "stdin": ""}
    assert (tmp_path / "work" / "probe.log").read_text().splitlines() == ["to the log", "error to the log"]


def test_a_killed_forked_rank_reports_the_signal_and_a_waited_one_times_out(tmp_path: Path) -> None:
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    process = PrewarmedProcess([sys.executable, str(script)], launch_env(), tmp_path, tmp_path / "sleep.log")
    assert not wait_or_kill([process], timeout_s=0.5)
    assert process.returncode == -signal.SIGKILL
    with pytest.raises(OSError):
        os.kill(process.pid, 0)  # the process group is gone too


def test_a_rank_that_crashes_is_reported_by_its_signal_and_its_python_stack(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text("import ctypes, sys\nprint('rank', sys.argv[-1])\n\ndef deep():\n    ctypes.string_at(0)\n\n"
                      "deep()\n")
    with pytest.raises(ScriptError) as failure:
        launch_and_wait(["--devices", "2", "--out", str(tmp_path / "run.pt")], [], 60, script=script)
    header = str(failure.value).splitlines()[0]
    assert "ranks [0, 1] failed" in header and "rank 0: signal SIGSEGV, Fatal Python error: Segmentation fault" in header
    assert 'line 5 in deep' in (tmp_path / "run.rank1.log").read_text()  # faulthandler's stack of the crash


@pytest.mark.slow
def test_forked_and_fresh_ranks_train_to_identical_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = ["--model", "gpt", "--dp", 2, "--devices", 2, "--steps", 3]
    forked = run_script([*args, "--out", tmp_path / "forked.pt"])
    monkeypatch.setenv(FRESH_PROCESSES_VARIABLE, "1")
    fresh = run_script([*args, "--out", tmp_path / "fresh.pt"])
    print(f"2-rank fit: forked {forked['run_s']:.1f} s, fresh interpreters {fresh['run_s']:.1f} s")
    assert forked["losses"] == fresh["losses"] and len(fresh["losses"]) >= 3
    assert forked["params"].keys() == fresh["params"].keys()
    assert all(torch.equal(forked["params"][name], fresh["params"][name]) for name in fresh["params"])
