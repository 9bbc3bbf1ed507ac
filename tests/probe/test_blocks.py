"""Which modules several blocks hold (:func:`lightning_hybrid.probe.blocks.shared_between_blocks`): one object in
each, or one per block with tied parameters, grouped as one set of weights."""

from __future__ import annotations

from torch import nn

from lightning_hybrid.probe.blocks import shared_between_blocks


def _block(shared: nn.Module) -> nn.Module:
    block = nn.Module()
    block.own, block.shared = nn.Linear(4, 4), shared
    return block


def test_one_module_in_several_blocks_is_one_group_of_itself() -> None:
    common = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    blocks = [_block(common), _block(nn.Linear(4, 4)), _block(common)]
    assert [[id(m) for m in group] for group in shared_between_blocks(blocks)] == [[id(common)]]


def test_modules_with_tied_parameters_are_one_group_and_their_parts_are_not_listed_again() -> None:
    first, second = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for a, b in zip(first, second):
        b.weight, b.bias = a.weight, a.bias
    groups = shared_between_blocks([_block(first), _block(second)])
    assert [[id(m) for m in group] for group in groups] == [[id(first), id(second)]]
    assert shared_between_blocks([_block(nn.Linear(4, 4)), _block(nn.Linear(4, 4))]) == []
