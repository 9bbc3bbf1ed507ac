"""The failure matrix: a rank killed (a) in the forward, (b) in the optimizer step, (c) during a sync checkpoint save,
and (e) one shard file of the last checkpoint garbled before a resume. For each: what the surviving rank prints, how
long until every rank has exited, and where ``ckpt_path="last"`` resumes.

The rows share one checkpoint folder and follow each other, each launch resuming from what the one before left: a
2-rank run of 14 steps (4 per epoch, a checkpoint at each epoch end: steps 4, 8 and 12, and last.ckpt)

1. starts afresh and loses rank 1 in the forward of step 6;
2. resumes (``last``: step 4) and loses rank 1 in the optimizer step of step 9;
3. resumes (``last``: step 8) and loses rank 1 in its first save: the epoch-end checkpoint of step 8 written again
   (the step-8 checkpoint was saved at validation end, before the epoch finished, so the resumed run finishes that
   epoch and saves it once more), which leaves only a ``.partial`` folder beside the complete one;
4. finds last.ckpt (still step 8) garbled: refused on every rank, naming the file and the checkpoint to use instead;
5. resumes from that one (step 8) and finishes.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from tests.conftest import CHECKPOINTED_LAYERS
from tests.helpers import ScriptError, run_script

pytestmark = pytest.mark.slow

RUN = ["--model", "gpt", "--layers", CHECKPOINTED_LAYERS, "--dp", 2, "--devices", 2, "--steps", 14]
#: All ranks gone within this many seconds of the kill: gloo sees the closed connection at once.
EXIT_BOUND_S = 30.0
LOST_RANK = r"HybridStrategy rank 0: another rank of this job is gone \(noticed at step {step}, in {phase}\)"


def _failed_run(args: list, out: Path) -> dict[str, Any]:
    """Run a launch expected to fail; return rank 0's log, the step training started at, and the seconds from
    rank 1's kill (or from the start, without one) until every rank had exited."""
    start = time.time()
    with pytest.raises(ScriptError, match=r"ranks \[.*\] failed"):
        run_script([*args, "--out", out])
    exited = time.time()
    rank0, rank1 = (out.with_name(f"{out.stem}.rank{rank}.log").read_text() for rank in (0, 1))
    killed = re.search(r"kill switch: SIGKILL at ([\d.]+)", rank1)
    started = re.search(r"training starts at step (\d+)", rank0)
    return {"rank0": rank0, "rank1": rank1, "exit_s": exited - (float(killed.group(1)) if killed else start),
            "start_step": int(started.group(1)) if started else None}


def _garble(shard: Path) -> None:
    """Invert 64 bytes in the middle of a file, keeping its size (what a bad disk or a partial overwrite does)."""
    data = bytearray(shard.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 64] = bytes(255 - byte for byte in data[middle:middle + 64])
    shard.write_bytes(bytes(data))


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("failure_matrix")
    folder = tmp / "checkpoints"
    args = [*RUN, "--checkpoint-dir", folder]
    rows: dict[str, Any] = {"folder": folder}
    rows["forward"] = _failed_run([*args, "--kill", "1:forward:6"], tmp / "forward.pt")
    rows["optimizer"] = _failed_run([*args, "--ckpt-path", "last", "--kill", "1:optimizer:9"], tmp / "optimizer.pt")
    # This launch's first save rewrites epoch=1-step=8.ckpt (see the module docstring).
    rows["save"] = _failed_run([*args, "--ckpt-path", "last", "--kill", "1:save:1"], tmp / "save.pt")
    rows["after_save"] = sorted(path.name for path in folder.iterdir())
    rows["last_step"] = torch.load(folder / "last.ckpt" / "meta.pt", weights_only=False)["global_step"]
    _garble(folder / "last.ckpt" / "__1_0.distcp")
    rows["garbled"] = _failed_run([*args, "--ckpt-path", "last"], tmp / "garbled.pt")
    suggested = re.search(r'Resume from an earlier checkpoint instead: ckpt_path="([^"]+)"', rows["garbled"]["rank0"])
    rows["suggested"] = Path(suggested.group(1)) if suggested else None
    if rows["suggested"] is not None:
        rows["resumed"] = run_script([*args, "--ckpt-path", rows["suggested"], "--out", tmp / "resumed.pt"])
        rows["final"] = sorted(path.name for path in folder.iterdir())
    for row in ("forward", "optimizer", "save", "garbled"):
        print(f"{row}: every rank exited {rows[row]['exit_s']:.1f} s after the kill (or start)")
    return rows


@pytest.mark.parametrize(("row", "step", "phase", "resumed_from_step"), [
    ("forward", 6, r"the training step \(forward\)", None),
    ("optimizer", 9, r"gradient clipping \(optimizer step\)", 4),
    ("save", 8, "a checkpoint save", 8),
])
def test_survivor_of_a_killed_rank_says_what_happened_and_where_to_resume(
    matrix: dict[str, Any], row: str, step: int, phase: str, resumed_from_step: int | None
) -> None:
    result = matrix[row]
    assert result["exit_s"] < EXIT_BOUND_S
    assert result["start_step"] == (resumed_from_step or 0)
    # The traceback's last line: what happened, then where ckpt_path="last" continues, then gloo's own words.
    message = re.search(LOST_RANK.format(step=step, phase=phase) + r".*", result["rank0"])
    assert message, result["rank0"][-3000:]
    assert f'Resume with ckpt_path="last" (now {matrix["folder"] / "last.ckpt"})' in message.group(0)
    assert "The backend reported: [" in message.group(0) and "by peer" in message.group(0)


def test_a_save_cut_short_is_never_resumed_from(matrix: dict[str, Any]) -> None:
    assert matrix["after_save"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=1-step=8.ckpt.partial",
                                    "last.ckpt"]
    assert matrix["last_step"] == 8  # last.ckpt, what "last" resumes from, is not the folder being written


def test_a_garbled_shard_is_refused_on_every_rank_naming_the_file_and_the_checkpoint_to_use(
    matrix: dict[str, Any],
) -> None:
    garbled = matrix["garbled"]
    # Every rank checks its share of the files and all of them stop together (the bound includes starting up).
    assert garbled["exit_s"] < 4 * EXIT_BOUND_S and garbled["start_step"] is None
    for log in (garbled["rank0"], garbled["rank1"]):
        assert re.search(rf"The checkpoint {re.escape(str(matrix['folder'] / 'last.ckpt'))} is damaged: "
                         r"__1_0\.distcp \(its bytes changed since it was written: CRC-32 [0-9a-f]{8}, was "
                         r"[0-9a-f]{8}\)\. Nothing was loaded\.", log), log[-3000:]
    assert matrix["suggested"] == matrix["folder"] / "epoch=1-step=8.ckpt"  # the same step's own copy
    resumed = matrix["resumed"]
    assert resumed["start_step"] == 8 and resumed["global_step"] == 14
    # Its saves replaced the debris of the one cut short; step 14 (max_steps, mid-epoch) was saved at the end.
    assert matrix["final"] == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=12.ckpt",
                               "epoch=3-step=14.ckpt", "last.ckpt"]
