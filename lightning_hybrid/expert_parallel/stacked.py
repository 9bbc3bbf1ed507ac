"""Experts stacked in 3-D parameters (Hugging Face's ``MixtralExperts``, ``Qwen3MoeExperts``, DeepSeek-V3's, with or
without biases, gate|up fused as halves or interleaved), spread over the ranks of an expert-parallel group.

Such a module is called with the tokens, the experts the router chose for each (an integer ``(tokens, k)``
tensor) and the routing weights (``(tokens, k)``, or ``(tokens, experts)``), and returns the weighted sum of the
chosen experts' outputs. :func:`split_stack` keeps this rank's experts only (the parameters become DTensors sharded
along the expert dimension, so state dicts and checkpoints keep the unmodified names and shapes) and replaces the
forward by :func:`_dispatched_forward`: one row per token and chosen expert is sent to the rank holding the
expert, the module's **own** forward runs there on the rows received (each with its one local expert and weight
1), the results come back and are weighted and summed per token here, in the order the module sums them. The
router ran before, unchanged, on every rank; nothing is dropped.

Which argument is which is read from the call recorded at setup (:class:`CallRoles`); integer attributes equal to
the expert count (``num_experts``, read by grouped-GEMM kernels) are set to the local count while the forward
runs. The setup check (:mod:`.check`) compares the result with the unsplit module's.

Example::

    roles = CallRoles.of(call_args, call_kwargs, count=8)
    split_stack(block.mlp.experts, ExpertGroup(mesh["ep"], count=8), roles)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Shard

from lightning_hybrid.expert_parallel.exchange import ExpertGroup, return_rows, send_rows
from lightning_hybrid.expert_parallel.modules import base_forward, keeps_own_class, with_values

#: Where an argument is: its position, or its keyword.
Slot = Union[int, str]


def expert_count(module: nn.Module) -> int:
    """The number of experts ``module`` stacks: the leading size every one of its own parameters shares, if at least
    one is ≥ 3-D and it is ≥ 2 (0 otherwise: not a stack of experts)."""
    own = [p for p in module.parameters(recurse=False)]
    if not any(p.dim() >= 3 for p in own) or len({p.shape[0] for p in own if p.dim() >= 2}) != 1:
        return 0
    if any(p.dim() < 2 for p in own) or isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return 0
    return own[0].shape[0] if own[0].shape[0] >= 2 else 0


@dataclass(frozen=True)
class CallRoles:
    """Where a stacked experts module's call holds the tokens, the chosen experts and the routing weights, and
    whether the weights are one per choice (``(tokens, k)``) or one per expert (``(tokens, experts)``)."""

    tokens: Slot
    chosen: Slot
    weights: Slot
    per_choice: bool

    @staticmethod
    def of(args: tuple, kwargs: dict, count: int) -> Optional["CallRoles"]:
        """The roles in a recorded call, or ``None`` if it is not (tokens, chosen experts, weights): exactly one
        integer ``(tokens, k)`` tensor and two floating ``(tokens, ·)`` ones, the weights' width ``k`` or the
        expert count (the tokens, when both widths would do: the first)."""
        slots = {**{i: a for i, a in enumerate(args)}, **kwargs}
        tensors = {s: v for s, v in slots.items() if isinstance(v, Tensor)}
        chosen = [s for s, v in tensors.items() if not v.is_floating_point() and v.dim() == 2]
        if len(chosen) != 1 or len(tensors) != 3:
            return None
        rows, k = tensors[chosen[0]].shape
        floats = [s for s, v in tensors.items() if v.is_floating_point() and v.dim() == 2 and v.shape[0] == rows]
        if len(floats) != 2:
            return None
        weights = [s for s in floats if tensors[s].shape[1] in (k, count)]
        if not weights:
            return None
        weight = weights[-1]  # both fit (a width equal to k or to the expert count): the tokens come first
        tokens = floats[0] if floats[1] == weight else floats[1]
        return CallRoles(tokens, chosen[0], weight, per_choice=tensors[weight].shape[1] == k)

    def read(self, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
        return tuple(args[s] if isinstance(s, int) else kwargs[s] for s in (self.tokens, self.chosen, self.weights))

    def replaced(self, args: tuple, kwargs: dict, tokens: Tensor, chosen: Tensor, weights: Tensor) -> tuple[tuple, dict]:
        args, kwargs = list(args), dict(kwargs)
        for slot, value in ((self.tokens, tokens), (self.chosen, chosen), (self.weights, weights)):
            if isinstance(slot, int):
                args[slot] = value
            else:
                kwargs[slot] = value
        return tuple(args), kwargs


def split_stack(module: nn.Module, group: ExpertGroup, roles: CallRoles) -> None:
    """Keep this rank's experts of ``module`` (DTensors ``Shard(0)`` over ``group``'s mesh) and dispatch its calls."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        local = parameter.detach()[group.owned.start:group.owned.stop]
        dtensor = DTensor.from_local(local, group.mesh, [Shard(0)], run_check=False)
        setattr(module, name, nn.Parameter(dtensor, requires_grad=parameter.requires_grad))
    module.ep_group, module.ep_roles = group, roles
    module.ep_rescaled = tuple(key for key, value in vars(module).items()
                               if type(value) is int and value == group.count)
    keeps_own_class(module, "ExpertParallel", _dispatched_forward)


def _dispatched_forward(self: Any, *args: Any, **kwargs: Any) -> Tensor:
    group: ExpertGroup = self.ep_group
    tokens, chosen, weights = self.ep_roles.read(args, kwargs)
    if self.training:  # the figures count training tokens
        group.stats.add_routed(chosen, group.count)
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by rank, and per expert in the module's own order
    experts = flat[order]
    token_of = order // chosen.shape[1]
    per_rank = torch.bincount(experts // group.local, minlength=group.size).tolist()
    received, received_per_rank = send_rows(tokens[token_of], per_rank, group, counted=self.training)
    local_ids = _received_local_ids(experts % group.local, per_rank, received_per_rank, group)
    width = 1 if self.ep_roles.per_choice else group.local
    ones = weights.new_ones(received.shape[0], width)
    call = self.ep_roles.replaced(args, kwargs, received, local_ids.unsqueeze(1), ones)
    local = {name: p.to_local() for name, p in self._parameters.items() if isinstance(p, DTensor)}
    with with_values(self, local, {key: group.local for key in self.ep_rescaled}):
        results = base_forward(self, *call[0], **call[1])
    # Every rank sends results back and every local expert gets a gradient, even where no row arrived (a
    # collective and FSDP2's reduce-scatter need every rank): terms that add zero tie them into the graph.
    results = results + sum(p.reshape(-1)[:1].sum() for p in local.values()) * 0 + received.sum() * 0
    back = return_rows(results, per_rank, received_per_rank, group, counted=self.training)
    chosen_weights = weights.reshape(-1) if self.ep_roles.per_choice else weights.gather(1, chosen).reshape(-1)
    weighted = (back * chosen_weights[order].unsqueeze(1)).to(tokens.dtype)
    return tokens.new_zeros(tokens.shape[0], back.shape[1]).index_add(0, token_of, weighted)


def _received_local_ids(local_ids: Tensor, per_rank: list[int], received_per_rank: list[int],
                        group: ExpertGroup) -> Tensor:
    """The local expert index of every row received (the senders know it; integers need no gradient)."""
    received = local_ids.new_empty(sum(received_per_rank))
    torch.distributed.all_to_all_single(received, local_ids.contiguous(), received_per_rank, per_rank,
                                        group=group.mesh.get_group())
    return received
