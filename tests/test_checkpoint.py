"""Sharded checkpoints: exact resume in a new process group, and resuming under another layout (resharding),
with pipeline parallelism included.

Every run trains the 4-block GPT for 6 optimizer steps (accumulation 2) and saves a DCP checkpoint at the end of
epoch 0 (step 4); a resumed run loads it in new processes and trains steps 5 and 6. The uninterrupted run of the
source layout is the reference: same layout → bit-identical, other layout → within fp32 rounding of it (the data
of a global batch is the same set of samples for every data-parallel size, see ``tests/equivalence.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning_hybrid.export import export_checkpoint
from tests.helpers import cached_runs, relative_difference, run_script

pytestmark = pytest.mark.slow

LAYERS = 4
CHECKPOINT = "epoch=0-step=4.ckpt"
LAYOUTS = {
    "dp2_tp2_pp2": ["--dp", 2, "--tp", 2, "--pp", 2, "--devices", 8],
    "tp2_pp2": ["--tp", 2, "--pp", 2, "--devices", 4],
    "dp2_tp2": ["--dp", 2, "--tp", 2, "--devices", 4],
    "dp4": ["--dp", 4, "--devices", 4],
    "pp4": ["--pp", 4, "--devices", 4],
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory):
    """``uninterrupted(layout)``: (result, checkpoint folder) of a 6-step run that saved at step 4 (cached)."""

    def run(layout: str, folder: Path) -> tuple[dict, Path]:
        result = run_script(["--model", "gpt", "--layers", LAYERS, *LAYOUTS[layout],
                             "--checkpoint-dir", folder / "checkpoints", "--out", folder / "run.pt"])
        return result, folder / "checkpoints" / CHECKPOINT

    return cached_runs(run, tmp_path_factory, "source")


def _resume(layout: str, checkpoint: Path, out: Path) -> dict:
    return run_script(["--model", "gpt", "--layers", LAYERS, *LAYOUTS[layout], "--ckpt-path", checkpoint, "--out", out])


def _differences(uninterrupted: dict, resumed: dict) -> tuple[float, float]:
    """Largest relative difference of the resumed run's losses (steps 5-6) and final parameters."""
    assert len(resumed["losses"]) == 4  # steps 5 and 6, two micro-batches each
    assert resumed["learning_rates"] == uninterrupted["learning_rates"][-2:]
    assert resumed["params"].keys() == uninterrupted["params"].keys()
    losses = max(abs(a - b) / abs(a) for a, b in zip(uninterrupted["losses"][-4:], resumed["losses"]))
    params = max(relative_difference(uninterrupted["params"][k], resumed["params"][k]) for k in resumed["params"])
    return losses, params


def test_resume_in_new_processes_is_bit_exact_for_a_3d_layout(uninterrupted, tmp_path: Path) -> None:
    source, checkpoint = uninterrupted("dp2_tp2_pp2")
    assert sorted(p.suffix for p in checkpoint.iterdir()).count(".distcp") == 8  # one shard file per rank
    resumed = _resume("dp2_tp2_pp2", checkpoint, tmp_path / "resumed.pt")
    assert _differences(source, resumed) == (0.0, 0.0)
    # Exported to one file in one process: the unmodified module's state dict, equal to what the resumed ranks
    # loaded (fused qkv rows in their original order, both pipeline stages).
    exported = torch.load(export_checkpoint(checkpoint, tmp_path / "model.ckpt"), weights_only=False)["state_dict"]
    assert exported.keys() == resumed["initial_params"].keys()
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(exported[name], tensor), name


@pytest.mark.parametrize(("source", "target"), [("dp2_tp2_pp2", "tp2_pp2"), ("dp2_tp2", "dp4"), ("dp2_tp2", "pp4")])
def test_resume_under_another_layout_continues_the_same_training(
    source: str, target: str, uninterrupted, tmp_path: Path
) -> None:
    """Fewer ranks, tensor parallelism traded for data or pipeline parallelism: the DCP checkpoint is keyed by the
    unmodified module's parameter names and global shapes, so any layout reads its own shards of it."""
    result, checkpoint = uninterrupted(source)
    resumed = _resume(target, checkpoint, tmp_path / "resumed.pt")
    losses, params = _differences(result, resumed)
    print(f"{source} -> {target}: losses max rel {losses:.2e}, params max rel {params:.2e}")
    assert losses <= 1e-5 and params <= 1e-5

