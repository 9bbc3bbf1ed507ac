"""Finding expert layers by structure and by one call of the block: stacked 3-D experts and their call's roles,
lists of modules a router chooses among, and what looks like experts but stays whole (with why)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid.expert_parallel.find import find_expert_layers
from lightning_hybrid.expert_parallel.stacked import CallRoles, expert_count
from tests.zoo_mixed import MixedConfig, MoEBlock


def _mixtral_layer() -> nn.Module:
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer

    config = MixtralConfig(hidden_size=16, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                           num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=1)
    return MixtralDecoderLayer(config, 0)


def test_stacked_experts_and_their_calls_roles_are_found() -> None:
    torch.manual_seed(0)
    layer = _mixtral_layer()
    found = find_expert_layers(layer.mlp, (torch.randn(2, 6, 16),), {})
    assert list(found.stacks) == ["experts"] and not found.lists and not found.kept
    roles = found.stacks["experts"].roles
    assert roles == CallRoles(tokens=0, chosen=1, weights=2, per_choice=True)
    assert expert_count(layer.mlp.experts) == 4 and expert_count(layer.mlp.gate) == 0  # the router is 2-D


def test_weights_per_expert_are_told_from_weights_per_choice() -> None:
    tokens, chosen = torch.randn(5, 8), torch.randint(0, 4, (5, 2))
    dense = CallRoles.of((tokens, chosen, torch.rand(5, 4)), {}, count=4)  # GPT-OSS: one weight per expert
    assert dense == CallRoles(0, 1, 2, per_choice=False)
    assert CallRoles.of((tokens,), {"router_indices": chosen, "routing_weights": torch.rand(5, 2)}, count=4) == \
        CallRoles(0, "router_indices", "routing_weights", per_choice=True)
    assert CallRoles.of((tokens,), {}, count=4) is None  # Llama 4: tokens already grouped by expert


def test_a_list_of_experts_is_found_with_the_module_that_runs_them() -> None:
    torch.manual_seed(0)
    config = MixedConfig()
    block = MoEBlock(config)
    found = find_expert_layers(block, (torch.randn(2, 8, config.dim),), {})
    assert list(found.lists) == ["experts"] and not found.stacks
    call = found.lists["experts"]
    assert call.host == "" and call.output_tails == [(config.dim,)] * config.n_experts


class _Branches(nn.Module):
    """Identical modules that every token goes through (heads of a multi-branch layer): no router chooses."""

    def __init__(self) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(branch(x) for branch in self.branches)


class _Pairs(nn.Module):
    """Identical modules called with two arguments: their rows cannot be sent alone."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Bilinear(8, 8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(expert(x[:2], x[:2]).sum(0) for expert in self.experts[:2]) + x


@pytest.mark.parametrize(("module", "reason"), [
    (_Branches(), "every module of the list computes every token"),
    (_Pairs(), "not each called with one tensor of rows"),
])
def test_lists_that_are_not_routed_experts_stay_whole_with_the_reason(module: nn.Module, reason: str) -> None:
    found = find_expert_layers(module, (torch.randn(4, 8),), {})
    assert not found.lists and not found.stacks
    assert len(found.kept) == 1 and reason in next(iter(found.kept.values()))


def test_stacked_experts_called_without_chosen_experts_stay_whole() -> None:
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    config = Llama4TextConfig(hidden_size=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=1)
    found = find_expert_layers(Llama4TextMoe(config), (torch.randn(2, 3, 16),), {})
    assert not found.stacks and "its call is not (tokens, chosen experts, routing weights)" in found.kept["experts"]
