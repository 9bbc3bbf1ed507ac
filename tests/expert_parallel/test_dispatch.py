"""Experts split over two ranks compute what the whole layer computes: outputs, the tokens' and routing weights'
gradients, and each expert's gradient (on the rank holding it: the sum over both ranks' tokens), with routing made
hard on purpose — one rank's tokens all chosen for the other rank's experts, an expert no token chooses, and a
model loop calling only the experts some token chose (a different number of calls on each rank)."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from lightning_hybrid.expert_parallel.apply import ExpertSplitRefused, _divisible
from lightning_hybrid.expert_parallel.exchange import ExpertGroup
from lightning_hybrid.expert_parallel.lists import split_list
from lightning_hybrid.expert_parallel.stacked import CallRoles, split_stack
from lightning_hybrid.mesh import ParallelDims
from tests.helpers import on_two_ranks

DIM, EXPERTS, TOKENS = 8, 4, 6
#: Per rank, each token's two chosen experts: rank 0 only chooses rank 1's experts (2, 3); nobody chooses expert 1.
CHOSEN = {0: [[2, 3], [3, 2], [2, 3], [3, 2], [2, 3], [2, 3]], 1: [[0, 2], [3, 0], [0, 3], [2, 0], [0, 2], [3, 2]]}


def _mixtral_experts() -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    torch.manual_seed(0)
    experts = MixtralExperts(MixtralConfig(hidden_size=DIM, intermediate_size=12, num_local_experts=EXPERTS))
    for parameter in experts.parameters():
        nn.init.normal_(parameter, std=0.5)
    return experts


class _HitOnly(nn.Module):
    """A mixture whose loop calls only the experts some token chose."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(DIM, 12), nn.GELU(), nn.Linear(12, DIM))
                                     for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for index in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == index)
            out = out.index_add(0, rows, self.experts[index](x[rows]) * weights[rows, slot, None])
        return out


def _run(layer: nn.Module, tokens: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> dict:
    tokens, weights = tokens.clone().requires_grad_(), weights.clone().requires_grad_()
    out = layer(tokens, chosen, weights)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    local = {name: p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
             for name, p in layer.named_parameters() if p.grad is not None}
    # an expert no token here chose has no gradient: zero, so both ranks sum the same names
    grads = {name: local.get(name, torch.zeros(p.shape)) for name, p in layer.named_parameters()}
    return {"out": out.detach(), "tokens": tokens.grad, "weights": weights.grad, "grads": grads}


def _split_vs_whole(rank: int, results: dict, kind: str) -> None:
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))["ep"]
    torch.manual_seed(1 + rank)
    tokens, weights = torch.randn(TOKENS, DIM), torch.rand(TOKENS, 2)
    chosen = torch.tensor(CHOSEN[rank])
    layer = _mixtral_experts() if kind == "stacked" else _HitOnly()
    whole = _run(copy.deepcopy(layer), tokens, chosen, weights)
    group = ExpertGroup(mesh, EXPERTS)
    if kind == "stacked":
        split_stack(layer, group, CallRoles(0, 1, 2, per_choice=True))
    else:
        split_list(layer, list(layer.experts), group, [(DIM,)] * EXPERTS)
    split = _run(layer, tokens, chosen, weights)
    errors = {key: float((split[key] - whole[key]).abs().max()) for key in ("out", "tokens", "weights")}
    for name, grad in sorted(whole["grads"].items()):
        dist.all_reduce(grad)  # every rank's tokens reach the expert: its gradient is the sum over ranks
        held = grad[2 * rank:2 * rank + 2] if kind == "stacked" else grad
        if name in split["grads"]:
            errors[name] = float((split["grads"][name] - held).abs().max() / held.abs().max().clamp_min(1e-6))
    results[rank] = {"errors": errors, "names": sorted(name for name, p in layer.named_parameters() if p.grad is not None),
                     "shapes": {
        name: tuple(p.to_local().shape if hasattr(p, "to_local") else p.shape) for name, p in layer.named_parameters()},
        "tokens_per_expert": group.stats.tokens_per_expert.tolist(), "bytes": group.stats.bytes_sent}


@pytest.mark.parametrize("kind", ["stacked", "list"])
def test_split_experts_compute_what_the_whole_layer_computes(kind: str) -> None:
    results = on_two_ranks(_split_vs_whole, kind)
    for rank in (0, 1):
        errors = results[rank]["errors"]
        assert max(errors.values()) < 1e-5, (rank, errors)
    if kind == "stacked":  # each rank holds half of every stacked weight, under its unmodified name
        assert results[0]["shapes"] == {"gate_up_proj": (2, 24, DIM), "down_proj": (2, DIM, 12)}
        assert results[0]["names"] == ["down_proj", "gate_up_proj"]  # expert 1 got no token: a zero gradient, present
    else:  # each rank keeps its two experts; the others' weights are not held
        assert results[0]["names"] == [f"experts.{e}.{i}.{w}" for e in (0, 1) for i in (0, 2) for w in ("bias", "weight")]
        assert sorted(results[1]["shapes"]) == [f"experts.{e}.{i}.{w}" for e in (2, 3) for i in (0, 2)
                                                for w in ("bias", "weight")]
    assert results[0]["tokens_per_expert"] == [0, 0, 6, 6] and results[1]["tokens_per_expert"] == [5, 0, 4, 3]
    # What crosses to the other rank: rank 0's 12 choices (all rank 1's experts) go there and the results for rank
    # 1's 5 choices of expert 0 come back from here (and the reverse on rank 1); 8 floats a row, the backward
    # sending as much again. A rank's choices of its own experts cross no link and are not counted.
    assert results[0]["bytes"] == results[1]["bytes"] == 2 * (12 + 5) * DIM * 4


def test_an_expert_count_the_ranks_cannot_share_is_refused_with_the_valid_sizes() -> None:
    with pytest.raises(ExpertSplitRefused, match=re.escape("holds 6 experts, which 4 ranks cannot share equally."
                                                           " Pass an ep that divides 6 (and the data-parallel"
                                                           " degree): [1, 2, 3, 6]")):
        _divisible("model.layers.0.mlp.experts", 6, 4)


def test_an_ep_that_does_not_divide_the_data_parallel_degree_is_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("dp × cp = 6 (per pipeline stage and replica) is not a multiple"
                                                   " of it. Pass an ep that divides 6: [1, 2, 3, 6]")):
        ParallelDims(world_size=12, dp="auto", pp=2, ep=4)
    assert ParallelDims(world_size=8, dp="auto", pp=2, ep=4).ep == 4
