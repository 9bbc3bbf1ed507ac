"""Weights several blocks hold stay one weight when each block's tensor-parallel plan is applied
(:mod:`lightning_hybrid.tensor_parallel.tied`); trained equal to one device under tp2 on Hugging Face Zamba2 in
``tests/test_zoo.py``."""

from __future__ import annotations

from torch import nn

from lightning_hybrid.tensor_parallel.tied import retie, sharded_before, tied_holders


def test_tied_parameters_get_the_first_holders_new_parameter_back() -> None:
    first, second, alone = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    ties = tied_holders([nn.Sequential(first, alone), nn.Sequential(second)])
    assert [[(id(m), a) for m, a in holders] for holders in ties] == [[(id(first), "weight"), (id(second), "weight")]]
    first.weight = nn.Parameter(first.weight.detach() * 2)  # what sharding the first block does
    retie(ties)
    assert second.weight is first.weight and second.bias is not first.bias


def test_a_module_an_earlier_block_holds_is_left_out_of_the_later_blocks_plan() -> None:
    common, seen = nn.Linear(4, 4), set()
    blocks = [nn.Sequential(nn.Linear(4, 4), common), nn.Sequential(nn.Linear(4, 4), common)]
    assert sharded_before(blocks[0], seen) == []
    assert sharded_before(blocks[1], seen) == ["1"]
