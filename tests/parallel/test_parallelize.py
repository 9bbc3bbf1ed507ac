"""The one driver, :func:`lightning_hybrid.parallel.parallelize.parallelize`, without a Trainer: on 2 gloo ranks it
parallelizes a plain module, and the parallel module's loss and gradients equal the unmodified module's."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from lightning_hybrid.mesh import ParallelDims
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.parallel.parallelize import parallelize
from lightning_hybrid.probe.step_probe import StepProbe
from tests.helpers import on_two_ranks
from tests.models import build_module

#: Layouts of 2 ranks × options; each entry is run on the same model and batch.
CASES = {
    "tp2_checkpointed": (dict(tp=2), dict(activation_checkpointing="every")),
    "dp2_zero2": (dict(), dict(zero=2)),
}


def _loss_and_gradients(module: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    logits = module(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {}
    for name, parameter in module.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
    return float(loss), grads


def _parallelize_on_two_ranks(rank: int, results: dict) -> None:
    for case, (degrees, options) in CASES.items():
        module = build_module("llama", seed=3).model  # the same weights on both ranks
        reference = copy.deepcopy(module)
        tokens = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(5))
        # Data-parallel ranks each take half the batch, as Lightning's sampler would give them.
        local = tokens if "tp" in degrees else tokens.chunk(2)[rank]
        dims = ParallelDims(world_size=2, **degrees)
        mesh, data_mesh = dims.build_mesh("cpu")
        blocks = BlockList("layers", module.layers)
        probe = StepProbe(module, blocks, lambda microbatches: module(local[:, :-1]), torch.device("cpu"))
        result = parallelize(module, "layers", blocks, mesh, dims, HybridOptions(**degrees, **options),
                             data_mesh=data_mesh, precision="32-true", device=torch.device("cpu"), probe=probe)
        loss, grads = _loss_and_gradients(module, local)
        losses = [None] * data_mesh.size()
        dist.all_gather_object(losses, loss, group=data_mesh.get_group())
        if rank == 0:
            expected_loss, expected_grads = _loss_and_gradients(reference, tokens)
            results[case] = dict(
                loss=(sum(losses) / len(losses), expected_loss),
                grad_diff=max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in expected_grads.items()),
                tp_plan=result.tp_plan, sharded=result.sharded,
                checkpointed=type(module.layers[0]).__name__,
            )


@pytest.mark.slow
def test_the_driver_parallelizes_a_plain_module_to_the_same_numbers() -> None:
    results = on_two_ranks(_parallelize_on_two_ranks)
    tp, dp = results["tp2_checkpointed"], results["dp2_zero2"]
    for case in (tp, dp):
        got, expected = case["loss"]
        assert abs(got - expected) <= 1e-5 * abs(expected)
        assert case["grad_diff"] <= 1e-5
    # Step 2 (tensor parallelism) sharded the attention and MLP pairs; step 3 checkpointed the sharded blocks;
    # step 5 left FSDP2 out on one data-parallel rank and applied it over two.
    assert tp["tp_plan"]["layers.*.attention.wo"] == "rowwise" and tp["checkpointed"] == "CheckpointedLlamaBlock"
    assert tp["sharded"] is False and dp["sharded"] is True and dp["tp_plan"] == {}

