"""A zoo family whose blocks differ in structure within one list: dense layers alternating with
mixture-of-experts layers of another class (an ``nn.Linear`` router choosing the top 2 of 4 experts, each an
``nn.Linear`` MLP in an ``nn.ModuleList``), as DeepSeek/Qwen-MoE-style models interleave them. Written without any
knowledge of parallelism; vocabulary and sequence length are the harness's."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.zoo import VOCAB, FusedGQALM, PlainBlock, SmallConfig


@dataclass
class MixedConfig(SmallConfig):
    n_experts: int = 4
    top_k: int = 2


class ExpertMLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class MoEBlock(nn.Module):
    """Attention as in :class:`PlainBlock`, then a routed mixture of expert MLPs over the flattened tokens."""

    def __init__(self, config: MixedConfig) -> None:
        super().__init__()
        self.attention = PlainBlock(config)
        self.norm = nn.LayerNorm(config.dim)
        self.router = nn.Linear(config.dim, config.n_experts, bias=False)
        self.experts = nn.ModuleList(ExpertMLP(config.dim) for _ in range(config.n_experts))
        self.top_k = config.top_k

    def forward(self, x: Tensor) -> Tensor:
        x = self.attention(x)
        tokens = self.norm(x).reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(dim=-1), self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        mixed = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            token_index, slot = torch.where(chosen == index)
            routed = expert(tokens[token_index]) * weights[token_index, slot, None]
            mixed = mixed.index_add(0, token_index, routed)
        return x + mixed.view_as(x)


class MixedLM(nn.Module):
    def __init__(self, config: MixedConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.blocks = nn.ModuleList(MoEBlock(config) if index % 2 else PlainBlock(config)
                                    for index in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB)

    forward = FusedGQALM.forward  # embed, blocks, norm, head
