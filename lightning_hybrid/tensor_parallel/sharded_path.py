"""Modules a plan leaves whole that compute on sharded activations, made to compute there correctly.

Between a column-parallel layer and its row-parallel partner the activations are sharded (each tensor-parallel
rank holds its heads). A module there with weights of its own — Qwen3's per-head ``q_norm``/``k_norm``, RMSNorms over
each head's features — computes the right values on its rank's heads, but its weight, kept whole on every rank,
gets only its rank's heads' part of the gradient: the plan check (which compares gradients) refuses the pair. Such
a module is found by its input: in the sharded block it receives a tensor with one dimension ``tp`` times smaller
than in the unsharded block. torch's ``SequenceParallel(sequence_dim=d)`` style then treats that input as sharded
along ``d`` (no communication), keeps the weight a replicated DTensor, and DTensor sums its gradient over the ranks;
DTensor computes the module's own operations on the sharded input, a reduction over the sharded dimension itself
included (OLMo 2's q/k RMSNorm over the whole projection width: its mean of squares is summed over the ranks). A
sharded block that fails at such a module (its whole weight meeting a shard) still shows the module's input
before failing; the planner styles it and runs the block again, until it runs or nothing new is
found. The plan check decides whether the result computes what the unsharded block does.

Example::

    styles = sharded_path_styles(reference, sharded, args, kwargs, skip={"self_attn.q_proj", ...}, tp=2)
    styles      # {"self_attn.q_norm": SequenceParallel(sequence_dim=2), "self_attn.k_norm": ...}
"""

from __future__ import annotations

import copy
import functools
from typing import Collection

import torch
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel


def sharded_path_styles(reference: nn.Module, sharded: nn.Module, args: tuple, kwargs: dict,
                        skip: Collection[str], tp: int) -> dict[str, ParallelStyle]:
    """A ``SequenceParallel`` style for each module holding weights (not in ``skip``, the planned layers) whose
    first input is ``tp`` times smaller along exactly one dimension in ``sharded`` than in ``reference``."""
    candidates = [name for name, module in reference.named_modules()
                  if name and name not in skip and any(True for _ in module.parameters(recurse=False))]
    expected, got = _input_shapes(reference, candidates, args, kwargs), _input_shapes(sharded, candidates, args, kwargs)
    styles: dict[str, ParallelStyle] = {}
    for name in candidates:
        whole, local = expected.get(name), got.get(name)
        if whole is None or local is None or len(whole) != len(local):
            continue
        differing = [dim for dim, (a, b) in enumerate(zip(whole, local)) if a != b]
        if len(differing) == 1 and whole[differing[0]] == local[differing[0]] * tp:
            styles[name] = SequenceParallel(sequence_dim=differing[0], use_local_output=True)
    return styles


def _input_shapes(block: nn.Module, names: list[str], args: tuple, kwargs: dict) -> dict[str, tuple[int, ...]]:
    """The shape of the first tensor each named module receives when ``block`` runs on a copy of the call."""
    shapes: dict[str, tuple[int, ...]] = {}

    def note(name: str, module: nn.Module, inputs: tuple) -> None:
        if inputs and isinstance(inputs[0], torch.Tensor) and name not in shapes:
            shapes[name] = tuple(inputs[0].shape)

    handles = [block.get_submodule(name).register_forward_pre_hook(functools.partial(note, name)) for name in names]
    try:
        call_args, call_kwargs = copy.deepcopy((args, kwargs))
        with torch.no_grad():
            block(*call_args, **call_kwargs)
    except Exception:  # noqa: BLE001 - the shapes seen up to the failure (often a whole weight meeting a shard)
        pass
    finally:
        for handle in handles:
            handle.remove()
    return shapes
