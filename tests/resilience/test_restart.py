"""Automatic restart: under ``torchrun --max-restarts 3`` a rank SIGKILLed mid-training takes the job down, torchrun
starts every rank again, and the second attempt resumes from the last complete checkpoint (``ckpt_path="last"``)
and trains exactly as a run resumed from that checkpoint without any crash."""

from __future__ import annotations

from pathlib import Path

import pytest
from tests.conftest import CHECKPOINTED_LAYERS
from tests.helpers import relative_difference, run_script, run_torchrun

#: Left out of the default run for now: a restarted attempt's workers used to hang connecting their gloo pair (the
#: failed attempt's addresses stayed in torchrun's store; fixed in ``_compat.setup_process_group``); back in the
#: default run once the fix has a record beyond its first three passing runs.
pytestmark = pytest.mark.slow

#: Two ranks, 10 steps of 4 per epoch: checkpoints at the epoch ends, steps 4 and 8 (and ModelCheckpoint's last.ckpt).
RUN = ["--model", "gpt", "--layers", CHECKPOINTED_LAYERS, "--dp", 2, "--devices", 2, "--steps", 10]


def test_killed_rank_restarts_the_job_which_resumes_from_the_last_checkpoint_and_trains_the_same(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "checkpoints"
    # Rank 1 dies when step 6 starts on the first attempt only; every attempt asks for ckpt_path="last".
    (done,), seconds = run_torchrun([*RUN, "--checkpoint-dir", folder, "--ckpt-path", "last", "--kill", "1:step:6",
                                     "--out", tmp_path / "restarted.pt"], max_restarts=3)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    print(f"torchrun with one restart: {seconds:.1f} s")
    assert output.count("kill switch: SIGKILL") == 1
    # Restarts beyond the first are allowed: on 2 loaded cores a restarted attempt once failed to connect its gloo
    # mesh ("Connection refused") and a further restart is what torchrun is for.
    assert "Worker group FAILED. 3/3 attempts left; will restart worker group" in output

    import torch

    restarted = torch.load(tmp_path / "restarted.pt", weights_only=False)
    assert restarted["restart_count"] >= 1  # the result is a restarted attempt's
    assert restarted["resumed_from"] == str(folder / "last.ckpt") and restarted["start_step"] == 4
    assert restarted["global_step"] == 10 and len(restarted["losses"]) == (10 - 4) * 2

    # The same checkpoint resumed in a run that never crashed: the same losses and parameters, bit for bit.
    uninterrupted = run_script([*RUN, "--ckpt-path", folder / "epoch=0-step=4.ckpt", "--out", tmp_path / "ref.pt"])
    assert uninterrupted["start_step"] == 4
    assert restarted["losses"] == uninterrupted["losses"]
    assert restarted["params"].keys() == uninterrupted["params"].keys()
    assert max(relative_difference(restarted["params"][name], uninterrupted["params"][name])
               for name in restarted["params"]) == 0.0
