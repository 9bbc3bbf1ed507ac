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
from lightning_hybrid.checkpoint.export import export_checkpoint, load_module_state
from tests.conftest import CHECKPOINTED_LAYERS, CHECKPOINTED_LAYOUTS
from tests.helpers import ScriptError, relative_difference, run_script
from tests.models import build_module

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
    # One shard file per rank beside DCP's and Lightning's metadata, and nothing else: Lightning's layout.
    shards = [f"__{rank}_0.distcp" for rank in range(8)]
    assert sorted(p.name for p in checkpoint.iterdir()) == [".metadata", *shards, "meta.pt"]
    resumed = _resume("dp2_tp2_pp2", checkpoint, tmp_path / "resumed.pt")
    assert _differences(source, resumed) == (0.0, 0.0)
    print(f"rank 0 save seconds {source['checkpoint_seconds']['save']}, load {resumed['checkpoint_seconds']['load']}")
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
    # The target layout loaded exactly the saved parameters ...
    saved = load_module_state(checkpoint)
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(saved[name], tensor), name
    # ... and the optimizer state with them: the continued training is the uninterrupted one up to rounding.
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
    written = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: written // 2])
    before = {p.name: p.read_bytes() for p in damaged.iterdir()}
    with pytest.raises(ScriptError, match=r"ranks \[0, 1, 2, 3\] failed"):
        _resume("dp2_tp2", damaged, tmp_path / "x.pt")
    # The recorded sizes name the shard before DCP reads any of it (bytes changed in place:
    # tests/resilience/test_failure_matrix.py).
    for rank in range(4):
        log = (tmp_path / f"x.rank{rank}.log").read_text()
        assert f"The checkpoint {damaged} is damaged: __3_0.distcp ({written // 2} bytes, {written} written:" \
               " truncated or overwritten). Nothing was loaded." in log, rank
        assert f"No other checkpoint is in {tmp_path}" in log, rank
    assert {p.name: p.read_bytes() for p in damaged.iterdir()} == before


# ------------------------------------------------------------------------------ tied weights, transposed layers
#: Zoo families whose checkpoints hold what the GPT's do not: a weight tied across pipeline stages (``tied``, saved
#: by dp2 × pp2) and Conv1D weights sharded over their columns, strided for the fused q|k|v (``hf_gpt2``, dp2 × tp2).
#: Phi-3's fused q|k|v of unequal pieces (kept whole on every tensor-parallel rank) and fused gate|up (strided),
#: Mixtral's 3-D expert weights (strided along their hidden width, FSDP2-sharded over the experts).
SOURCES = {"tied": ["--dp", 2, "--pp", 2, "--devices", 4], "hf_gpt2": ["--dp", 2, "--tp", 2, "--devices", 4],
           "hf_phi3": ["--dp", 2, "--tp", 2, "--devices", 4], "hf_mixtral": ["--dp", 2, "--tp", 2, "--devices", 4]}
#: Each family's weight stored under two names.
TIED_NAMES = {"tied": ("model.embed.weight", "model.head.weight"),
              "hf_gpt2": ("model.transformer.wte.weight", "model.lm_head.weight")}


@pytest.fixture(scope="module")
def zoo_source(tmp_path_factory: pytest.TempPathFactory):
    """``zoo_source(model)``: its uninterrupted run under ``SOURCES[model]``, checkpointed at the end of epoch 0."""
    cache: dict[str, dict] = {}

    def get(model: str) -> dict:
        if model not in cache:
            folder = tmp_path_factory.mktemp(f"source_{model}")
            result = run_script(["--model", model, *SOURCES[model], "--checkpoint-dir", folder / "checkpoints",
                                 "--out", folder / "run.pt"])
            cache[model] = {"result": result, "checkpoint": folder / "checkpoints" / "epoch=0-step=4.ckpt"}
        return cache[model]

    return get


@pytest.mark.parametrize(("model", "target"), [
    ("tied", ["--pp", 2, "--devices", 2]), ("tied", ["--dp", 2, "--devices", 2]),
    ("hf_gpt2", ["--pp", 2, "--devices", 2]),
])
def test_tied_and_transposed_weights_are_saved_as_the_module_has_them_and_resume_under_another_layout(
    model: str, target: list, zoo_source, tmp_path: Path
) -> None:
    """The checkpoint holds the tied weight under both names, equal (as the unmodified module's state dict does),
    and Conv1D weights in their own (in, out) layout; a pipeline of another shape, or none, resumes from it."""
    source = zoo_source(model)
    saved = load_module_state(source["checkpoint"])
    first, second = TIED_NAMES[model]
    assert torch.equal(saved[first], saved[second])
    resumed = run_script(["--model", model, *target, "--ckpt-path", source["checkpoint"], "--out", tmp_path / "r.pt"])
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(saved[name], tensor), name
    losses, params = _differences(source["result"], resumed)
    print(f"{model} {SOURCES[model]} -> {target}: losses max rel {losses:.2e}, params max rel {params:.2e}")
    assert losses <= 1e-5 and params <= 1e-5
    assert torch.equal(resumed["params"][first], resumed["params"][second])


@pytest.mark.parametrize("model", ["hf_phi3", "hf_mixtral"])
def test_grouped_query_and_expert_weights_are_saved_in_the_module_layout_and_resume_under_another_layout(
    model: str, zoo_source, tmp_path: Path
) -> None:
    source = zoo_source(model)
    saved = load_module_state(source["checkpoint"])
    plain = build_module(model).state_dict()
    assert {name: tuple(t.shape) for name, t in saved.items()} == {name: tuple(t.shape) for name, t in plain.items()}
    resumed = run_script(["--model", model, "--pp", 2, "--devices", 2, "--ckpt-path", source["checkpoint"],
                          "--out", tmp_path / "r.pt"])
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(saved[name], tensor), name
    losses, params = _differences(source["result"], resumed)
    print(f"{model} {SOURCES[model]} -> pp2: losses max rel {losses:.2e}, params max rel {params:.2e}")
    assert losses <= 1e-5 and params <= 1e-5


# ----------------------------------------------------------------------------------------- expert parallelism
@pytest.mark.parametrize(("model", "target"), [
    ("mixed_moe", ["--dp", 4, "--devices", 4, "--strategy-kwargs", '{"ep": 4}']),  # a list: 2 experts per rank → 1
    ("hf_mixtral", ["--dp", 2, "--devices", 2]),                                    # stacked: back on every rank
])
def test_experts_spread_over_ep_ranks_resume_under_another_ep(model: str, target: list, tmp_path: Path) -> None:
    """Saved under ep=2, each rank writing its experts under their unmodified names (a stacked weight's slices, a
    list's modules): the checkpoint is the unmodified module's state dict, and another ep (or none) resumes it."""
    source = run_script(["--model", model, "--dp", 2, "--devices", 2, "--strategy-kwargs", '{"ep": 2}',
                         "--checkpoint-dir", tmp_path / "checkpoints", "--out", tmp_path / "run.pt"])
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    saved = load_module_state(checkpoint)
    plain = build_module(model).state_dict()
    assert {name: tuple(t.shape) for name, t in saved.items()} == {name: tuple(t.shape) for name, t in plain.items()}
    resumed = run_script(["--model", model, *target, "--ckpt-path", checkpoint, "--out", tmp_path / "resumed.pt"])
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(saved[name], tensor), name
    losses, params = _differences(source, resumed)
    print(f"{model} ep2 -> {target}: losses max rel {losses:.2e}, params max rel {params:.2e}")
    assert losses <= 1e-5 and params <= 1e-5


# ----------------------------------------------------------------------------------------- context parallelism
def test_a_checkpoint_saved_under_cp_resumes_without_it(tmp_path: Path) -> None:
    """Saved under cp=2 (FSDP2 shards over both cp ranks, which read the same samples): the checkpoint is the
    unmodified module's state dict, and two data-parallel ranks without cp continue the same training."""
    source = run_script(["--model", "llama", "--dp", 1, "--devices", 2, "--strategy-kwargs", '{"cp": 2}',
                         "--checkpoint-dir", tmp_path / "checkpoints", "--out", tmp_path / "run.pt"])
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    saved = load_module_state(checkpoint)
    assert saved.keys() == build_module("llama").state_dict().keys()
    resumed = run_script(["--model", "llama", "--dp", 2, "--devices", 2, "--ckpt-path", checkpoint,
                          "--out", tmp_path / "resumed.pt"])
    for name, tensor in resumed["initial_params"].items():
        assert torch.equal(saved[name], tensor), name
    losses, params = _differences(source, resumed)
    print(f"llama cp2 -> dp2: losses max rel {losses:.2e}, params max rel {params:.2e}")
    assert losses <= 1e-5 and params <= 1e-5
