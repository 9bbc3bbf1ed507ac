"""Checksums of a sharded checkpoint's files: a truncated or garbled shard found before loading, and named.

DCP reads tensors by offset and length from each ``.distcp`` file and checks nothing else: a shard cut short fails
with an error that names no file, and changed bytes inside a tensor load silently as wrong weights. So every rank
records the size and CRC-32 of the shard files it wrote, rank 0 gathers them with DCP's ``.metadata`` and keeps them
in Lightning's ``meta.pt`` under :data:`CHECKSUMS_KEY`, and a load first checks them, each rank a share of the
files, and refuses a damaged checkpoint on every rank with the files named and the checkpoint beside it to resume
from instead. The records live inside ``meta.pt`` so the folder holds exactly the files of Lightning's layout
(``meta.pt``, ``.metadata``, ``__<rank>_<n>.distcp``), which Lightning's own tests assert.

``meta.pt`` cannot record its own checksum, so it is not checked: a damaged one fails to unpickle (the load's
"Could not read the checkpoint" error), a changed byte that still unpickles goes unnoticed. Folders written before
the records moved into ``meta.pt`` keep them in ``checksums.json`` beside the files (``meta.pt`` included) and are
checked against it; folders with neither load unchecked.

Example::

    save_sharded(shards, partial)
    records = gather_checksums(partial, global_rank)    # every rank, after its shard is written; None off rank 0
    if global_rank == 0:
        torch.save({**metadata, CHECKSUMS_KEY: records}, lightning_metadata_path(partial))
    ...
    metadata = torch.load(lightning_metadata_path(path))
    damaged = damaged_files(path, metadata)             # every rank, before loading
    if damaged:
        raise DamagedCheckpointError(damaged_message(path, damaged))
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from lightning_hybrid._compat import lightning_metadata_path

#: Key of the records in Lightning's ``meta.pt`` dict: ``{file name: {"bytes": size, "crc32": CRC-32}}`` for each
#: ``.distcp`` file and ``.metadata``. Removed before the dict is handed to Lightning.
CHECKSUMS_KEY = "lightning_hybrid_checksums"
#: Where folders written by lightning-hybrid before the records moved into ``meta.pt`` keep them.
_OLD_CHECKSUMS_FILE = "checksums.json"
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


def gather_checksums(folder: Path, global_rank: int) -> Optional[dict[str, dict[str, int]]]:
    """Every rank's shard files' records with DCP's ``.metadata``, on rank 0 (``None`` on the other ranks), for
    rank 0 to write into ``meta.pt``. Every rank calls, after ``dcp.save`` returned: then every shard and
    ``.metadata`` are on disk, and ``meta.pt``, written after this, is written once and complete."""
    rank = dist.get_rank() if dist.is_initialized() else 0  # DCP names a shard after the rank in the default group
    own = {path.name: file_record(path) for path in sorted(folder.glob(f"__{rank}_*.distcp"))}
    gathered: list[dict] = [{} for _ in range(dist.get_world_size())] if dist.is_initialized() else [own]
    if dist.is_initialized():
        dist.all_gather_object(gathered, own)
    if global_rank != 0:
        return None
    shards = {name: record for shard_records in gathered for name, record in shard_records.items()}
    return _with_dcp_metadata(folder, shards)


def all_checksums(folder: Path) -> dict[str, dict[str, int]]:
    """Rank 0 alone records every file of ``folder`` but ``meta.pt``: an asynchronous save is published from rank
    0's writing thread once every rank's write is complete, where no collective may run."""
    return _with_dcp_metadata(folder, {path.name: file_record(path) for path in sorted(folder.glob("*.distcp"))})


def _with_dcp_metadata(folder: Path, records: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    records[".metadata"] = file_record(folder / ".metadata")
    return records


def damaged_files(folder: Path, metadata: dict[str, Any]) -> list[str]:
    """The files of ``folder`` that do not match their records, each with what is wrong (the same list on every
    rank; every rank calls). ``metadata`` is the folder's ``meta.pt`` as loaded. Each rank reads its share of the
    files. Empty when nothing is recorded."""
    records = _recorded(folder, metadata)
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    mine = [_problem(folder / name, records[name]) for name in sorted(records)[rank::world]]
    problems = [[problem for problem in mine if problem]]
    if dist.is_initialized():
        problems = [[] for _ in range(world)]
        dist.all_gather_object(problems, [problem for problem in mine if problem])
    return sorted(problem for rank_problems in problems for problem in rank_problems)


def _recorded(folder: Path, metadata: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The records in ``meta.pt``, else those an older version wrote to ``checksums.json``, else none."""
    if CHECKSUMS_KEY in metadata:
        return metadata[CHECKSUMS_KEY]
    old = folder / _OLD_CHECKSUMS_FILE
    return json.loads(old.read_text()) if old.exists() else {}


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
