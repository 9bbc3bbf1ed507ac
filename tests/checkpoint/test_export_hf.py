"""Export of a sharded checkpoint to a Hugging Face directory (``lightning_hybrid.checkpoint.hf_export``).

Tensor-parallel checkpoints (dp2 × tp2: GPT-2's tied head and Conv1D weights strided over their columns, Phi-3's
fused q|k|v of unequal pieces and strided gate|up) come from ``tests/equivalence.py`` runs; the others are written
in this process in the strategy's format (DCP folder + ``meta.pt``), as in ``test_export.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import lightning
import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_hybrid.checkpoint.export import load_module_state
from lightning_hybrid.checkpoint.hf_export import export_hugging_face
from lightning_hybrid.glue.checkpoint_records import module_class_path
from lightning_hybrid.checkpoint.module_class import import_class, instantiate_on_meta
from tests.helpers import cached_runs, run_package_command, run_script
from tests.models import LMLightningModule, build_module

REPO_ROOT = Path(__file__).resolve().parents[2]
MODULE = "tests.models:LMLightningModule"
#: Forces several shards of the tiny models (their largest tensor is 32 × 128 floats, 16 KiB).
SMALL_SHARDS = 20_000


def _write_checkpoint(module: LMLightningModule, folder: Path) -> None:
    """``module`` saved as HybridStrategy saves it: its state dict in a DCP folder, Lightning's ``meta.pt`` beside."""
    dcp.save({"state_dict": module.state_dict()}, checkpoint_id=folder)
    torch.save({"epoch": 0, "global_step": 0, "hyper_parameters": dict(module.hparams),
                "pytorch-lightning_version": lightning.__version__}, folder / "meta.pt")


def _export_command(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    return run_package_command(["export", checkpoint, out, *extra])


def _assert_loads_bit_for_bit(out: Path, checkpoint: Path, module: LMLightningModule) -> torch.nn.Module:
    """``from_pretrained(out)`` holds every tensor of the checkpoint's model, bit for bit, and computes the
    LightningModule's logits exactly (with the same attention kernel: a runtime choice config.json does not
    carry, as with save_pretrained; the zoo's is eager, from_pretrained's default sdpa differs in rounding)."""
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation=module.model.config._attn_implementation)
    saved = load_module_state(checkpoint)
    names = loaded.state_dict()
    assert {f"model.{name}" for name in names} == set(saved)
    unequal = [name for name, tensor in names.items() if not torch.equal(tensor, saved[f"model.{name}"])]
    assert unequal == []
    module.load_state_dict(saved)
    for tensor in [*loaded.parameters(), *loaded.buffers()]:
        # Into memory of torch's allocator, as the module's: safetensors maps each tensor at its offset in the file
        # (8-byte aligned), and a CPU BLAS may round a matmul of unaligned operands differently (AMD EPYC: 1.5e-8).
        tensor.data = tensor.data.clone()
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, module(tokens))
    return loaded


@pytest.fixture(scope="module")
def tensor_parallel_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``tensor_parallel_checkpoint(model)``: the checkpoint a dp2 × tp2 run of ``model`` saved after 4 steps."""

    def run(model: str, folder: Path) -> Path:
        run_script(["--model", model, "--dp", 2, "--tp", 2, "--devices", 4, "--steps", 4,
                    "--checkpoint-dir", folder / "checkpoints", "--out", folder / "run.pt"])
        return folder / "checkpoints" / "epoch=0-step=4.ckpt"

    return cached_runs(run, tmp_path_factory, "tp")


@pytest.mark.slow
@pytest.mark.parametrize("model", ["hf_gpt2", "hf_phi3"])
def test_tensor_parallel_checkpoint_exports_a_directory_from_pretrained_loads_bit_for_bit(
    model: str, tensor_parallel_checkpoint, tmp_path: Path
) -> None:
    checkpoint = tensor_parallel_checkpoint(model)  # which records its module's class: no --module needed
    done = _export_command(checkpoint, tmp_path / "hf", "--hf", "--max-shard-size", str(SMALL_SHARDS))
    assert done.returncode == 0, done.stderr
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(path.name for path in (tmp_path / "hf").glob("*.safetensors"))
    assert sorted(set(index["weight_map"].values())) == shards and len(shards) >= 5
    assert all((tmp_path / "hf" / name).stat().st_size <= SMALL_SHARDS + 4096 for name in shards)  # + header
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["dtype"] == "float32" and len(config["architectures"]) == 1
    loaded = _assert_loads_bit_for_bit(tmp_path / "hf", checkpoint, build_module(model))
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for n, t in loaded.state_dict().items()
                                                  if n in index["weight_map"])
    if model == "hf_gpt2":  # the tied head is written once, under the embedding's name, and tied again on load
        assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
        assert loaded.lm_head.weight is loaded.transformer.wte.weight


def test_mixture_of_experts_exports_with_its_fused_experts_and_one_shard(tmp_path: Path) -> None:
    """Mixtral's 3-D expert weights, written under this transformers' own names, and the module given as a class:
    a model under ``max_shard_size`` is one ``model.safetensors`` without an index, as save_pretrained writes it."""
    module = build_module("hf_mixtral", seed=5)
    _write_checkpoint(module, tmp_path / "ckpt")
    out = export_hugging_face(tmp_path / "ckpt", tmp_path / "hf", LMLightningModule)
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "generation_config.json",
                                                         "model.safetensors"]
    loaded = _assert_loads_bit_for_bit(out, tmp_path / "ckpt", module)
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 128, 32)


def test_config_is_copied_from_a_directory_and_hyperparameters_can_be_overridden(tmp_path: Path) -> None:
    module = build_module("hf_qwen2", config={"num_hidden_layers": 2})
    _write_checkpoint(module, tmp_path / "ckpt")
    module.model.config.save_pretrained(tmp_path / "source")
    out = export_hugging_face(tmp_path / "ckpt", tmp_path / "hf", MODULE, config_from=tmp_path / "source")
    assert (out / "config.json").read_bytes() == (tmp_path / "source" / "config.json").read_bytes()
    _assert_loads_bit_for_bit(out, tmp_path / "ckpt", module)
    # A restarted job exports again over its earlier export: replaced, once the new one is complete.
    (out / "stale.safetensors").write_bytes(b"")
    assert export_hugging_face(tmp_path / "ckpt", out, MODULE, replace=True) == out
    assert not (out / "stale.safetensors").exists() and not (tmp_path / "hf.partial").exists()
    _assert_loads_bit_for_bit(out, tmp_path / "ckpt", module)
    # Built from the saved hyperparameters unless overridden: 4 blocks do not match the 2-block checkpoint.
    with pytest.raises(ValueError, match=r"lacks tensors of the module's Hugging Face model: \['model.model.layers.2"):
        export_hugging_face(tmp_path / "ckpt", tmp_path / "hf4", MODULE, module_kwargs={"config": {}})
    assert not (tmp_path / "hf4").exists() and not (tmp_path / "hf4.partial").exists()


def test_a_module_without_a_hugging_face_model_and_other_bad_input_are_refused(tmp_path: Path) -> None:
    _write_checkpoint(build_module("llama"), tmp_path / "ckpt")
    done = _export_command(tmp_path / "ckpt", tmp_path / "hf", "--hf", "--module", MODULE)
    assert done.returncode == 2
    assert "LMLightningModule holds no transformers.PreTrainedModel, so there is no Hugging Face model" in done.stderr
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.partial").exists()
    done = _export_command(tmp_path / "ckpt", tmp_path / "hf", "--hf")  # written without the module's class
    assert done.returncode == 2 and "does not record its LightningModule's class" in done.stderr
    assert "--module package.module:Class" in done.stderr
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match=r"already exists and is not an empty directory"):
        export_hugging_face(tmp_path / "ckpt", tmp_path / "full", MODULE)
    with pytest.raises(ValueError, match=r"already exists and is not an empty directory"):  # not an export
        export_hugging_face(tmp_path / "ckpt", tmp_path / "full", MODULE, replace=True)
    assert (tmp_path / "full" / "tokenizer.json").read_text() == "{}"
    with pytest.raises(ValueError, match=r"is not a sharded HybridStrategy checkpoint"):
        export_hugging_face(tmp_path / "full", tmp_path / "hf", MODULE)


def test_the_module_class_is_recorded_importably_also_for_a_class_defined_in_the_script_run(tmp_path: Path) -> None:
    assert module_class_path(LMLightningModule) == MODULE
    script = tmp_path / "train.py"
    script.write_text("import torch\nclass Net(torch.nn.Module):\n    pass\nif __name__ == '__main__':\n"
                      "    from lightning_hybrid.glue.checkpoint_records import module_class_path\n"
                      "    print(module_class_path(Net))\n")
    done = subprocess.run([sys.executable, str(script)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.stdout.strip() == f"{script.resolve()}:Net", done.stderr
    assert import_class(done.stdout.strip()).__name__ == "Net"  # imported without running its main part
    with pytest.raises(ValueError, match="Cannot import .*missing.py:Net.*no script"):
        import_class(str(tmp_path / "missing.py:Net"))
    assert module_class_path(type("Local", (), {"__qualname__": "f.<locals>.Local"})) is None


def test_hyperparameters_saved_by_a_lightning_cli_run_rebuild_the_module_through_its_instantiator() -> None:
    """LightningCLI records ``_instantiator`` beside the constructor's arguments (nested classes as config dicts):
    the export rebuilds through it, as ``load_from_checkpoint`` does, and trusts no other function."""
    from recipes.gpt import GPTConfig

    hparams = {"config": {"vocab_size": 64, "n_layer": 2, "n_embd": 32}, "lr": 1e-3,
               "_instantiator": "lightning.pytorch.cli.instantiate_module"}
    module = instantiate_on_meta("recipes.gpt:GPTLightning", hparams)  # once: "unexpected keyword _instantiator"
    assert module.config == GPTConfig(vocab_size=64, n_layer=2, n_embd=32) and module.lr == 1e-3
    assert {p.device.type for p in module.parameters()} == {"meta"}
    with pytest.raises(ValueError, match=r"instantiator 'os.system'; only lightning.pytorch.cli.instantiate_module"):
        instantiate_on_meta("recipes.gpt:GPTLightning", {**hparams, "_instantiator": "os.system"})


#: Run in a fresh interpreter: for each shard size, the export's peak resident memory above what the process held
#: before it (the kernel's high-water mark, reset just before each export; memory the previous export freed is
#: first handed back to the system, so the allocator cannot serve this one from it unseen).
_MEASURE = """
import ctypes, gc, json, sys
from pathlib import Path
from lightning_hybrid.checkpoint.hf_export import export_hugging_face
from lightning_hybrid.glue.checkpoint_records import module_class_path
from lightning_hybrid.checkpoint.module_class import import_class, instantiate_on_meta
def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))
growths = []
for index, size in enumerate(sys.argv[3:]):
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = status("VmRSS")
    open("/proc/self/clear_refs", "w").write("5")
    export_hugging_face(sys.argv[1], Path(sys.argv[2]) / str(index), "tests.models:LMLightningModule",
                        max_shard_size=int(size))
    growths.append(status("VmHWM") - before)
print(json.dumps(growths))
"""


def _peak_growths(checkpoint: Path, out: Path, *max_shard_sizes: int) -> list[int]:
    """The peak memory growth of each export, measured in one new process (after a warm-up export, so the
    imports an export triggers count before it)."""
    sizes = [str(max_shard_sizes[0]), *map(str, max_shard_sizes)]
    done = subprocess.run([sys.executable, "-c", _MEASURE, str(checkpoint), str(out), *sizes], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])[1:]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable peak RSS")
def test_export_streams_one_shard_at_a_time(tmp_path: Path) -> None:
    """A 104 MiB GPT-2 (largest tensor: the 8 MiB embedding) exported in 8 MB shards grows the process by about
    a shard, the tensor being read and its read buffer, not by the model; in one shard, by the whole model."""
    module = build_module("hf_gpt2", config={"n_embd": 512, "n_layer": 8, "vocab_size": 4096})
    model_bytes = sum(t.numel() * t.element_size() for t in module.state_dict().values()) - 4096 * 512 * 4  # tied
    _write_checkpoint(module, tmp_path / "ckpt")
    del module
    streamed, whole = _peak_growths(tmp_path / "ckpt", tmp_path / "out", 8_000_000, 10**12)
    files = len(list((tmp_path / "out" / "1").glob("*.safetensors")))
    print(f"model {model_bytes / 2**20:.1f} MiB: peak RSS growth {streamed / 2**20:.1f} MiB in 8 MB shards"
          f" ({files} files), {whole / 2**20:.1f} MiB in one")
    assert streamed < 0.4 * model_bytes
    assert whole > model_bytes  # the measurement sees a model that is held whole


@pytest.mark.slow
def test_an_expert_parallel_checkpoint_exports_every_expert_under_its_unmodified_name(tmp_path: Path) -> None:
    """Saved under ep=2 (each rank holding half of every layer's stacked experts): the exported directory holds the
    4 experts of each layer in one tensor, as ``save_pretrained`` writes them, and ``from_pretrained`` loads them."""
    run_script(["--model", "hf_mixtral", "--dp", 2, "--devices", 2, "--steps", 4, "--strategy-kwargs", '{"ep": 2}',
                "--checkpoint-dir", tmp_path / "checkpoints", "--out", tmp_path / "run.pt"])
    checkpoint = tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"
    done = _export_command(checkpoint, tmp_path / "hf", "--hf")
    assert done.returncode == 0, done.stderr
    loaded = _assert_loads_bit_for_bit(tmp_path / "hf", checkpoint, build_module("hf_mixtral"))
    assert loaded.model.layers[0].mlp.experts.gate_up_proj.shape == (4, 128, 32)
