"""The tensor-parallel layers torch's styles do not cover (``lightning_hybrid.tensor_parallel.layers``), on two ranks:
what they compute and what they communicate."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_hybrid.observe.counting import StepCounter
from lightning_hybrid.tensor_parallel.layers import shard_column
from tests.helpers import on_two_ranks


def _fused_qkv_step(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    whole = nn.Linear(8, 12)  # q | k | v, 4 output features each: each rank computes 2 of every piece
    layer, x = copy.deepcopy(whole), torch.randn(3, 8, requires_grad=True)
    whole(x).pow(2).sum().backward()
    shard_column(layer, mesh, split_factor=3, transposed=False)
    with StepCounter() as counter:
        local = layer(x.detach().requires_grad_())
        local.pow(2).sum().backward()  # the rows' terms of the whole sum: the ranks' losses add up to it
    results[rank] = dict(output=torch.equal(local, whole(x).detach().view(3, 3, 2, 2)[:, :, rank].reshape(3, 6)),
                         bias=torch.allclose(layer.bias.grad.full_tensor(), whole.bias.grad),
                         weight=torch.allclose(layer.weight.grad.full_tensor(), whole.weight.grad),
                         all_reduces=counter.comm_calls.get("all_reduce", 0))


@pytest.mark.slow
def test_a_fused_column_layer_reduces_only_its_input_gradient() -> None:
    # The bias is dealt like the weight's rows (each rank its chunk of q, k and v), so its gradient needs no
    # all-reduce; the input's gradient, each rank's part, is summed once (Megatron's column layer: the minimum).
    expected = dict(output=True, bias=True, weight=True, all_reduces=1)
    assert on_two_ranks(_fused_qkv_step) == {0: expected, 1: expected}
