"""Checksums of a checkpoint folder's files (one process): damage of every kind named, the checkpoint to use
instead found beside it."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning_hybrid.checkpoint.integrity import CHECKSUMS_FILE, damaged_files, record_checksums, resume_hint


def _checkpoint(folder: Path, shard_bytes: bytes = b"\x01" * 5000) -> Path:
    """A folder shaped as a one-rank sharded checkpoint (shard, DCP metadata, Lightning's meta.pt), recorded."""
    folder.mkdir()
    (folder / "__0_0.distcp").write_bytes(shard_bytes)
    (folder / ".metadata").write_bytes(b"dcp metadata")
    torch.save({"global_step": 4}, folder / "meta.pt")
    record_checksums(folder, global_rank=0)
    return folder


def test_intact_folder_passes_and_each_kind_of_damage_is_named(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert (folder / CHECKSUMS_FILE).is_file() and damaged_files(folder) == []
    shard = folder / "__0_0.distcp"
    shard.write_bytes(b"\x01" * 2500 + b"\x02" + b"\x01" * 2499)  # one byte changed, same size
    [changed] = damaged_files(folder)
    assert changed.startswith("__0_0.distcp (its bytes changed since it was written: CRC-32 ")
    shard.write_bytes(b"\x01" * 1000)
    assert damaged_files(folder) == ["__0_0.distcp (1000 bytes, 5000 written: truncated or overwritten)"]
    (folder / "meta.pt").unlink()
    assert damaged_files(folder)[1] == "meta.pt (missing)"


def test_folder_without_records_loads_unchecked(tmp_path: Path) -> None:
    folder = _checkpoint(tmp_path / "old.ckpt")
    (folder / CHECKSUMS_FILE).unlink()
    (folder / "__0_0.distcp").write_bytes(b"")
    assert damaged_files(folder) == []


def test_the_newest_other_complete_checkpoint_is_suggested(tmp_path: Path) -> None:
    older, newer, damaged = (_checkpoint(tmp_path / name) for name in ("e0.ckpt", "e1.ckpt", "last.ckpt"))
    os.utime(older, (1, 1))
    (tmp_path / "e2.ckpt.partial").mkdir()  # a save cut short: not a checkpoint
    assert resume_hint(damaged) == f'Resume from an earlier checkpoint instead: ckpt_path="{newer}" (the newest' \
                                   " other one there)."
    assert resume_hint(tmp_path / "alone" / "x.ckpt") == (
        f"No other checkpoint is in {tmp_path / 'alone'}: training can only start again from the beginning.")
