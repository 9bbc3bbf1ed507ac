"""recipes/launch/torchrun.sh and recipes/launch/slurm.sbatch run the recipe named by ``RECIPE`` (the pretraining
recipe by default): each script is run with bash, ``python`` (torchrun's entry) or ``srun`` replaced on ``PATH`` by
a stub that records its arguments, so the command line each would start is checked without starting anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = REPO_ROOT / "recipes" / "launch" / "torchrun.sh"
SBATCH = REPO_ROOT / "recipes" / "launch" / "slurm.sbatch"
#: What SLURM sets in a job of 4 nodes × 8 tasks that the script reads.
SLURM_JOB = {"SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "8", "SLURM_NTASKS_PER_NODE": "8", "SLURM_NNODES": "4"}


def launched(script: Path, stub: str, tmp_path: Path, args: list[str], **environment: str) -> list[str]:
    """The arguments ``stub`` (a command on PATH) receives when bash runs ``script args`` in the repository root."""
    bin_dir, record = tmp_path / "bin", tmp_path / f"{stub}.args"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / stub).write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > "{record}"\n')
    (bin_dir / stub).chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key not in ("RECIPE", "PYTHON", "NNODES")}
    env.update(environment, PATH=f"{bin_dir}{os.pathsep}{env['PATH']}")
    done = subprocess.run(["bash", str(script), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return record.read_text().splitlines()


@pytest.mark.parametrize("script", [TORCHRUN, SBATCH], ids=lambda path: path.name)
def test_launch_scripts_are_valid_bash(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_torchrun_starts_the_pretraining_recipe_by_default(tmp_path: Path) -> None:
    args = launched(TORCHRUN, "python", tmp_path, ["--trainer.max_steps", "5"])
    assert args == ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "4", "--max-restarts", "3",
                    "--standalone", "recipes/pretrain_gpt.py", "fit", "--ckpt_path", "last",
                    "--trainer.max_steps", "5", "--trainer.devices", "4", "--trainer.num_nodes", "1"]


def test_torchrun_starts_the_recipe_named_by_RECIPE_with_the_processes_after_the_config(tmp_path: Path) -> None:
    config = "recipes/configs/llama3_8b_1x8_h100.yaml"
    args = launched(TORCHRUN, "python", tmp_path, ["--config", config], RECIPE="recipes/finetune_hf.py",
                    NPROC_PER_NODE="8", NNODES="2", RDZV_ENDPOINT="node0:29400")
    recipe_args = args[args.index("recipes/finetune_hf.py"):]
    assert recipe_args == ["recipes/finetune_hf.py", "fit", "--ckpt_path", "last", "--config", config,
                           "--trainer.devices", "8", "--trainer.num_nodes", "2"]
    assert args[args.index("--rdzv-endpoint") + 1] == "node0:29400"
    assert args[args.index("--nproc-per-node") + 1] == "8"


@pytest.mark.parametrize("script", [TORCHRUN, SBATCH], ids=lambda path: path.name)
def test_a_missing_recipe_fails_before_any_process_starts(script: Path, tmp_path: Path) -> None:
    env = {**os.environ, **SLURM_JOB, "RECIPE": "recipes/no_such_recipe.py"}
    done = subprocess.run(["bash", str(script)], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "RECIPE=recipes/no_such_recipe.py: no such file" in done.stderr


@pytest.mark.parametrize("recipe", [None, "recipes/finetune_hf.py"])
def test_sbatch_script_runs_srun_with_the_recipe_and_the_jobs_shape(recipe: str | None, tmp_path: Path) -> None:
    environment = {**SLURM_JOB, **({"RECIPE": recipe} if recipe else {})}
    args = launched(SBATCH, "srun", tmp_path, ["--config", "recipes/configs/llama3_70b_4x8_h100.yaml"],
                    **environment)
    assert args == ["--kill-on-bad-exit=1", "--distribution=block", "--cpus-per-task=8", "python",
                    recipe or "recipes/pretrain_gpt.py", "fit", "--ckpt_path", "last",
                    "--config", "recipes/configs/llama3_70b_4x8_h100.yaml",
                    "--trainer.devices", "8", "--trainer.num_nodes", "4"]
