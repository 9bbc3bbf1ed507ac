"""The setup check of context parallelism, in one process: a block whose only position-mixing operation is its
attention is split (which arguments, which outputs), one that mixes positions otherwise, computes positions itself,
has no attention or too few heads stays whole with the reason; a meta-device block is planned from shapes."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.context_parallel.apply import plan_context_parallel
from lightning_hybrid.context_parallel.escapes import find_escapes
from lightning_hybrid.context_parallel.plan import BlockPlan, plan_block
from lightning_hybrid.probe.blocks import BlockList
from tests.models import hugging_face_llama

LENGTH = 12


def _first_call(model: nn.Module, layer: nn.Module, *inputs: Tensor) -> tuple:
    """The arguments the model calls ``layer`` with (as the setup probe records them)."""
    calls = []
    handle = layer.register_forward_pre_hook(lambda _, args, kwargs: calls.append(copy.deepcopy((args, kwargs))),
                                             with_kwargs=True)
    with torch.no_grad():
        model(*inputs)
    handle.remove()
    return calls[0]


class _Block(nn.Module):
    """Attention by ``F.scaled_dot_product_attention`` (rotary angles handed in), then an MLP; ``mix`` adds a causal
    convolution over time before the attention, ``positions`` computes the rotary angles itself from ``arange``,
    ``positional`` passes the attention's options by position."""

    def __init__(self, mix: bool = False, positions: bool = False, heads: int = 4, positional: bool = False) -> None:
        super().__init__()
        self.heads, self.positions, self.positional = heads, positions, positional
        self.qkv, self.out, self.mlp = nn.Linear(16, 48), nn.Linear(16, 16), nn.Linear(16, 16)
        self.conv = nn.Conv1d(16, 16, 3, padding=2, groups=16) if mix else None

    def forward(self, x: Tensor, angles: Tensor) -> Tensor:
        if self.conv is not None:
            x = x + self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)
        if self.positions:
            angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * torch.ones(1, 16 // self.heads)
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        q, k = q * angles.cos(), k * angles.cos()
        if self.positional:
            y = F.scaled_dot_product_attention(q, k, v, None, 0.0, True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).flatten(2))
        return x + self.mlp(x)


def _custom_call(head_dim: int = 4) -> tuple:
    torch.manual_seed(0)
    return (torch.randn(2, LENGTH, 16), torch.randn(LENGTH, head_dim)), {}


def test_a_hugging_face_decoder_layer_is_split_with_its_rotary_tables_and_mask_whole() -> None:
    model = hugging_face_llama({"num_hidden_layers": 1})
    tokens = torch.randint(0, 64, (2, LENGTH))
    mask = (torch.arange(LENGTH) >= torch.tensor([[0], [3]])).long()  # left padding: a (2, 1, 12, 12) mask
    call = _first_call(model, model.model.layers[0], tokens, None, mask)
    plan = plan_block(model.model.layers[0], call, parts=2)
    assert isinstance(plan, BlockPlan) and plan.checked and (plan.length, plan.heads) == (LENGTH, 4)
    leaves = torch.utils._pytree.tree_flatten(call)[0]
    split = {i: tuple(leaves[i].shape) for i in plan.split}
    # The hidden states, the rotary cos and sin, the position ids; the (B, 1, S, S) mask and the cache stay whole.
    assert sorted(split.values()) == [(2, LENGTH), (2, LENGTH, 8), (2, LENGTH, 8), (2, LENGTH, 32)]
    assert any(isinstance(x, Tensor) and x.shape == (2, 1, LENGTH, LENGTH) for x in leaves)
    assert plan.gather == {0: 1}


@pytest.mark.parametrize("positional", [False, True])
def test_a_custom_block_calling_scaled_dot_product_attention_is_split(positional: bool) -> None:
    plan = plan_block(_Block(positional=positional), _custom_call(), parts=4)
    assert isinstance(plan, BlockPlan) and plan.split == {0: 1, 1: 0} and plan.gather == {0: 1} and plan.checked


@pytest.mark.parametrize(("block", "reason"), [
    (_Block(mix=True), "its attention's queries on a part of the sequence differs from the whole run's: it mixes"
                       " positions outside its attention, or computes positions itself"),
    (_Block(positions=True), "its attention's queries on a part of the sequence differs from the whole run's: it"
                             " mixes positions outside its attention, or computes positions itself"),
    (_Block(heads=2), "its attention's 12 positions and 2 heads do not both divide into 4 parts"),
    (nn.Linear(16, 16), "no attention call found in it (nothing to exchange)"),
], ids=["convolution-over-time", "positions-computed-inside", "too-few-heads", "no-attention"])
def test_what_cannot_be_split_stays_whole_with_the_reason(block: nn.Module, reason: str) -> None:
    args, _ = _custom_call()
    call = ((args[0],), {}) if isinstance(block, nn.Linear) else _custom_call(16 // getattr(block, "heads", 4))
    assert plan_block(block, call, parts=4) == reason


def test_a_block_mixing_positions_after_its_attention_stays_whole() -> None:
    class After(_Block):
        def forward(self, x: Tensor, angles: Tensor) -> Tensor:
            return super().forward(x, angles).cumsum(1)

    assert plan_block(After(), _custom_call(), parts=2) == ("its output put together from the parts differs from"
                                                             " the whole run's: it mixes positions outside its"
                                                             " attention, or computes positions itself")


def test_a_meta_device_block_is_planned_from_shapes_and_reported_unchecked() -> None:
    with torch.device("meta"):
        block = _Block()
    args, kwargs = _custom_call()
    plan = plan_block(block, (tuple(a.to("meta") for a in args), kwargs), parts=2)
    assert isinstance(plan, BlockPlan) and plan.split == {0: 1, 1: 0} and not plan.checked
    blocks = BlockList("layers", nn.ModuleList([block, copy.deepcopy(block)]))
    applied = plan_context_parallel(blocks, {0: (tuple(a.to("meta") for a in args), kwargs)}, parts=2)
    assert applied.describe() == ["layers.0 (2 blocks): split, planned from shapes (meta device), not checked at 12"
                                  " positions, 4 heads"]


class _RecordingModel(nn.Module):
    """Two blocks; with ``record``, a hook keeps each block's first projection's output and the step adds their
    mean to the loss (as Hugging Face's ``output_router_logits`` feeds the load-balancing loss)."""

    def __init__(self, record: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(2))
        self.recorded: list[Tensor] = []
        if record:
            for layer in self.layers:
                layer.qkv.register_forward_hook(lambda _, __, output: self.recorded.append(output))

    def forward(self, x: Tensor, angles: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x, angles)
        return x.sum() + sum(value.mean() for value in self.recorded)


@pytest.mark.parametrize(("record", "expected"), [(False, set()), (True, {0, 1})])
def test_blocks_whose_inside_values_the_step_reads_are_found(record: bool, expected: set) -> None:
    model = _RecordingModel(record)
    (args, _) = _custom_call()
    with torch.no_grad():
        found = find_escapes(BlockList("layers", model.layers), lambda: model(*args))
    assert found == expected
    applied = plan_context_parallel(BlockList("layers", model.layers), {0: _custom_call()}, 2, found)
    assert applied.describe()[0].startswith("layers.0 (2 blocks): kept whole on every cp rank: the step reads a"
                                            if record else "layers.0 (2 blocks): split, checked")
