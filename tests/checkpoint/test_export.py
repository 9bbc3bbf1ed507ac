"""Export of a sharded checkpoint to one file (``lightning_hybrid.checkpoint.export``), on checkpoints written in this process.

Sharded layouts (tensor-parallel strided projections, pipeline stages) are exported in ``test_checkpoint.py``.
"""

from __future__ import annotations

from pathlib import Path

import lightning
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

from lightning_hybrid.checkpoint.export import export_checkpoint
from lightning_hybrid.checkpoint.integrity import CHECKSUMS_KEY, file_record
from tests.helpers import run_package_command
from tests.models import build_module



def _sharded_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """A one-rank checkpoint in HybridStrategy's format: DCP folder with the module and optimizer state, meta.pt."""
    module = build_module("llama", seed=3)
    optimizer = torch.optim.AdamW(module.parameters())
    module(torch.zeros(2, 16, dtype=torch.long)).sum().backward()
    optimizer.step()
    dcp.save({"state_dict": module.state_dict(), "optimizer_0": optimizer.state_dict()}, checkpoint_id=folder)
    meta = {"epoch": 1, "global_step": 7, "hyper_parameters": dict(module.hparams),
            "pytorch-lightning_version": lightning.__version__,
            CHECKSUMS_KEY: {".metadata": file_record(folder / ".metadata")}}
    torch.save(meta, folder / "meta.pt")
    return {name: tensor.clone() for name, tensor in module.state_dict().items()}


def test_export_restores_the_plain_module(tmp_path: Path) -> None:
    expected = _sharded_checkpoint(tmp_path / "sharded.ckpt")
    path = export_checkpoint(tmp_path / "sharded.ckpt", tmp_path / "export" / "model.ckpt")
    exported = torch.load(path, weights_only=False)
    assert exported["global_step"] == 7 and "optimizer_0" not in exported
    assert CHECKSUMS_KEY not in exported  # the sharded folder's records describe no file of the export
    restored = type(build_module("llama")).load_from_checkpoint(path)
    for name, tensor in expected.items():
        assert torch.equal(restored.state_dict()[name], tensor), name
    assert [p.name for p in path.parent.iterdir()] == ["model.ckpt"]  # no temporary file left behind


def test_command_line_export_to_safetensors(tmp_path: Path) -> None:
    expected = _sharded_checkpoint(tmp_path / "sharded.ckpt")
    done = run_package_command(["export", tmp_path / "sharded.ckpt", tmp_path / "model.safetensors", "--safetensors"])
    assert done.returncode == 0, done.stderr
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert tensors.keys() == expected.keys()
    assert all(torch.equal(tensors[name], tensor) for name, tensor in expected.items())


def test_export_of_something_else_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"is not a sharded HybridStrategy checkpoint: expected a folder"):
        export_checkpoint(tmp_path / "model.ckpt", tmp_path / "out.ckpt")
    done = run_package_command(["export", tmp_path, tmp_path / "o"])
    assert done.returncode == 2 and "is not a sharded HybridStrategy checkpoint" in done.stderr
    assert not (tmp_path / "o").exists()
