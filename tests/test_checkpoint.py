"""Sharded checkpoints: exact resume in a new process group, and resuming under another layout (resharding),
with pipeline parallelism included.

Every run trains the 4-block GPT for 6 optimizer steps (accumulation 2) and saves a DCP checkpoint at the end of
epoch 0 (step 4); a resumed run loads it in new processes and trains steps 5 and 6. The uninterrupted run of the
source layout is the reference: same layout → bit-identical, other layout → within fp32 rounding of it (the data
of a global batch is the same set of samples for every data-parallel size, see ``tests/equivalence.py``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from lightning_hybrid.export import export_checkpoint
from tests.conftest import CHECKPOINTED_LAYERS, CHECKPOINTED_LAYOUTS
from tests.helpers import ScriptError, relative_difference, run_script

pytestmark = pytest.mark.slow

def _resume(layout: str, checkpoint: Path, out: Path) -> dict:
    return run_script(["--model", "gpt", "--layers", CHECKPOINTED_LAYERS, *CHECKPOINTED_LAYOUTS[layout],
                       "--ckpt-path", checkpoint, "--out", out])


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



def test_checkpoint_of_another_model_is_refused_with_the_key_lists(uninterrupted, tmp_path: Path) -> None:
    _, checkpoint = uninterrupted("dp2_tp2")
    with pytest.raises(ScriptError, match=r"does not match the model: missing keys \['model.layers.0.attention"
                                          r".*unexpected keys \['model.blocks.0.attn.proj.bias'"):
        run_script(["--model", "llama", *CHECKPOINTED_LAYOUTS["dp2_tp2"], "--ckpt-path", checkpoint, "--out", tmp_path / "x.pt"])


def test_truncated_shard_is_reported_on_every_rank_and_left_untouched(uninterrupted, tmp_path: Path) -> None:
    _, checkpoint = uninterrupted("dp2_tp2")
    damaged = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, damaged)
    shard = damaged / "__3_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    before = {p.name: p.read_bytes() for p in damaged.iterdir()}
    with pytest.raises(ScriptError, match=r"ranks \[0, 1, 2, 3\] failed") as failure:
        _resume("dp2_tp2", damaged, tmp_path / "x.pt")
    assert str(failure.value).count("is incomplete or corrupted") >= 1
    for rank in range(4):
        log = (tmp_path / f"x.rank{rank}.log").read_text()
        assert f"Could not read the checkpoint {damaged}" in log, rank
    assert {p.name: p.read_bytes() for p in damaged.iterdir()} == before
