"""The memory benchmark's measurement helpers (``benchmarks/memory.py``), on one process without a strategy.

The multi-rank layouts are the benchmark's job (``python benchmarks/memory.py``); these tests check that what it
measures is right where the answer is known exactly.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from benchmarks import memory as bench
from recipes.gpt import GPT

#: Measured peak activations vs the analytic formula, single process. They differ by 8-16 bytes (loss scalars) on
#: torch 2.13 CPU; 1% leaves room for a kernel that saves another small statistic, while a missing or extra
#: b·T·C tensor (1.5% of the plain peak, 5% of the checkpointed one) still fails.
ACTIVATION_RTOL = 0.01


def _measure(layout: str) -> dict[str, Any]:
    with torch.random.fork_rng():  # the benchmark seeds torch; leave other tests' random stream alone
        return bench.fit_and_measure(bench.BY_NAME[layout])


@pytest.fixture(scope="module")
def plain() -> dict[str, Any]:
    return _measure("single")


@pytest.fixture(scope="module")
def checkpointed() -> dict[str, Any]:
    return _measure("single-ac")


def test_model_states_are_16_bytes_per_parameter(plain: dict[str, Any]) -> None:
    """fp32 AdamW after its first step: 4 B parameter + 4 B gradient + 8 B moments per parameter, exactly, plus
    one 4-byte ``step`` counter per parameter tensor."""
    parameters = list(GPT(bench.CONFIG).parameters())
    count = sum(p.numel() for p in parameters)
    assert count == 817_920
    states = plain["model_states"]
    assert states["params_owned"] == count
    assert states["params"] == 4 * count
    assert states["grads"] == 4 * count
    assert states["optimizer_moments"] == 8 * count
    assert states["optimizer_scalars"] == 4 * len(parameters)
    assert states["total"] == 16 * count + 4 * len(parameters)
    assert plain["stage_params"] == count
    assert plain["gathered_peak"] == 0  # no FSDP: nothing is gathered


def test_checkpointing_every_block_stores_less(plain: dict[str, Any], checkpointed: dict[str, Any]) -> None:
    # 4 blocks × 16 bTC stored vs 4 block inputs + one block's recompute (19 bTC + small terms).
    assert checkpointed["checkpointed_in_model"] == [0, 1, 2, 3]
    assert checkpointed["activation_peak"] < 0.3 * plain["activation_peak"]
    assert not plain["activation_peak_in_backward"]  # without checkpointing backward only frees
    assert checkpointed["activation_peak_in_backward"]  # with it, the recompute of the last block is the peak


@pytest.mark.parametrize("which", ["plain", "checkpointed"])
def test_activations_match_the_analytic_size(which: str, request: pytest.FixtureRequest) -> None:
    result = request.getfixturevalue(which)
    # b·T = 16 × 64 rows; x = one residual-stream tensor (512 KiB); S = what one block saves.
    bT, C, H, V = 16 * 64, 128, 4, 64
    x = bT * C * 4
    block = bT * (16 * C + 4 + H) * 4  # 16 bTC + LayerNorm statistics + attention logsumexp
    position_ids = 64 * 8
    head = 2 * x + 2 * bT * 4 + bT * V * 4  # ln_f input and output + statistics, log-softmax output
    expected = {
        "plain": 4 * block + position_ids + head + bT * V * 4,  # end of forward, logits alive during the loss
        "checkpointed": 3 * x + position_ids + block,  # backward of block 3: inputs of blocks 0-2 + its recompute
    }[which]
    assert result["analytic"]["total"] == expected
    assert result["activation_peak"] == pytest.approx(expected, rel=ACTIVATION_RTOL)


def test_tracker_counts_saved_tensors_not_parameters_or_inputs() -> None:
    """Linear → GELU → Linear on an input that needs no gradient: the saved tensors are the GELU input h (4NC)
    and output g (4NC); with the output y (NC) alive at the end of forward the peak is 9 NC floats. Parameters
    and the input existed before and are not activations."""
    torch.manual_seed(0)
    n, c = 256, 32
    mlp = nn.Sequential(nn.Linear(c, 4 * c), nn.GELU(), nn.Linear(4 * c, c))
    x = torch.randn(n, c)
    tracker = bench.ActivationTracker()
    tracker.track_external(mlp)
    tracker.track_as(bench.ActivationTracker.OTHER, [x])
    with tracker:
        y = mlp(x)
        assert tracker.peak_act == 9 * n * c * 4
        y.sum().backward()
    # + the loss scalar and the ones it is differentiated with (made before autograd's engine starts)
    assert tracker.peak_act == 9 * n * c * 4 + 2 * 4
    assert not tracker.peak_in_backward


def test_analytic_scales_with_the_layout() -> None:
    """Halving the batch per rank (dp=2) halves every term but the position ids; tp shards only the block
    intermediates; 1F1B's first stage holds two microbatches where the last holds one."""
    config = bench.CONFIG
    single = bench.analytic_activation_bytes(config, bench.StageShape(blocks=[0, 1, 2, 3], batch=16))["total"]
    dp2 = bench.analytic_activation_bytes(config, bench.StageShape(blocks=[0, 1, 2, 3], batch=8))["total"]
    position_ids = config.block_size * 8
    assert dp2 - position_ids == pytest.approx((single - position_ids) / 2, abs=1)
    tp2 = bench.analytic_activation_bytes(config, bench.StageShape(blocks=[0, 1, 2, 3], batch=16, tp=2))["total"]
    bT = 16 * config.block_size
    x = bT * config.n_embd * 4
    # per block: qkv, attention output, MLP intermediates 12 bTC → 6 bTC; logsumexp bHT → bHT/2
    assert single - tp2 == pytest.approx(4 * (6 * x + bT * config.n_head / 2 * 4), abs=1)
    first = bench.StageShape(blocks=[0, 1], batch=8, in_flight=2, microbatches=2, last=False)
    last = bench.StageShape(blocks=[2, 3], batch=8, in_flight=1, microbatches=2, first=False)
    first_parts = bench.analytic_activation_bytes(config, first)
    last_parts = bench.analytic_activation_bytes(config, last)
    assert first_parts["forward_peak"] == 2 * first_parts["per_microbatch"] + x // 2
    assert first_parts["buffers"] == last_parts["buffers"] == 2 * (x // 2)
