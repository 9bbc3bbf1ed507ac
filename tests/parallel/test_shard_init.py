"""Initializers replayed on shards (``lightning_hybrid.parallel.shard_init``): drawn in chunks of rows, the values
are bit for bit those of one whole draw under the module's seed (torch's own initializers run whole give the
expected values), and what cannot be replayed keeps the full-size path."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_hybrid.parallel import shard_init
from lightning_hybrid.parallel.initialization import materialize_meta_module, module_seed
from lightning_hybrid.parallel.shard_init import ReplayRecorder, Target, replay, row_chunks
from tests.helpers import on_two_ranks

SEED = 11


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shard_init, "CHUNK_ELEMENTS", 48)  # every tensor below is drawn in several chunks


@pytest.mark.parametrize(("first", "last", "row"), [(0, 37, 5), (3, 40, 1), (0, 9, 7), (0, 2, 5), (0, 100, 96)])
def test_row_chunks_cover_the_range_in_multiples_of_16_with_a_tail_of_at_least_16(small_chunks, first, last, row):
    chunks = list(row_chunks(first, last, row))
    assert chunks[0][0] == first and chunks[-1][1] == last
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all((stop - start) * row % 16 == 0 for start, stop in chunks[:-1])
    assert (chunks[-1][1] - chunks[-1][0]) * row >= min(16, (last - first) * row)
    assert all((stop - start) * row <= max(48, math.lcm(row, 16)) for start, stop in chunks[:-1])


class _TruncatedNormal(nn.Module):
    """trunc_normal_ by its classic element-wise recipe (torch 2.13's own samples by rejection, which meta
    tensors skip), through a LightningModule-style hook."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(13, 6, dtype=torch.bfloat16))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.uniform_(-0.9, 0.9).erfinv_().mul_(0.02 * math.sqrt(2.0)).add_(0.001).clamp_(-0.03, 0.03)


def _whole(name: str, build):
    torch.manual_seed(module_seed(SEED, name))
    return build()


def test_chunked_replay_equals_each_initializer_run_whole(small_chunks) -> None:
    builders = {"linear": lambda: nn.Linear(7, 9), "embedding": lambda: nn.Embedding(37, 5, padding_idx=3),
                "wide": lambda: nn.Linear(100, 3, dtype=torch.float64), "odd": _TruncatedNormal}
    with torch.device("meta"):
        model = nn.ModuleDict({name: build() for name, build in builders.items()})
    materialize_meta_module(model, "cpu", seed=SEED)
    for name, build in builders.items():
        expected = _whole(name, build)
        for key, tensor in expected.state_dict().items():
            assert torch.equal(model[name].state_dict()[key], tensor), (name, key)
    assert float(model["embedding"].weight[3].abs().max()) == 0.0  # the padding row, zeroed after the draw


def _record(module: nn.Module, initializer) -> list | None:
    stand_ins = {StorageWeakRef(t.untyped_storage()): t for t in module.parameters()}
    recorder = ReplayRecorder(stand_ins)
    with recorder, torch.no_grad():
        initializer(module)
    return recorder.writes


def test_only_random_fills_and_element_wise_writes_are_replayed() -> None:
    with torch.device("meta"):
        linear = nn.Linear(4, 6)
    assert [w.func.__name__ for w in _record(linear, lambda m: m.reset_parameters())] == ["uniform_.default"] * 2
    assert _record(linear, lambda m: m.weight.copy_(torch.randn(6, 4))) is None  # a draw into a new tensor
    assert _record(linear, lambda m: m.weight.copy_(torch.eye(6, 4))) is None  # a tensor's values copied
    assert _record(linear, lambda m: m.weight[:, 1].zero_()) is None  # a column: not a range of rows


def test_what_cannot_be_replayed_gets_the_values_of_the_full_size_path(small_chunks) -> None:
    class DrawnElsewhere(nn.Linear):
        def reset_parameters(self) -> None:
            with torch.no_grad():
                self.weight.copy_(torch.randn(8, 8) * 0.1)
                self.bias.zero_()

    with torch.device("meta"):
        model = nn.ModuleDict({"q": DrawnElsewhere(8, 8)})
    materialize_meta_module(model, "cpu", seed=SEED)
    assert torch.equal(model["q"].weight, _whole("q", lambda: DrawnElsewhere(8, 8)).weight)


def _sharded_replay(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    shard_init.CHUNK_ELEMENTS = 48
    mesh = init_device_mesh("cpu", (2,))
    with torch.device("meta"):
        embedding = nn.Embedding(37, 6, padding_idx=20)
    writes = _record(embedding, lambda m: m.reset_parameters())
    torch.manual_seed(SEED)
    whole = nn.Embedding(37, 6, padding_idx=20).weight.detach()
    for dim in (0, 1):
        sharded = distribute_tensor(torch.zeros(37, 6), mesh, [Shard(dim)])
        torch.manual_seed(SEED)
        replay([w.__class__(w.func, id(sharded), w.first, w.last, w.args, w.kwargs) for w in writes],
               {id(sharded): shard_init.target_of(sharded)})
        results[(rank, dim)] = torch.equal(sharded.to_local(), distribute_tensor(whole, mesh, [Shard(dim)]).to_local())


@pytest.mark.slow
def test_a_rank_replays_its_shard_of_rows_or_columns_bit_for_bit() -> None:
    assert on_two_ranks(_sharded_replay) == {(0, 0): True, (1, 0): True, (0, 1): True, (1, 1): True}


def test_a_target_holds_the_box_a_plain_tensor_is_whole() -> None:
    tensor = torch.zeros(3, 4)
    assert shard_init.target_of(tensor) == Target(tensor, (0, 0), (3, 4))
