"""Model FLOPs and collective bytes counted by ``StepCounter`` (multi-rank layouts: tests/observe/test_monitor.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hybrid.observe.counting import StepCounter

BATCH, IN, HIDDEN, OUT = 5, 8, 16, 4
#: 2·m·k·n per matmul, forward only: the two linear layers of ``_mlp``.
FORWARD_FLOPS = 2 * BATCH * IN * HIDDEN + 2 * BATCH * HIDDEN * OUT


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def test_model_flops_are_three_times_the_forward_matmuls_with_backward_not_counted() -> None:
    model, x = _mlp(), torch.randn(BATCH, IN)
    with StepCounter() as counter:
        model(x).sum().backward()
    assert counter.forward_flops == FORWARD_FLOPS == 1920
    assert counter.model_flops == 3 * 1920


def test_activation_checkpointing_recomputation_is_not_model_flops() -> None:
    model, x = _mlp(), torch.randn(BATCH, IN, requires_grad=True)
    with StepCounter() as counter:
        checkpoint(model, x, use_reentrant=False).sum().backward()
    assert counter.forward_flops == FORWARD_FLOPS
    assert x.grad is not None


def test_meta_device_stand_ins_count_nothing() -> None:
    model = _mlp().to("meta")
    with StepCounter() as counter:
        model(torch.randn(BATCH, IN, device="meta"))
    assert counter.forward_flops == 0


@pytest.fixture()
def one_rank_group() -> Iterator[None]:
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_collectives_are_counted_in_bytes_of_the_full_tensor_per_type(one_rank_group: None) -> None:
    ten_floats = torch.ones(10)
    with StepCounter() as counter:
        dist.all_reduce(ten_floats)
        dist.all_reduce(ten_floats)
        dist.all_gather_into_tensor(torch.empty(10), ten_floats)
        dist.reduce_scatter_tensor(torch.empty(10), ten_floats)
        dist.broadcast(torch.ones(5, dtype=torch.float64), src=0)
    assert dict(counter.comm_bytes) == {"all_reduce": 80, "all_gather": 40, "reduce_scatter": 40, "broadcast": 40}
    assert dict(counter.comm_calls) == {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
