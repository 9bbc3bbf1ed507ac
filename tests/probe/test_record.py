"""The setup record: one run of the step, everything the planners read from it."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.probe.record import AFTER, BEFORE, TRUNK, first_block_call, record_step


class Dense(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: Tensor) -> Tensor:
        x += self.down(F.relu(self.up(x)))  # writes its input in place, as some blocks do
        return x


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: Tensor, scale: float) -> Tensor:
        return x + scale * self.down(F.silu(self.gate(x)) * self.up(x))


class Tied(nn.Module):
    """Dense and gated blocks alternating, a position table held by the model itself, a head tied to the
    embedding, and a second use of the embedding's weight outside any module."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 8)
        self.pos = nn.Parameter(torch.zeros(6, 8))
        self.blocks = nn.ModuleList([Dense(), Gated(), Dense(), Gated()])
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight
        self.calls = 0

    def forward(self, tokens: Tensor, by_hand: bool = False, copy_norm: bool = False) -> Tensor:
        self.calls += 1
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for index, block in enumerate(self.blocks):
            x = block(x) if index % 2 == 0 else block(x, scale=0.5)
        norm = copy.deepcopy(self.norm) if copy_norm else self.norm  # an EMA copy, a metric's clone
        x = norm(x)
        return x @ self.embed.weight.T if by_hand else self.head(x)


def _record(model: Tied, tokens: Tensor, by_hand: bool = False, copy_norm: bool = False):
    _, blocks = find_block_list(model)
    return record_step(model, blocks, lambda: model(tokens, by_hand, copy_norm))


def test_one_run_records_the_first_call_of_each_block_structure_as_it_was_entered() -> None:
    model = Tied()
    tokens = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    record = _record(model, tokens)
    assert model.calls == 1
    assert sorted(record.block_calls) == [0, 1]  # the first Dense and the first Gated block
    (x,), kwargs = first_block_call(record)
    expected = model.embed(tokens) + model.pos  # what block 0 was given, before it added to it in place
    assert kwargs == {} and torch.equal(x, expected.detach())
    (x1,), kwargs1 = record.block_calls[1]
    assert kwargs1 == {"scale": 0.5} and x1.shape == (2, 6, 8)
    assert record.block_runs == [1, 1, 1, 1]


def test_phases_flops_and_parameter_reads_follow_the_step() -> None:
    model = Tied()
    record = _record(model, torch.randint(0, 32, (2, 6)))
    assert record.outer_units == ["embed", "norm", "head"]
    assert record.outer_calls == {"embed": {BEFORE}, "norm": {AFTER}, "head": {AFTER}}
    assert record.direct_parameters == ["pos"]
    # The tied weight is read before the blocks (the lookup) and after them (the head), under both names.
    assert record.parameter_reads["embed.weight"] == record.parameter_reads["head.weight"] == {BEFORE, AFTER}
    assert record.parameter_readers["embed.weight"] == {"embed", "head"}
    assert record.parameter_reads["pos"] == {BEFORE} and record.parameter_readers["pos"] == {""}
    assert record.largest_first_input["embed"] == 12  # the batch's tokens
    dense, gated = 2 * (2 * 6 * 8 * 16) * 2, 2 * (2 * 6 * 8 * 16) * 3  # multiply-adds of its linear layers
    assert record.block_flops == [dense, gated, dense, gated]
    assert record.flops_before == 0 and record.flops_after == 2 * 2 * 6 * 8 * 32  # the head
    assert TRUNK not in record.module_phases["head"]


def test_a_weight_read_by_hand_is_read_by_no_module() -> None:
    record = _record(Tied(), torch.randint(0, 32, (2, 6)), by_hand=True)
    assert record.parameter_readers["embed.weight"] == {"embed", ""}
    assert record.module_phases["head"] == set()


def test_a_module_the_step_copies_copies_its_hooks_not_the_record() -> None:
    # Deep-copying a hooked module copies its hooks; were the recorder copied with them, the copy would reach every
    # module it watches and read every weight there (found with torchmetrics, which clones its metrics).
    record = _record(Tied(), torch.randint(0, 32, (2, 6)), copy_norm=True)
    assert record.parameter_reads["pos"] == {BEFORE}
    assert record.parameter_reads["embed.weight"] == {BEFORE, AFTER}
    assert record.parameter_reads["norm.weight"] == {AFTER}


def test_copying_a_block_call_that_holds_a_module_reads_none_of_its_weights() -> None:
    # A block handed an object that holds modules (a cache with a reference to the model, say): the kept call copies
    # it, which clones every weight it reaches; those clones are not the step reading the weights.
    model = Tied()
    block = model.blocks[0]
    block.forward = lambda x, holder: Dense.forward(block, x)
    _, blocks = find_block_list(model)
    record = record_step(model, blocks, lambda: block(model.embed(torch.randint(0, 32, (2, 6))), holder=[model.norm]))
    assert record.parameter_reads["norm.weight"] == set()
    assert record.parameter_reads["embed.weight"] == {BEFORE}
    assert record.block_calls[0][1]["holder"][0] is not model.norm  # copied as the block received it


def test_the_outputs_of_units_are_described_for_the_stand_ins() -> None:
    from lightning_hybrid.probe.shapes import describe_call

    model = Tied()
    record = _record(model, torch.randint(0, 32, (2, 6)))
    smaller = describe_call((torch.zeros(1, 6, 8),), {})
    assert record.outputs.predict("blocks.0", smaller).shape == (1, 6, 8)


@pytest.mark.parametrize("meta", [False, True])
def test_a_meta_device_model_is_recorded_on_the_meta_device(meta: bool) -> None:
    with torch.device("meta" if meta else "cpu"):
        model = Tied()
    tokens = torch.randint(0, 32, (2, 6), device="meta" if meta else "cpu")
    record = _record(model, tokens)
    assert first_block_call(record)[0][0].is_meta == meta
    assert record.block_flops[0] == 2 * (2 * 6 * 8 * 16) * 2


class OutsideCall(nn.Module):
    """Calls a module of its first block again after the trunk, as diffusers' DiT calls
    ``transformer_blocks[0].norm1.emb``; the block's own calls of it do not count."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Dense(), Dense(), Dense()])

    def forward(self, x: Tensor) -> Tensor:
        before = self.blocks[1].down(torch.zeros(2, 16))
        for block in self.blocks:
            x = block(x)
        return x + self.blocks[0].up(x).sum() + before.sum()


def test_modules_of_a_block_called_from_outside_it_are_recorded_with_their_phases() -> None:
    model = OutsideCall()
    _, blocks = find_block_list(model)
    record = record_step(model, blocks, lambda: model(torch.randn(2, 8)))
    assert record.block_module_calls == {"blocks.0.up": {AFTER}, "blocks.1.down": {BEFORE}}


def test_which_block_outputs_the_step_computes_with_is_recorded() -> None:
    class Pairs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_ScoresBlock(), _ScoresBlock()])

        def forward(self, x: Tensor) -> Tensor:
            for block in self.blocks:
                x, scores = block(x)
            return x.sum() + 0 * scores.sum() if self.training else x.sum()

    model = Pairs().eval()
    _, blocks = find_block_list(model)
    assert record_step(model, blocks, lambda: model(torch.randn(2, 8))).block_outputs_used == {0: (True, False)}
    model.train()  # the last block's scores are read, the first block's still not: what counts is the first's
    assert record_step(model, blocks, lambda: model(torch.randn(2, 8))).block_outputs_used == {0: (True, False)}


class _ScoresBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.linear(x)), self.linear(x).softmax(-1)


def test_a_meta_model_is_recorded_through_value_reads_and_grouped_matmuls_its_kernels_refuse() -> None:
    class Routed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Dense(), Dense()])
            self.experts = nn.Parameter(torch.zeros(2, 8, 8))

        def forward(self, x: Tensor) -> Tensor:
            if (x[:, -1] == 0).all():  # a value read (Hugging Face asks whether sequences are packed)
                x = x + 1
            offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32, device=x.device)
            x = torch._grouped_mm(x, self.experts, offs=offsets)  # float32: the meta kernel wants 16-bit
            for block in self.blocks:
                x = block(x)
            return x

    with torch.device("meta"):
        model = Routed()
    _, blocks = find_block_list(model)
    record = record_step(model, blocks, lambda: model(torch.zeros(4, 8, device="meta")))
    assert record.block_runs == [1, 1]
    (x,), _ = record.block_calls[0]
    assert x.shape == (4, 8) and x.dtype == torch.float32 and x.is_meta
