"""``benchmarks/gpu_check.py`` on the CPU: the script a session with a GPU runs once, on a few minutes of device time,
must not fail there for a reason a CPU can show (its sides train, the monitor's and the planner's figures reach the
table, the pipeline recorder's timeline path passes its own check)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.slow
def test_the_gpu_check_runs_every_step_of_its_table_on_a_tiny_model_on_the_cpu() -> None:
    command = [sys.executable, str(REPO_ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--tiny",
               "--sides", "lightning", "hybrid", "--steps", "4"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {cells[0]: cells for cells in (
        [cell.strip() for cell in line.strip("|").split("|")] for line in done.stdout.splitlines()
        if re.match(r"\| (lightning|hybrid) ", line))}
    assert set(rows) == {"lightning", "hybrid"}, done.stdout
    assert rows["lightning"][2] == "1.000" and float(rows["hybrid"][1]) > 0  # step ms, and the baseline's ratio
    assert rows["lightning"][6] == "-" and rows["hybrid"][6] != "-"  # the planner's MFU, for the strategy's side only
    assert re.search(r"CUDA-event timeline \(cpu clock\): 8 actions \(FFFFBBBB\), busy [\d.]+ of [\d.]+ ms: ok$",
                     done.stdout.strip()), done.stdout[-1000:]
