"""Gradient clipping by the norm over every mesh and pipeline stage stays on the device the strategy computes on:
no host read per step, and a pipeline rank holding no gradient (a frozen stage) reduces a tensor on that device
(NCCL refuses a CPU tensor; gloo, which these tests run on, accepts any, so the device is asserted here).

The meta device stands in for an accelerator: like a GPU's memory it is not the host's, and unlike it, reading a
value back (``.cpu()``, ``.item()``, ``float()``) raises, so any host synchronization fails these tests. On the CPU
the same calls give the numbers, checked against a hand computation. The pp2 run with a frozen stage
(``tests/pipeline/test_pipeline.py``) checks the training against single-process Lightning.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid import HybridStrategy, ParallelMonitor
from lightning_hybrid.glue.precision import HybridPrecision
from lightning_hybrid.parallel.grad_norm import total_grad_norm

PIPELINE_GROUP = object()  # what the spy sees as the group: the pipeline's, not WORLD
OTHER_STAGE_NORM = 3.0  # the other stage's gradient norm, added by the spied all-reduce
THIS_STAGE_GRAD = 2.0  # every entry of this stage's gradient: 4 entries, norm 4


def _spy_on_all_reduce(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """Replace ``torch.distributed.all_reduce`` with a sum over this stage and one other whose norm is
    ``OTHER_STAGE_NORM`` (what 2 pipeline ranks reduce); returns the tensors it reduced, after reduction."""
    reduced: list[torch.Tensor] = []

    def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
                   ) -> None:
        assert group is PIPELINE_GROUP and op == dist.ReduceOp.SUM
        tensor += OTHER_STAGE_NORM ** 2  # the sum of the stages' squared norms
        reduced.append(tensor)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return reduced


def _strategy_clipping(device: torch.device, module: nn.Module) -> HybridPrecision:
    """The precision plugin as ``HybridStrategy`` sets it up on ``device`` for pipeline rank ``module``."""
    strategy = HybridStrategy(pp=2)
    strategy.parallel_devices = [device]
    strategy.precision_plugin = HybridPrecision()
    strategy.model = module
    strategy.setup_precision_plugin()
    plugin = strategy.precision_plugin
    assert plugin.device == device  # the strategy's device reached the plugin
    plugin.pipeline = SimpleNamespace(pp_group=PIPELINE_GROUP, counted_elsewhere=set)
    return plugin  # type: ignore[return-value]


def _stage(device: torch.device, frozen: bool) -> nn.Module:
    stage = nn.Linear(2, 2, bias=False, device=device)
    stage.weight.requires_grad_(not frozen)
    if not frozen:
        stage.weight.grad = torch.full((2, 2), THIS_STAGE_GRAD, device=device)
    return stage


@pytest.mark.parametrize("frozen", [False, True], ids=["stage-trains", "stage-frozen"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_clipping_reduces_the_norm_on_the_strategys_device(
    device: str, frozen: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    reduced = _spy_on_all_reduce(monkeypatch)
    stage = _stage(torch.device(device), frozen)
    plugin = _strategy_clipping(torch.device(device), stage)
    plugin.clip_grad_by_norm(torch.optim.SGD(stage.parameters(), lr=0.1), 1.0)
    # One reduction over the pipeline's ranks, on the compute device, also from the rank without a gradient.
    assert [(t.device.type, t.dtype) for t in reduced] == [(device, torch.float64)]
    if device == "meta":
        return  # nothing was read back to the host: that would have raised on the meta device
    this_stage = 0.0 if frozen else 4 * THIS_STAGE_GRAD**2
    assert reduced[0].item() == this_stage + OTHER_STAGE_NORM**2  # 9 + 16 (norm 5), or 9 from the frozen stage
    if frozen:
        assert stage.weight.grad is None
    else:  # scaled by max_norm / total norm = 1 / 5
        torch.testing.assert_close(stage.weight.grad, torch.full((2, 2), THIS_STAGE_GRAD / 5.0), rtol=1e-6, atol=0)


def test_the_norm_without_a_pipeline_stays_on_the_device_even_with_no_gradient() -> None:
    meta = torch.device("meta")
    assert total_grad_norm([nn.Parameter(torch.empty(3, device=meta))], device=meta).device == meta
    assert total_grad_norm([], device=meta).device == meta
    parameters = [nn.Parameter(torch.zeros(3)), nn.Parameter(torch.zeros(4))]
    parameters[0].grad, parameters[1].grad = torch.full((3,), 2.0), torch.full((4,), 1.0)
    assert total_grad_norm(parameters).item() == pytest.approx((3 * 4.0 + 4 * 1.0) ** 0.5)  # sqrt(16) = 4
    assert total_grad_norm(parameters, norm_type=float("inf")).item() == 2.0


def test_offloaded_gradients_are_reduced_over_the_pipeline_on_the_compute_device(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    reduced = _spy_on_all_reduce(monkeypatch)
    parameter = nn.Parameter(torch.zeros(4))
    parameter.grad = torch.full((4,), THIS_STAGE_GRAD)  # in CPU memory, as offload=True keeps them
    meta = torch.device("meta")
    assert total_grad_norm([parameter], pipeline_group=PIPELINE_GROUP, device=meta).device == meta
    assert [t.device for t in reduced] == [meta]
    # Without a pipeline the norm stays with the gradients: no copy to the device and back.
    assert total_grad_norm([parameter], device=meta).item() == 4.0


def test_the_monitors_gradient_norm_is_read_back_only_when_logged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor computes the norm on the step before a log (a device tensor) and reads it at the log."""
    reduced = _spy_on_all_reduce(monkeypatch)
    meta = torch.device("meta")
    stage = _stage(meta, frozen=True)
    pipeline = SimpleNamespace(pp_group=PIPELINE_GROUP, counted_elsewhere=set)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=meta, pipeline=pipeline), log_every_n_steps=1,
                              accumulate_grad_batches=1)
    monitor = ParallelMonitor()
    monitor.on_before_optimizer_step(trainer, stage, optimizer=None)  # type: ignore[arg-type]
    assert [t.device for t in reduced] == [meta]  # float() of it would have raised here
