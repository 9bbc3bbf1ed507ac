"""Asynchronous checkpoint saves (``HybridStrategy(async_checkpoint=True)``).

In one process (a gloo group of one rank, DCP writes held back by an event): a save returns before its write,
writes what the tensors held when it was called, is published only when the write is done, at most one is in
flight, a removal of the one in flight waits for it, a failed write is never published. In two-rank fits: the
asynchronous checkpoints equal the synchronous ones while training goes on during the writes (bit-exact), a rank
killed mid-write leaves only ``.partial`` and ``ckpt_path="last"`` resumes from the previous complete checkpoint,
continuing exactly as the uninterrupted run.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from lightning_hybrid import HybridStrategy
from lightning_hybrid.checkpoint.async_save import AsyncSaves, wait_if_writing
from lightning_hybrid.checkpoint.export import load_module_state
from lightning_hybrid.checkpoint.integrity import CHECKSUMS_KEY, file_record
from lightning_hybrid.checkpoint.dcp_io import partial_checkpoint_path
from tests.helpers import ScriptError, run_script, run_sweep
from tests.observe.test_counting import one_rank_group  # noqa: F401  (the fixture)


@pytest.fixture()
def held_writes(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Semaphore]:
    """Every DCP write waits for a permit: ``held_writes.release()`` lets one through."""
    permits, original = threading.Semaphore(0), FileSystemWriter.write_data

    def write_data(*args: Any, **kwargs: Any) -> Any:
        assert permits.acquire(timeout=60), "the test never let the write through"
        return original(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    yield permits
    permits.release(10)  # a test that failed with writes held must not leave them blocked


@pytest.fixture()
def saves(one_rank_group: None) -> Iterator[AsyncSaves]:  # noqa: F811
    saves = AsyncSaves(dist.new_group(backend="gloo"), torch.device("cpu"))
    yield saves
    with contextlib.suppress(RuntimeError):
        saves.wait()  # before the process group goes


def _start(saves: AsyncSaves, path: Path, weight: torch.Tensor, epoch: int) -> None:
    partial = partial_checkpoint_path(path)
    partial.mkdir(parents=True)
    saves.start({"state_dict": {"weight": weight}}, partial, path, {"epoch": epoch})


def _in_thread(call: Callable[[], None]) -> threading.Thread:
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=0.5)  # long enough for a call that does not wait to return
    return thread


def test_a_save_returns_before_its_write_and_publishes_what_the_tensors_held(
    saves: AsyncSaves, held_writes: threading.Semaphore, tmp_path: Path
) -> None:
    path, weight = tmp_path / "a.ckpt", torch.arange(6.0)
    _start(saves, path, weight, epoch=3)
    assert saves.pending_path == path and not path.exists()
    weight.add_(100.0)  # training changes the parameter while the write waits
    held_writes.release()
    saves.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.ckpt"]
    # Lightning's files only: the records of the files written in the background are inside meta.pt.
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp", "meta.pt"]
    metadata = torch.load(path / "meta.pt")
    assert metadata["epoch"] == 3
    assert metadata[CHECKSUMS_KEY] == {name: file_record(path / name) for name in (".metadata", "__0_0.distcp")}
    assert torch.equal(load_module_state(path)["weight"], torch.arange(6.0))


def test_one_save_in_flight_and_a_removal_of_it_waits_for_its_publish(
    saves: AsyncSaves, held_writes: threading.Semaphore, tmp_path: Path
) -> None:
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    _start(saves, first, torch.zeros(2), epoch=0)
    wait_if_writing(saves, second)  # not the one in flight: returns at once
    next_save = _in_thread(lambda: _start(saves, second, torch.ones(2), epoch=1))
    assert next_save.is_alive() and saves.pending_path == first  # the next save waits for the first write
    held_writes.release()
    next_save.join(timeout=30)
    assert (first / "meta.pt").is_file() and saves.pending_path == second
    removal = _in_thread(lambda: wait_if_writing(saves, second))
    assert removal.is_alive() and not second.exists()
    held_writes.release()
    removal.join(timeout=30)
    assert not removal.is_alive() and (second / "meta.pt").is_file()  # published before it may be removed
    assert torch.equal(load_module_state(second)["weight"], torch.ones(2))


def test_a_failed_write_is_never_published_and_is_raised_or_logged(
    saves: AsyncSaves, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def full_disk(*args: Any, **kwargs: Any) -> Any:
        raise OSError("No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", full_disk)
    path = tmp_path / "a.ckpt"
    _start(saves, path, torch.zeros(2), epoch=0)
    with pytest.raises(RuntimeError, match=r"The asynchronous save of .*a.ckpt did not complete .*it was not published:"
                                           r" only .*a.ckpt.partial is left.*ckpt_path='last'"):
        saves.wait()
    assert not path.exists() and not (partial_checkpoint_path(path) / "meta.pt").exists()
    # After an exception in training the save in flight is waited for and its outcome logged, nothing raised.
    _start(saves, tmp_path / "b.ckpt", torch.zeros(2), epoch=0)
    with caplog.at_level(logging.ERROR):
        saves.on_exception(None, None, RuntimeError("a step failed"))  # type: ignore[arg-type]
    assert "The asynchronous save of" in caplog.text and "b.ckpt.partial is left" in caplog.text
    assert saves.pending_path is None and not (tmp_path / "b.ckpt").exists()


def test_async_checkpoint_needs_distributed_checkpoints() -> None:
    with pytest.raises(ValueError, match=r"async_checkpoint=True, save_distributed_checkpoint=False.*Keep"
                                         r" save_distributed_checkpoint=True, or pass async_checkpoint=False"):
        HybridStrategy(async_checkpoint=True, save_distributed_checkpoint=False)
    with pytest.raises(ValueError, match=r"async_checkpoint='yes'\) is invalid"):
        HybridStrategy(async_checkpoint="yes")  # type: ignore[arg-type]
    assert HybridStrategy(async_checkpoint=True).options.async_checkpoint


# ----------------------------------------------------------------------------------------------- two-rank fits
#: Two ranks, 10 steps: epoch ends at steps 4, 8 and 10, each saving its checkpoint and ModelCheckpoint's last.ckpt.
RUN = ["--model", "gpt", "--layers", 2, "--dp", 2, "--devices", 2, "--steps", 10]
ASYNC = ["--strategy-kwargs", '{"async_checkpoint": true}']
#: Every write starts this late, so training steps run while an asynchronous save writes.
SLOW_WRITE_S = 1.0
CHECKPOINTS = ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "epoch=2-step=10.ckpt", "last.ckpt"]
#: The files of each two-rank checkpoint folder, sorted: DCP's metadata, one shard per rank, Lightning's meta.pt.
LIGHTNING_FILES = [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


@pytest.fixture(scope="module")
def async_and_sync(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The same fit with asynchronous and with synchronous saves, in one launch; slow writes."""
    folder = tmp_path_factory.mktemp("async_and_sync")
    entries = [{"async_checkpoint": True, "checkpoint_dir": str(folder / "async")},
               {"checkpoint_dir": str(folder / "sync")}]
    runs = run_sweep([*RUN, "--slow-writes", SLOW_WRITE_S, "--out", folder / "run.pt"], entries)
    return {"async": runs[0], "sync": runs[1], "folder": folder}


def _everything(checkpoint: Path, out: Path) -> dict[str, Any]:
    dcp_to_torch_save(checkpoint, out)  # module and optimizer state, every key, full tensors
    return torch.load(out, weights_only=False)


def _same(a: Any, b: Any) -> bool:
    """Equal nested containers, tensors bit for bit."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_async_saves_write_what_sync_saves_write_while_training_goes_on(async_and_sync: dict, tmp_path: Path) -> None:
    runs, folder = async_and_sync, async_and_sync["folder"]
    assert runs["async"]["losses"] == runs["sync"]["losses"] and len(runs["async"]["losses"]) == 20
    for name in CHECKPOINTS:
        assert sorted(p.name for p in (folder / "async").iterdir()) == CHECKPOINTS  # published, no .partial
        saved = {kind: _everything(folder / kind / name, tmp_path / f"{kind}.pt") for kind in ("async", "sync")}
        assert _same(saved["async"], saved["sync"]), name
        meta = {kind: torch.load(folder / kind / name / "meta.pt", weights_only=False) for kind in ("async", "sync")}
        assert meta["async"]["global_step"] == meta["sync"]["global_step"]
        for kind in ("async", "sync"):  # Lightning's files only; the records in meta.pt match what was written
            assert sorted(p.name for p in (folder / kind / name).iterdir()) == LIGHTNING_FILES, (kind, name)
            assert meta[kind][CHECKSUMS_KEY] == {n: file_record(folder / kind / name / n) for n in LIGHTNING_FILES[:3]}
        assert meta["async"]["loops"] == meta["sync"]["loops"]
    # rank 0's seconds inside save_checkpoint: a synchronous save waits for its write, an asynchronous one returns
    # after copying the shards unless the previous write is still going (last.ckpt right after an epoch's
    # checkpoint waits for it); the fastest of each kind, as one save on a loaded machine can take long.
    save_s = {kind: runs[kind]["checkpoint_seconds"]["save"] for kind in ("async", "sync")}
    print(f"seconds per save, writes {SLOW_WRITE_S} s late: {save_s}")
    assert min(save_s["sync"]) >= SLOW_WRITE_S and min(save_s["async"]) < SLOW_WRITE_S / 2


@pytest.mark.slow
def test_rank_killed_during_an_async_write_leaves_only_partial_and_last_resumes_exactly(
    async_and_sync: dict, tmp_path: Path
) -> None:
    folder = tmp_path / "checkpoints"
    args = [*RUN, *ASYNC, "--checkpoint-dir", folder]
    # Writes: step 4 -> epoch=0-step=4.ckpt, last.ckpt; step 8 -> epoch=1-step=8.ckpt, where rank 1 dies mid-write.
    killed = tmp_path / "killed.pt"
    with pytest.raises(ScriptError, match=r"ranks \[.*\] failed"):
        run_script([*args, "--kill", "1:write:3", "--out", killed])
    survivors_s = time.time() - float(re.search(r"kill switch: SIGKILL at ([\d.]+)",
                                                killed.with_name("killed.rank1.log").read_text()).group(1))
    print(f"survivors exited {survivors_s:.1f} s after the kill")
    assert survivors_s < 60
    assert "The asynchronous save of" in killed.with_name("killed.rank0.log").read_text()
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt.partial", "last.ckpt"]
    assert not (folder / "epoch=1-step=8.ckpt.partial" / "meta.pt").exists()
    resumed = run_script([*args, "--ckpt-path", "last", "--out", tmp_path / "resumed.pt"])
    assert resumed["resumed_from"] == str(folder / "last.ckpt")
    # Resumed from the asynchronous step-4 checkpoint: steps 5-10 are the uninterrupted run's, bit for bit.
    uninterrupted = async_and_sync["sync"]
    assert resumed["losses"] == uninterrupted["losses"][8:]
    assert all(torch.equal(uninterrupted["params"][k], v) for k, v in resumed["params"].items())
    assert sorted(p.name for p in folder.iterdir()) == CHECKPOINTS  # saved again over the debris, published
