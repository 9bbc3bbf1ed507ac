"""Checksums of a sharded checkpoint's files: a truncated or garbled shard found before loading, and named.

DCP reads tensors by offset and length from each ``.distcp`` file and checks nothing else: a shard cut short fails
with an error that names no file, and changed bytes inside a tensor load silently as wrong weights. So every rank
records the size and CRC-32 of the files it wrote, rank 0 keeps them all in ``checksums.json`` inside the folder,
and a load first checks them, each rank a share of the files, and refuses a damaged checkpoint on every rank with
the files named and the checkpoint beside it to resume from instead. Folders written before checksums existed (no
``checksums.json``) load unchecked.

Example::

    save_sharded(shards, partial)
    record_checksums(partial, global_rank)          # every rank, after its shard is written
    ...
    damaged = damaged_files(path)                   # every rank, before loading
    if damaged:
        raise DamagedCheckpointError(damaged_message(path, damaged))
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import torch.distributed as dist

from lightning_hybrid._compat import lightning_metadata_path

CHECKSUMS_FILE = "checksums.json"
_READ_BYTES = 16 * 1024 * 1024


class DamagedCheckpointError(RuntimeError):
    """A checkpoint file is missing, shorter or longer than written, or its bytes changed."""


def file_record(path: Path) -> dict[str, int]:
    """Size and CRC-32 of one file, read in pieces so a shard of any size needs little memory."""
    crc = 0
    with open(path, "rb") as stream:
        while piece := stream.read(_READ_BYTES):
            crc = zlib.crc32(piece, crc)
    return {"bytes": path.stat().st_size, "crc32": crc}


def record_checksums(folder: Path, global_rank: int) -> None:
    """Gather every rank's shard files' records on rank 0, which writes them, with its own metadata files, to
    ``folder/checksums.json``. Every rank calls, after ``dcp.save`` and after rank 0 wrote Lightning's metadata."""
    rank = dist.get_rank() if dist.is_initialized() else 0  # DCP names a shard after the rank in the default group
    own = {path.name: file_record(path) for path in sorted(folder.glob(f"__{rank}_*.distcp"))}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())] if dist.is_initialized() else [own]
    if dist.is_initialized():
        dist.all_gather_object(gathered, own)
    if global_rank != 0:
        return
    _write_records(folder, {name: record for shard_records in gathered for name, record in shard_records.items()})


def record_all_checksums(folder: Path) -> None:
    """Rank 0 alone records every file of ``folder``: an asynchronous save is published from rank 0's writing
    thread once every rank's write is complete, where no collective may run."""
    _write_records(folder, {path.name: file_record(path) for path in sorted(folder.glob("*.distcp"))})


def _write_records(folder: Path, records: dict[str, dict[str, int]]) -> None:
    for path in (folder / ".metadata", lightning_metadata_path(folder)):
        records[path.name] = file_record(path)
    (folder / CHECKSUMS_FILE).write_text(json.dumps(records, indent=1, sort_keys=True))


def damaged_files(folder: Path) -> list[str]:
    """The files of ``folder`` that do not match their records, each with what is wrong (the same list on every
    rank; every rank calls). Each rank reads its share of the files. Empty when nothing is recorded."""
    listed = folder / CHECKSUMS_FILE
    records: dict[str, dict[str, int]] = json.loads(listed.read_text()) if listed.exists() else {}
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [_problem(folder / name, records[name]) for name in sorted(records)[rank::world]]
    problems = [[problem for problem in mine if problem]]
    if dist.is_initialized():
        problems = [[] for _ in range(world)]
        dist.all_gather_object(problems, [problem for problem in mine if problem])
    return sorted(problem for rank_problems in problems for problem in rank_problems)


def _problem(path: Path, record: dict[str, int]) -> str:
    if not path.exists():
        return f"{path.name} (missing)"
    found = file_record(path)
    if found["bytes"] != record["bytes"]:
        return f"{path.name} ({found['bytes']} bytes, {record['bytes']} written: truncated or overwritten)"
    if found["crc32"] != record["crc32"]:
        return f"{path.name} (its bytes changed since it was written: CRC-32 {found['crc32']:08x}, was" \
               f" {record['crc32']:08x})"
    return ""


def damaged_message(folder: Path, damaged: list[str]) -> str:
    return (f"The checkpoint {folder} is damaged: {'; '.join(damaged)}. Nothing was loaded. {resume_hint(folder)}")


def resume_hint(checkpoint: Path) -> str:
    """Which other checkpoint beside ``checkpoint`` to resume from: the newest complete one (a folder with
    Lightning's metadata, or a file) of the same directory."""
    others = [
        path for path in checkpoint.parent.glob("*.ckpt")
        if path != checkpoint and (path.is_file() or lightning_metadata_path(path).is_file())
    ]
    if not others:
        return f"No other checkpoint is in {checkpoint.parent}: training can only start again from the beginning."
    others.sort(key=lambda path: path.stat().st_mtime, reverse=True)
    return f'Resume from an earlier checkpoint instead: ckpt_path="{others[0]}" (the newest other one there).'
