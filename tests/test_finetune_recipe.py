"""recipes/finetune_hf.py at cluster scale, checked in-process without training: the attention kernel is an option
of the module, the stand-in checkpoint is written once and atomically under any launcher, and the export and the CPU
evaluation after ``fit`` can be turned off."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import Trainer

from recipes import finetune_hf

CONFIG_DIR = Path(finetune_hf.DEFAULT_CONFIG).parent
TINY_LLAMA: dict[str, Any] = yaml.safe_load(finetune_hf.DEFAULT_CONFIG.read_text())["tiny_llama"]
LAUNCHER_VARIABLES = ("RANK", "SLURM_PROCID", "LOCAL_RANK", "NODE_RANK")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("checkpoints") / "pretrained"
    finetune_hf.write_pretrained(folder, TINY_LLAMA, seed=0)
    return folder


# ------------------------------------------------------------------------------------------ attention kernel
@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_the_model_and_the_evaluation_use_the_modules_attention_kernel(
    kernel: str, pretrained: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    module = finetune_hf.FineTune(str(pretrained), attn_implementation=kernel)
    module.configure_model()
    assert module.hparams.attn_implementation == kernel
    assert module.model.config._attn_implementation == kernel

    loaded: list[Any] = []
    real_from_pretrained = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: loaded.append(real_from_pretrained(*args, **kwargs)) or loaded[-1])
    loader = finetune_hf.InstructionData(batch_size=8, samples=40).val_dataloader()
    loss, accuracy = finetune_hf.evaluate(pretrained, loader, kernel)
    assert [model.config._attn_implementation for model in loaded] == [kernel]
    assert loss > 0 and 0 <= accuracy <= 1


def test_sdpa_is_the_default_and_evaluates_as_eager_does(pretrained: Path) -> None:
    assert finetune_hf.FineTune(str(pretrained)).hparams.attn_implementation == "sdpa"
    loader = finetune_hf.InstructionData(batch_size=8, samples=40).val_dataloader()
    sdpa, eager = (finetune_hf.evaluate(pretrained, loader, kernel) for kernel in ("sdpa", "eager"))
    assert sdpa == pytest.approx(eager, rel=1e-4)  # the same model: the kernels differ in rounding only


# -------------------------------------------------------------------------------------- stand-in checkpoint
@pytest.mark.parametrize(("environ", "first"), [
    ({}, True),                                          # plain python: Lightning's launcher, before its children
    ({"LOCAL_RANK": "1"}, False),                        # a child Lightning's launcher started
    ({"LOCAL_RANK": "0", "NODE_RANK": "1"}, False),      # Lightning's launcher on the second node
    ({"RANK": "0", "LOCAL_RANK": "0"}, True),            # torchrun
    ({"RANK": "3", "LOCAL_RANK": "3"}, False),
    ({"SLURM_PROCID": "0"}, True),                       # srun
    ({"SLURM_PROCID": "9", "LOCAL_RANK": "0"}, False),
    ({"RANK": "0", "SLURM_PROCID": "1"}, True),          # torchrun inside a SLURM job: torchrun's rank counts
    ({"RANK": "2", "SLURM_PROCID": "0"}, False),
])
def test_the_first_process_is_global_rank_zero_under_every_launcher(environ: dict[str, str], first: bool) -> None:
    assert finetune_hf.is_first_process(environ) is first


def test_rank_zero_writes_the_checkpoint_into_place_in_one_rename(tmp_path: Path) -> None:
    folder = tmp_path / "out" / "pretrained"
    finetune_hf.create_pretrained(folder, TINY_LLAMA, seed=0, environ={"RANK": "0"})
    assert finetune_hf.is_complete_checkpoint(folder)
    assert [path.name for path in folder.parent.iterdir()] == ["pretrained"]  # no partial folder left behind
    written = {path.name: path.stat().st_mtime_ns for path in folder.iterdir()}
    finetune_hf.create_pretrained(folder, TINY_LLAMA, seed=0, environ={"RANK": "0"})  # a restart: nothing rewritten
    assert {path.name: path.stat().st_mtime_ns for path in folder.iterdir()} == written


def test_a_second_writer_loses_the_rename_harmlessly(tmp_path: Path, pretrained: Path) -> None:
    """Two first processes (Lightning's launcher started on two nodes sharing the disk): the later rename fails onto
    the complete folder, which stays as the first wrote it."""
    folder = tmp_path / "pretrained"
    finetune_hf.write_pretrained(folder, TINY_LLAMA, seed=0)
    written = {path.name: path.read_bytes() for path in folder.iterdir()}
    finetune_hf.write_pretrained(folder, TINY_LLAMA, seed=1)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == written
    assert [path.name for path in tmp_path.iterdir()] == ["pretrained"]


def test_other_ranks_wait_until_rank_zero_has_written_it(tmp_path: Path) -> None:
    folder = tmp_path / "pretrained"
    writer = threading.Timer(1.0, finetune_hf.write_pretrained, (folder, TINY_LLAMA, 0))
    writer.start()
    try:
        finetune_hf.create_pretrained(folder, TINY_LLAMA, seed=0, environ={"SLURM_PROCID": "5"}, timeout_s=30)
        assert finetune_hf.is_complete_checkpoint(folder)
    finally:
        writer.join()


def test_other_ranks_give_up_after_the_timeout_with_a_clear_error(tmp_path: Path) -> None:
    folder = tmp_path / "pretrained"
    folder.mkdir()
    (folder / "config.json").write_text("{}")  # config.json without weights is not a checkpoint yet
    with pytest.raises(TimeoutError, match=r"global rank 0 .*pretrained.*--pretrained DIR"):
        finetune_hf.create_pretrained(folder, TINY_LLAMA, seed=0, environ={"RANK": "1"}, timeout_s=0.2)


# ------------------------------------------------------------------------------------ after fit: --export/--evaluate
def run_without_training(args: list[str], out: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[Any]]:
    """The recipe's ``fit`` with Trainer.fit and save_checkpoint replaced: what after_fit then saves, exports and
    evaluates."""
    from lightning_hybrid.checkpoint import hf_export

    calls: dict[str, list[Any]] = {"save": [], "export": [], "evaluate": [], "fit": []}

    @functools.wraps(Trainer.fit)  # LightningCLI reads fit's options from its signature
    def no_fit(trainer: Trainer, **kwargs: Any) -> None:
        calls["fit"].append((trainer.checkpoint_callbacks, kwargs["ckpt_path"]))

    def export(checkpoint: Path, output: Path, replace: bool) -> Path:
        calls["export"].append((checkpoint, output, replace))
        return output

    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(Trainer, "fit", no_fit)
    monkeypatch.setattr(Trainer, "save_checkpoint", lambda trainer, path: calls["save"].append(path))
    monkeypatch.setattr(hf_export, "export_hugging_face", export)
    monkeypatch.setattr(finetune_hf, "evaluate", lambda *args: calls["evaluate"].append(args) or (1.0, 0.5))
    finetune_hf.main(["--out", str(out), *args])
    return calls


def test_after_fit_exports_and_evaluates_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    calls = run_without_training([], tmp_path, monkeypatch)
    assert calls["save"] == [tmp_path / "checkpoint.ckpt"]
    assert calls["export"] == [(tmp_path / "checkpoint.ckpt", tmp_path / "hf", True)]  # a restart exports again
    assert [(folder, kernel) for folder, _, kernel in calls["evaluate"]] == [
        (tmp_path / "pretrained", "sdpa"), (tmp_path / "hf", "sdpa")]
    assert "fine-tuned:  val loss 1.000" in capsys.readouterr().out


def test_periodic_checkpoints_go_to_the_out_folder_where_a_restarted_job_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = run_without_training(["--evaluate", "false", "--checkpoint.every_n_train_steps", "7"], tmp_path,
                                 monkeypatch)
    ((callbacks, ckpt_path),) = calls["fit"]
    assert ckpt_path == "last"  # a first attempt finds none and starts from the pretrained weights
    ((checkpoint,),) = [callbacks]
    assert (Path(checkpoint.dirpath), checkpoint.save_last, checkpoint.save_top_k) == (tmp_path / "checkpoints",
                                                                                       True, 2)
    assert "'every_n_train_steps': 7" in checkpoint.state_key  # the public view of its cadence


@pytest.mark.parametrize(("args", "exports"), [(["--evaluate", "false"], 1),
                                               (["--evaluate", "false", "--export", "false"], 0)])
def test_evaluate_false_skips_the_cpu_evaluation_and_export_false_the_export(
    args: list[str], exports: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = run_without_training([*args, "--model.attn_implementation", "eager"], tmp_path, monkeypatch)
    assert calls["save"] == [tmp_path / "checkpoint.ckpt"]  # the sharded checkpoint is always written
    assert (len(calls["export"]), calls["evaluate"]) == (exports, [])


def test_evaluate_without_export_is_refused_before_anything_runs(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="needs --export true"):
        run_without_training(["--export", "false"], tmp_path, monkeypatch)
    assert not (tmp_path / "pretrained").exists()


@pytest.mark.parametrize("name", ["llama3_8b_1x8_h100.yaml", "llama3_70b_4x8_h100.yaml"])
def test_the_llama_cluster_configs_export_but_skip_the_cpu_evaluation(name: str) -> None:
    config = yaml.safe_load((CONFIG_DIR / name).read_text())
    assert (config["export"], config["evaluate"], config["model"]["attn_implementation"]) == (True, False, "sdpa")
