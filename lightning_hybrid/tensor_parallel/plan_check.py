"""How far a sharded block is from the unsharded one: the tensor-parallel plan check's measure.

The check runs both blocks on the same call and compares their outputs and every parameter's gradient of a fixed
random projection of the outputs (a weight the plan leaves whole but feeds sharded activations gets only its rank's
part of the gradient, which the outputs alone would not show), relative to the unsharded values.

Example::

    error = plan_error(reference_block, sharded_block, args, kwargs)
    error <= tolerance_for(torch.float32)       # the plan computes what the unsharded block does
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._compat import tree_flatten


def plan_error(reference: nn.Module, sharded: nn.Module, args: tuple, kwargs: dict) -> float:
    """Largest relative difference on this rank between the unsharded and sharded block: its outputs, and every
    parameter's gradient of a fixed random projection of them (a weight the plan leaves whole but feeds sharded
    activations — a per-head q/k norm after a column layer — gets only its rank's part of the gradient)."""
    def run(block: nn.Module) -> list[torch.Tensor]:
        # Fresh copies per run: blocks may update state they are handed (e.g. a key/value cache).
        call_args, call_kwargs = copy.deepcopy((args, kwargs))
        with torch.enable_grad():
            outputs = [t for t in tree_flatten(block(*call_args, **call_kwargs))[0] if isinstance(t, torch.Tensor)]
        return [t.full_tensor() if isinstance(t, DTensor) else t for t in outputs]

    expected, actual = run(reference), run(sharded)
    if len(expected) != len(actual) or any(want.shape != got.shape for want, got in zip(expected, actual)):
        return float("inf")
    error = 0.0
    for want, got in zip(expected, actual):
        scale = want.detach().abs().max().clamp_min(1e-12)
        error = max(error, float(((want - got).detach().abs().max() / scale).nan_to_num(float("inf"))))
    return max(error, _gradient_error(reference, sharded, expected, actual))


def _gradient_error(reference: nn.Module, sharded: nn.Module, expected: list[torch.Tensor],
                    actual: list[torch.Tensor]) -> float:
    """The largest relative difference of the parameters' gradients of ``sum(output · w)`` (``w`` drawn from a
    fixed seed, the same on every rank); gradients are left cleared."""
    generator = torch.Generator().manual_seed(0)
    for outputs, block in ((expected, reference), (actual, sharded)):
        weights = [torch.randn(t.shape, generator=generator).to(t.device, t.dtype) for t in expected]
        generator.manual_seed(0)
        terms = [(t * w).sum() for t, w in zip(outputs, weights) if t.requires_grad and t.is_floating_point()]
        if terms:
            torch.stack(terms).sum().backward()
    pairs = []
    held = dict(sharded.named_parameters())
    for name, parameter in reference.named_parameters():
        got = held[name].grad if name in held else parameter.grad  # a layer the plan replaced: its output checked
        got = got.full_tensor() if isinstance(got, DTensor) else got
        if parameter.grad is not None or got is not None:
            pairs.append((parameter.grad, got))
    for block in (reference, sharded):
        block.zero_grad(set_to_none=True)
    # A gradient that is zero in exact arithmetic (a key's bias under softmax) is rounding noise on both sides.
    floor = max((float(g.abs().max()) for g, _ in pairs if g is not None), default=0.0) * 1e-3
    error = 0.0
    for want, got in pairs:
        if want is None or got is None or want.shape != got.shape:
            return float("inf")
        scale = max(float(want.abs().max()), floor, 1e-12)
        error = max(error, float(((want - got).abs().max() / scale).nan_to_num(float("inf"))))
    return error


def tolerance_for(dtype: torch.dtype) -> float:
    """Relative tolerance of the plan check: summation order differs between sharded and unsharded matmuls."""
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
