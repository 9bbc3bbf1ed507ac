"""Modules between a column layer and its row partner that the plan leaves whole are found by their inputs
(the multi-rank equivalence of the repair is the model zoo's Qwen3-MoE under tp2)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_hybrid.tensor_parallel.sharded_path import sharded_path_styles


class PerHeadNorm(nn.Module):
    """q projected, viewed as heads of 4 features, each head RMS-normalized (Qwen3's q_norm), then projected out;
    ``width`` is the projection's output: the sharded copy holds half the heads."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = nn.Linear(8, width)
        self.q_norm = nn.RMSNorm(4)
        self.o = nn.Linear(width, 8)
        self.norm_in = nn.LayerNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        q = self.q(self.norm_in(x)).view(*x.shape[:2], -1, 4)
        return self.o(self.q_norm(q).flatten(2))


def test_a_weighted_module_fed_a_sharded_tensor_gets_sequence_parallel_along_that_dimension() -> None:
    x = torch.randn(2, 3, 8)
    styles = sharded_path_styles(PerHeadNorm(8), PerHeadNorm(4), (x,), {}, skip={"q", "o"}, tp=2)
    assert list(styles) == ["q_norm"]  # norm_in sees the whole input on every rank: left as it is
    assert isinstance(styles["q_norm"], SequenceParallel) and styles["q_norm"].sequence_sharding[0].dim == 2
