"""Hugging Face checkpoints read straight into the sharded layout (``HybridStrategy(weights=...)``,
``lightning_hybrid.checkpoint.hf_load``): fine-tuning from a saved directory under tp2, pp2 and dp2×tp2×pp2 equals
single-device ``from_pretrained`` + fine-tuning, every layout starts from bit-identical weights, and a directory
that does not match the model stops setup with one message."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lightning_hybrid.checkpoint import hf_load
from lightning_hybrid.checkpoint.hf_load import load_pretrained
from tests.helpers import SHORT_RUN, ScriptError, assert_equivalent, param_extended_if, run_script, run_sweep
from tests.models import build_module

#: Qwen2: a tied head (saved once), q/k/v biases; Phi-3: a fused q|k|v of unequal pieces, fused gate|up.
MODELS = ("hf_qwen2", "hf_phi3")
#: Mixtral, Qwen3-MoE: experts saved one by one, stacked in the model (transformers' conversion mapping); at 2 ranks.
MOE_MODELS = ("hf_mixtral", "hf_qwen3_moe")
#: Layout → the harness's arguments and the data-parallel size of its reference. Runs and references train the
#: short run (``SHORT_RUN``): the 8-rank pipeline's four fits are bound by their steps.
LAYOUTS = {"tp2": (["--tp", 2, "--devices", 2, *SHORT_RUN], 1), "pp2": (["--pp", 2, "--devices", 2, *SHORT_RUN], 1),
           "dp2_tp2_pp2": (["--dp", 2, "--tp", 2, "--pp", 2, "--devices", 8, *SHORT_RUN], 2)}
#: 8 ranks on 2 cores; its parts run in the default suite (tp2, pp2 here, FSDP2 loading in tests/expert_parallel).
EXTENDED = {"dp2_tp2_pp2"}


def _save_pretrained(model: str, folder: Path) -> Path:
    """A "published" checkpoint: the family built with another seed than the runs use, saved by transformers."""
    build_module(model, seed=7).model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {model: _save_pretrained(model, tmp_path_factory.mktemp(model)) for model in MODELS + MOE_MODELS}


def _models(dp_size: int) -> tuple[str, ...]:
    """The families fine-tuned at a data-parallel size: the mixtures of experts at 2 ranks (dp 1) only."""
    return MODELS + MOE_MODELS if dp_size == 1 else MODELS


@pytest.fixture(scope="module")
def references(pretrained: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], list[dict]]:
    """``references(dp_size)``: single-process Lightning fine-tuning from ``from_pretrained`` weights, run when a
    selected layout first needs that data-parallel size."""

    @functools.cache
    def run(dp_size: int) -> list[dict]:
        out = tmp_path_factory.mktemp(f"reference_dp{dp_size}") / "reference.pt"
        entries = [{"model": model, "module": {"pretrained": str(pretrained[model])}} for model in _models(dp_size)]
        return run_sweep(["--reference", "--dp", dp_size, "--devices", 1, *SHORT_RUN, "--out", out], entries)

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout", [param_extended_if(layout in EXTENDED, layout) for layout in LAYOUTS])
def test_fine_tuning_from_a_hugging_face_directory_equals_single_device(
    layout: str, pretrained: dict[str, Path], references: Callable[[int], list[dict]], tmp_path: Path
) -> None:
    arguments, dp_size = LAYOUTS[layout]
    models = _models(dp_size)
    entries = [{"model": model, "weights": str(pretrained[model])} for model in models]
    # and built on the meta device: no rank ever holds the whole model
    entries += [{"model": model, "weights": str(pretrained[model]), "module": {"init": "meta"}} for model in models]
    results = run_sweep([*arguments, "--out", tmp_path / "run.pt"], entries)
    for model, reference, result in zip(models * 2, references(dp_size) * 2, results):
        if model in MODELS:  # saved under the model's names: every layout starts from exactly the saved weights
            for name, tensor in load_file(pretrained[model] / "model.safetensors").items():
                assert torch.equal(result["initial_params"][f"model.{name}"], tensor), (model, name)
        for name, tensor in reference["initial_params"].items():  # from_pretrained's weights, experts converted
            assert torch.equal(result["initial_params"][name], tensor), (model, name)
        assert_equivalent(reference, result, rtol=1e-5)


# ------------------------------------------------------------------------------------------------ bad inputs
class _Holder(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


@pytest.mark.parametrize("block_bytes", [hf_load.READ_BLOCK_BYTES, 256])
def test_loading_in_one_process_fills_tied_weights_and_leaves_unsaved_buffers(
    block_bytes: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also read in blocks of 256 bytes (every matrix in many row blocks, each a separate read)."""
    monkeypatch.setattr(hf_load, "READ_BLOCK_BYTES", block_bytes)
    folder = _save_pretrained("hf_qwen2", tmp_path)
    holder = _Holder(build_module("hf_qwen2", seed=1).model)
    load_pretrained(holder, folder)
    expected = build_module("hf_qwen2", seed=7).model.state_dict()
    assert all(torch.equal(tensor, expected[name]) for name, tensor in holder.model.state_dict().items())
    assert holder.model.lm_head.weight is holder.model.model.embed_tokens.weight


def test_the_names_a_directory_fills_are_every_saved_weight_under_each_tied_name(tmp_path: Path) -> None:
    folder = _save_pretrained("hf_qwen2", tmp_path)
    holder = _Holder(build_module("hf_qwen2", seed=1).model)
    names = {name for name, _ in holder.named_parameters(remove_duplicate=False)}
    assert "model.lm_head.weight" in names  # tied to the embedding: saved once, filled under both names
    assert hf_load.loaded_names(holder, folder) == names


def test_a_directory_of_another_model_or_shape_is_refused_listing_the_names(tmp_path: Path) -> None:
    folder = _save_pretrained("hf_qwen2", tmp_path / "qwen2")
    with pytest.raises(ValueError, match=r"does not match the model: missing \[.*qkv_proj.weight.*unexpected \[.*"
                                         r"q_proj.weight.*Nothing was loaded"):
        load_pretrained(_Holder(build_module("hf_phi3").model), folder)
    wider = build_module("hf_qwen2", config={"intermediate_size": 96}).model
    with pytest.raises(ValueError, match=r"shape mismatches \['model.layers.0.mlp.down_proj.weight \(32, 64\) vs"
                                         r" model \(32, 96\)'"):
        load_pretrained(_Holder(wider), folder)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors files"):
        load_pretrained(_Holder(wider), tmp_path / "missing")
    with pytest.raises(ValueError, match="holds none"):
        load_pretrained(_Holder(nn.Linear(2, 2)), folder)


@pytest.mark.slow
def test_a_missing_shard_stops_every_rank_before_training(tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    build_module("hf_qwen2", seed=7).model.save_pretrained(folder, max_shard_size="20KB")
    shards = sorted(folder.glob("model-*.safetensors"))
    assert len(shards) > 2
    shards[1].unlink()
    with pytest.raises(ScriptError) as failure:
        run_script(["--model", "hf_qwen2", "--pp", 2, "--devices", 2, "--strategy-kwargs",
                    f'{{"weights": "{folder}"}}', "--out", tmp_path / "run.pt"])
    message = str(failure.value)
    assert message.count("does not match the model: missing [") >= 2  # rank 0 and rank 1
    assert "Nothing was loaded" in message and not (tmp_path / "run.pt").exists()  # nothing trained


def _load_tensor_parallel(rank: int, results: dict, folder: str) -> None:
    """Phi-3 sharded tp2 (fused q|k|v kept whole per rank, gate|up strided), loaded in 512-byte row blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step
    from lightning_hybrid.tensor_parallel.apply import apply_tensor_parallel

    hf_load.READ_BLOCK_BYTES = 512
    holder = _Holder(build_module("hf_phi3", seed=1).model)
    path, blocks = find_block_list(holder)
    record = record_step(holder, blocks, lambda: holder.model(torch.randint(0, 64, (2, 16))))
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    plan = apply_tensor_parallel(holder, path, blocks, record.block_calls, mesh, tp_plan={}, verify=True)
    load_pretrained(holder, folder)
    saved = load_file(Path(folder) / "model.safetensors")
    state = {name: t.full_tensor() if isinstance(t, DTensor) else t for name, t in holder.model.state_dict().items()}
    if rank == 0:
        results.update(plan=plan, unequal=[name for name, t in saved.items() if not torch.equal(state[name], t)])


@pytest.mark.slow
def test_strided_and_whole_tensor_parallel_weights_load_in_row_blocks(tmp_path: Path) -> None:
    from tests.helpers import on_two_ranks

    folder = _save_pretrained("hf_phi3", tmp_path)
    results = on_two_ranks(_load_tensor_parallel, str(folder))
    assert results["plan"]["model.model.layers.*.mlp.gate_up_proj"] == "colwise (strided x2)"
    assert results["unequal"] == []


@pytest.mark.parametrize("model", ["hf_mixtral", "hf_qwen3_moe"])
def test_experts_saved_one_by_one_load_stacked_as_from_pretrained_converts_them(model: str, tmp_path: Path) -> None:
    # transformers 5 saves a mixture of experts per expert (``experts.3.w1.weight``) and stacks it in the model
    folder = _save_pretrained(model, tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as stored:
        assert any(".experts.0." in name for name in stored.keys())
    expected = type(build_module(model).model).from_pretrained(folder).state_dict()
    module = build_module(model, seed=3)
    assert not torch.equal(module.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"],
                           expected["model.layers.0.mlp.experts.gate_up_proj"])
    load_pretrained(module, folder)
    for name, tensor in module.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
