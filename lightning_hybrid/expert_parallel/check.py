"""The setup check of expert parallelism: a layer split over the ranks computes what it computed whole.

On the call recorded at setup (this rank's own tokens), the whole layer's output, the gradients of its floating
inputs and of its parameters (for a random output gradient, the same on every run) are taken before the split;
after it, the split layer runs on the same call. Outputs and input gradients must match on every rank; an expert's
gradient on the rank holding it must match the sum of the whole layer's gradients over the group's ranks (each
rank's tokens reach the expert). The largest relative difference is combined over the group, so every rank passes
or stops with the same message.

Example::

    whole = layer_gradients(layer, args, kwargs)             # before splitting
    split_stack(layer, group, roles)
    difference = compare_split(layer, args, kwargs, whole, expert_parameters, group)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from lightning_hybrid._compat import tree_leaves, tree_map
from lightning_hybrid.expert_parallel.exchange import ExpertGroup


@dataclass
class LayerGradients:
    """A layer's output leaves, its floating inputs' gradients and its parameters' gradients (by name)."""

    outputs: list[Tensor]
    inputs: list[Tensor]
    parameters: dict[str, Tensor]


def layer_gradients(layer: nn.Module, args: tuple, kwargs: dict) -> LayerGradients:
    """One forward and backward of ``layer`` on a copy of the call, gradients kept apart from the model's."""
    held = {name: p.grad for name, p in layer.named_parameters()}
    for p in layer.parameters():
        p.grad = None
    args, kwargs = tree_map(_leaf, copy.deepcopy((args, kwargs)))  # a key/value cache it gets is updated in place
    inputs = [v for v in tree_leaves((args, kwargs)) if isinstance(v, Tensor) and v.requires_grad]
    outputs = [v for v in tree_leaves(layer(*args, **kwargs)) if isinstance(v, Tensor) and v.is_floating_point()]
    generator = torch.Generator(device=outputs[0].device).manual_seed(0)
    torch.autograd.backward(outputs, [torch.randn(o.shape, generator=generator, device=o.device, dtype=o.dtype)
                                      for o in outputs])
    # An expert no token of this rank chose has no gradient here: zero, so every rank sums the same names.
    grads = {name: _local(p.grad) if p.grad is not None else torch.zeros_like(_local(p.detach()))
             for name, p in layer.named_parameters() if p.requires_grad}
    for name, p in layer.named_parameters():
        p.grad = held.get(name)
    return LayerGradients([o.detach() for o in outputs], [i.grad for i in inputs], grads)


def compare_split(layer: nn.Module, args: tuple, kwargs: dict, whole: LayerGradients,
                  holds: Callable[[str], slice | None], group: ExpertGroup) -> float:
    """The largest relative difference between the split ``layer`` and ``whole`` over the group's ranks.
    ``holds(name)``: for an expert parameter, the slice of the whole one this rank holds (``None``: not an
    expert's parameter)."""
    split = layer_gradients(layer, args, kwargs)
    differences = [_relative(a, b) for a, b in zip(split.outputs + split.inputs, whole.outputs + whole.inputs)]
    pairs = []
    for name, grad in sorted(whole.parameters.items()):
        part = holds(name)
        if part is not None:  # every rank sums every expert's gradient, held here or not: one collective each
            grad = grad.clone()
            dist.all_reduce(grad, group=group.mesh.get_group())
            grad = grad[part]
        if name in split.parameters:
            pairs.append((split.parameters[name], grad))
    # A gradient that is zero in exact arithmetic (a key's bias under softmax) is rounding noise on both sides.
    floor = max((float(want.abs().max()) for _, want in pairs if want.numel()), default=0.0) * 1e-3
    differences += [_relative(got, want, floor) for got, want in pairs]
    largest = torch.tensor(max(differences, default=0.0), dtype=torch.float64)
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group.mesh.get_group())
    return float(largest)


def _leaf(value: object) -> object:
    if isinstance(value, Tensor) and value.is_floating_point():
        return value.detach().clone().requires_grad_(True)
    return value


def _local(grad: Tensor) -> Tensor:
    return grad.to_local() if isinstance(grad, DTensor) else grad


def _relative(a: Tensor | None, b: Tensor | None, floor: float = 0.0) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if not a.numel():
        return 0.0
    scale = max(float(b.abs().max()), floor, 1e-12)
    return float(((a.float() - b.float()).abs().max() / scale).nan_to_num(float("inf")))
