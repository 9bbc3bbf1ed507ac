"""What the block trace records (:mod:`lightning_hybrid.tensor_parallel.dataflow`) beyond the linear layers' pairs:
values written in place, choices made on a layer's output, what modules with weights of their own compute on."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_hybrid.tensor_parallel.dataflow import trace_block


class _WritesKeysInPlace(nn.Module):
    """Builds its keys in a fresh tensor by in-place copies (as DeepSeek-V3's ``expand_kv``): one part from ``b``,
    one from ``a`` through a norm, then a router choosing on ``r``'s output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.r, self.out = nn.Linear(8, 4), nn.Linear(8, 4), nn.Linear(8, 2), nn.Linear(8, 8)
        self.norm = nn.LayerNorm(4)

    def forward(self, x: Tensor) -> Tensor:
        keys = x.new_empty(*x.shape[:-1], 8)
        keys[..., :4].copy_(self.b(x))
        keys[..., 4:] = self.norm(self.a(x))
        chosen = torch.topk(self.r(x), 1, dim=-1).indices
        return x + self.out(keys) * chosen


def test_writes_into_a_view_reach_what_its_base_holds_and_choices_are_noted() -> None:
    trace = trace_block(_WritesKeysInPlace(), (torch.randn(2, 3, 8),), {})
    assert trace.linears["out"].sources == {"a", "b"}  # what was written; new_empty takes only x's shape
    assert trace.selected == {"r"}
    assert trace.module_inputs == {"norm": frozenset({"a"})}
