"""Checksums of a checkpoint folder's files (one process): damage of every kind named, the records kept inside
Lightning's ``meta.pt`` so the folder holds Lightning's files only, older folders' ``checksums.json`` still checked,
the checkpoint to use instead found beside it."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

from lightning_hybrid import HybridStrategy
from lightning_hybrid.checkpoint.integrity import (
    CHECKSUMS_KEY,
    DamagedCheckpointError,
    damaged_files,
    file_record,
    gather_checksums,
    resume_hint,
)


def _checkpoint(folder: Path, shard_bytes: bytes = b"\x01" * 5000) -> Path:
    """A folder shaped as a one-rank sharded checkpoint (shard, DCP metadata, Lightning's meta.pt with the records),
    written in the order a save writes it."""
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(shard_bytes)
    (folder / ".metadata").write_bytes(b"dcp metadata")
    torch.save({"global_step": 4, CHECKSUMS_KEY: gather_checksums(folder, global_rank=0)}, folder / "meta.pt")
    return folder


def _metadata(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "meta.pt", weights_only=True)


def test_intact_folder_passes_and_each_kind_of_damage_is_named(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp", "meta.pt"]
    assert _metadata(folder)[CHECKSUMS_KEY] == {
        "__0_0.distcp": {"bytes": 5000, "crc32": file_record(folder / "__0_0.distcp")["crc32"]},
        ".metadata": {"bytes": 12, "crc32": file_record(folder / ".metadata")["crc32"]},
    }
    assert damaged_files(folder, _metadata(folder)) == []
    shard = folder / "__0_0.distcp"
    shard.write_bytes(b"\x01" * 2500 + b"\x02" + b"\x01" * 2499)  # one byte changed, same size
    [changed] = damaged_files(folder, _metadata(folder))
    assert changed.startswith("__0_0.distcp (its bytes changed since it was written: CRC-32 ")
    shard.write_bytes(b"\x01" * 1000)
    assert damaged_files(folder, _metadata(folder)) == [
        "__0_0.distcp (1000 bytes, 5000 written: truncated or overwritten)"]
    (folder / ".metadata").unlink()
    assert damaged_files(folder, _metadata(folder))[0] == ".metadata (missing)"


def test_a_folder_of_the_old_layout_is_checked_against_its_checksums_json(tmp_path: Path) -> None:
    folder = tmp_path / "old.ckpt"
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(b"\x01" * 5000)
    (folder / ".metadata").write_bytes(b"dcp metadata")
    torch.save({"global_step": 4}, folder / "meta.pt")
    records = {path.name: file_record(path) for path in folder.iterdir()}  # meta.pt included, as it was then
    (folder / "checksums.json").write_text(json.dumps(records, indent=1, sort_keys=True))
    assert damaged_files(folder, _metadata(folder)) == []
    (folder / "__0_0.distcp").write_bytes(b"\x01" * 4999)
    torch.save({"global_step": 5}, folder / "meta.pt")
    [shard, meta] = damaged_files(folder, _metadata(folder))
    assert shard == "__0_0.distcp (4999 bytes, 5000 written: truncated or overwritten)"
    assert meta.startswith("meta.pt (")


def test_folder_without_records_loads_unchecked(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "old.ckpt")
    torch.save({"global_step": 4}, folder / "meta.pt")
    (folder / "__0_0.distcp").write_bytes(b"")
    assert damaged_files(folder, _metadata(folder)) == []


def test_the_newest_other_complete_checkpoint_is_suggested(tmp_path: Path) -> None:
    older, newer, damaged = (_checkpoint(tmp_path / name) for name in ("e0.ckpt", "e1.ckpt", "last.ckpt"))
    os.utime(older, (1, 1))
    (tmp_path / "e2.ckpt.partial").mkdir()  # a save cut short: not a checkpoint
    assert resume_hint(damaged) == f'Resume from an earlier checkpoint instead: ckpt_path="{newer}" (the newest' \
                                   " other one there)."
    assert resume_hint(tmp_path / "alone" / "x.ckpt") == (
        f"No other checkpoint is in {tmp_path / 'alone'}: training can only start again from the beginning.")


# ---------------------------------------------------------------------------- saved and loaded by the strategy
class _Resumed(BoringModel):
    """Keeps the checkpoint dict Lightning hands to the module on resume."""

    loaded: dict[str, Any] = {}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.loaded = checkpoint


def _fit(folder: Path, max_steps: int, ckpt_path: Path | None = None) -> tuple[_Resumed, ModelCheckpoint]:
    module, saved = _Resumed(), ModelCheckpoint(dirpath=folder)
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), max_steps=max_steps,
                      limit_val_batches=0, logger=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[saved])
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, saved


@pytest.mark.usefixtures("one_process_fit")
def test_the_strategys_folder_holds_lightnings_files_only_and_is_checked_on_resume(tmp_path: Path) -> None:
    _, saved = _fit(tmp_path / "checkpoints", max_steps=2)
    folder = Path(saved.best_model_path)
    # Lightning's layout (its test_save_load_sharded_state_dict asserts the set): no file of our own beside it.
    assert folder.name == "epoch=0-step=2.ckpt" and sorted(os.listdir(folder)) == [".metadata", "__0_0.distcp",
                                                                                   "meta.pt"]
    metadata = _metadata(folder)  # Lightning's own load of it (weights_only) reads the records too
    assert metadata["global_step"] == 2
    assert metadata[CHECKSUMS_KEY] == {name: file_record(folder / name) for name in (".metadata", "__0_0.distcp")}
    resumed, _ = _fit(tmp_path / "resumed", max_steps=3, ckpt_path=folder)
    assert resumed.loaded["global_step"] == 2 and CHECKSUMS_KEY not in resumed.loaded  # handed over without it
    assert resumed.trainer.global_step == 3
    shard = folder / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(DamagedCheckpointError, match=rf"is damaged: __0_0\.distcp \(1000 bytes,"
                                                     rf" {metadata[CHECKSUMS_KEY]['__0_0.distcp']['bytes']} written"):
        _fit(tmp_path / "refused", max_steps=3, ckpt_path=folder)
