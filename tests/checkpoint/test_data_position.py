"""Exact mid-epoch resume (:mod:`lightning_hybrid.checkpoint.data_position`): the resumable sampler's order is
``DistributedSampler``'s, a position saved under one data-parallel size resumes under another with every sample of
the epoch seen exactly once, and (on ranks) a fit resumed from a mid-epoch checkpoint equals the uninterrupted
one bit for bit, for a plain ``DataLoader`` and torchdata's ``StatefulDataLoader``."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

from lightning_hybrid.checkpoint.data_position import ResumableDistributedSampler, make_resumable, resumable_sampler
from tests.helpers import run_rank_script


def _sampler(size: int, replicas: int, rank: int, epoch: int = 0, batch: int = 1, **kwargs) -> DistributedSampler:
    loader = DataLoader(list(range(size)), batch_size=batch,
                        sampler=DistributedSampler(list(range(size)), replicas, rank, **kwargs))
    sampler = resumable_sampler(make_resumable(loader))
    assert sampler is not None
    sampler.set_epoch(epoch)
    return sampler


@pytest.mark.parametrize(("size", "replicas", "shuffle", "drop_last"),
                         list(itertools.product((12, 13), (1, 3, 4), (True, False), (True, False))))
def test_without_a_resume_the_order_is_distributed_samplers(size: int, replicas: int, shuffle: bool,
                                                             drop_last: bool) -> None:
    for rank, epoch in itertools.product(range(replicas), (0, 1)):
        plain = DistributedSampler(list(range(size)), replicas, rank, shuffle=shuffle, drop_last=drop_last, seed=3)
        plain.set_epoch(epoch)
        resumable = _sampler(size, replicas, rank, epoch, shuffle=shuffle, drop_last=drop_last, seed=3)
        assert list(resumable) == list(plain)


def _consume(replicas: int, batches: int, batch: int, size: int = 48, epoch: int = 2) -> tuple[list[int], dict]:
    """What ``replicas`` ranks take in ``batches`` batches, and rank 0's saved position."""
    seen, state = [], {}
    for rank in range(replicas):
        sampler = _sampler(size, replicas, rank, epoch, batch)
        seen += list(sampler)[: batches * batch]
        for _ in range(batches):
            sampler.note_batch()
        state = state or sampler.state_dict()
    return seen, state


@pytest.mark.parametrize(("saved", "resumed"), [(4, 2), (2, 4), (2, 3), (3, 2), (2, 2)])
def test_a_position_saved_under_one_data_parallel_size_resumes_under_another(saved: int, resumed: int) -> None:
    seen, state = _consume(saved, batches=3, batch=2)
    assert state == {"epoch": 2, "samples": 3 * 2 * saved, "replicas": saved}
    rest = []
    for rank in range(resumed):
        sampler = _sampler(48, resumed, rank, epoch=0, batch=2)
        sampler.load_state_dict(state)  # sets the saved epoch: workers draw the order before Lightning sets it
        left = sampler.batches_left()
        rank_rest = list(sampler)
        assert left == -(-len(rank_rest) // 2)  # a short last batch counts
        rest += rank_rest
    assert Counter(seen + rest) == Counter(range(48))  # every sample of the epoch exactly once


def test_a_position_of_another_epoch_does_not_skip() -> None:
    _, state = _consume(2, batches=3, batch=2, epoch=1)
    sampler = _sampler(48, 2, 0, epoch=0, batch=2)
    sampler.load_state_dict(state)
    sampler.set_epoch(2)  # the saved epoch ended: the run goes on with the next one
    assert sampler.batches_left() is None
    assert list(sampler) == list(_sampler(48, 2, 0, epoch=2))


def test_only_plain_distributed_samplers_with_a_batch_size_are_made_resumable() -> None:
    data = list(range(8))

    class OwnSampler(DistributedSampler):
        pass

    for loader in (DataLoader(data, sampler=RandomSampler(data)), DataLoader(data, batch_size=None),
                   DataLoader(data, sampler=OwnSampler(data, 2, 0))):
        before = (type(loader), type(loader.sampler))
        assert make_resumable(loader) is loader and (type(loader), type(loader.sampler)) == before
        assert resumable_sampler(loader) is None
    loader = make_resumable(DataLoader(data, batch_size=2, sampler=DistributedSampler(data, 2, 0)))
    assert isinstance(loader, DataLoader) and isinstance(loader.sampler, ResumableDistributedSampler)
    assert loader.state_dict() == {"sampler": {"epoch": 0, "samples": 0, "replicas": 2}}


# ------------------------------------------------------------------------------------------------------ on ranks
MID_EPOCH = Path(__file__).with_name("mid_epoch.py")
STEP_6 = "epoch=1-step=6.ckpt"  # dp=2: batch 4 of epoch 1's 8


@pytest.fixture(scope="module")
def mid_epoch_runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("mid_epoch")
    two_ranks = [{"name": "plain", "loader": "plain", "save": True},
                 {"name": "plain_resumed", "loader": "plain", "ckpt": f"plain/{STEP_6}"},
                 {"name": "stateful", "loader": "stateful", "save": True},
                 {"name": "stateful_resumed", "loader": "stateful", "ckpt": f"stateful/{STEP_6}"}]
    one_rank = [{"name": "plain_dp1", "loader": "plain", "ckpt": f"plain/{STEP_6}"},
                {"name": "stateful_dp1", "loader": "stateful", "ckpt": f"stateful/{STEP_6}"}]
    runs = {}
    for devices, entries in ((2, two_ranks), (1, one_rank)):
        runs.update(run_rank_script(MID_EPOCH, ["--devices", devices, "--runs", json.dumps(entries),
                                                "--root", root, "--out", root / f"dp{devices}.pt"]))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_a_mid_epoch_resume_continues_bit_exactly(mid_epoch_runs: dict, loader: str) -> None:
    whole, resumed = mid_epoch_runs[loader], mid_epoch_runs[f"{loader}_resumed"]
    assert resumed["ids"] == whole["ids"][12:]  # batches 13-20: the rest of epoch 1, then epoch 2's first four
    assert resumed["epochs"] == whole["epochs"][12:] == [1] * 4 + [2] * 4
    assert resumed["losses"] == whole["losses"][12:]
    assert (resumed["global_step"], resumed["learning_rate"]) == (whole["global_step"], whole["learning_rate"]) == (
        10, pytest.approx(0.05 * 0.9 ** 10))
    assert all(torch.equal(resumed["params"][k], p) for k, p in whole["params"].items())
    if loader == "stateful":
        assert whole["ids"] == mid_epoch_runs["plain"]["ids"]  # one data order for both kinds of loader


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["plain", "stateful"])
def test_a_mid_epoch_checkpoint_resumes_under_another_data_parallel_size(mid_epoch_runs: dict, loader: str) -> None:
    whole, resumed = mid_epoch_runs[loader], mid_epoch_runs[f"{loader}_dp1"]
    before = [i for batch in whole["ids"][8:12] for rank in batch for i in rank]  # epoch 1 up to step 6 on dp=2
    after = [i for batch in resumed["ids"] for rank in batch for i in rank]
    assert resumed["epochs"] == [1] * 8  # epoch 1's 24 samples left, 3 per batch on one rank: then max_steps
    assert Counter(before + after) == Counter(range(48))
    assert resumed["global_step"] == 10 and resumed["current_epoch"] == 2  # epoch 1 ended where its data did
