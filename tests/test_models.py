"""The test models honour the contract a tensor-parallel planner relies on.

A planner shards attention by heads and rescales the attention module's integer attributes (``num_heads`` /
``embed_dim`` for GPT, ``n_heads`` / ``n_kv_heads`` for Llama) to per-rank values. These tests do that by hand
for 2 "ranks" in one process - column-parallel ``qkv``/``wq``/``wk``/``wv`` (whole heads per rank), row-parallel
``proj``/``wo`` - and check that the partial outputs sum to the unsharded output. If a model derived a head size
from ``x.size(-1)`` or mixed heads across ranks, this would fail here rather than deep inside a strategy test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.models import MODEL_NAMES, FusedSelfAttention, GQAttention, LlamaConfig, build_module, rope_tables

TP = 2


def _rows(linear: nn.Linear, index: torch.Tensor) -> nn.Linear:
    """A copy of ``linear`` keeping output rows ``index`` (column-parallel shard)."""
    local = nn.Linear(linear.in_features, len(index), bias=linear.bias is not None)
    with torch.no_grad():
        local.weight.copy_(linear.weight[index])
        if linear.bias is not None:
            local.bias.copy_(linear.bias[index])
    return local


def _cols(linear: nn.Linear, index: torch.Tensor, keep_bias: bool) -> nn.Linear:
    """A copy of ``linear`` keeping input columns ``index`` (row-parallel shard; bias only on one rank)."""
    local = nn.Linear(len(index), linear.out_features, bias=keep_bias and linear.bias is not None)
    with torch.no_grad():
        local.weight.copy_(linear.weight[:, index])
        if local.bias is not None:
            local.bias.copy_(linear.bias)
    return local


def test_fused_attention_shards_by_heads() -> None:
    torch.manual_seed(0)
    attn = FusedSelfAttention(embed_dim=32, num_heads=4)
    x = torch.randn(2, 16, 32)
    full = attn(x)
    local_dim = 32 // TP
    out = torch.zeros_like(full)
    for rank in range(TP):
        own = torch.arange(rank * local_dim, (rank + 1) * local_dim)
        # Rows q[rank], k[rank], v[rank] of the fused weight: whole heads of each of q, k and v.
        qkv_rows = torch.cat([own, own + 32, own + 64])
        local = copy.copy(attn)  # shallow: new attribute dict, submodules replaced below
        local._modules = dict(attn._modules)
        local.qkv = _rows(attn.qkv, qkv_rows)
        local.proj = _cols(attn.proj, own, keep_bias=rank == 0)
        local.num_heads, local.embed_dim = attn.num_heads // TP, attn.embed_dim // TP
        out += local(x)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


def test_gqa_attention_shards_by_heads() -> None:
    torch.manual_seed(0)
    config = LlamaConfig()
    attn = GQAttention(config)
    x = torch.randn(2, 16, config.dim)
    rope = rope_tables(16, attn.head_dim, config.rope_theta)
    full = attn(x, rope)
    q_local = config.n_heads // TP * attn.head_dim
    kv_local = config.n_kv_heads // TP * attn.head_dim
    out = torch.zeros_like(full)
    for rank in range(TP):
        q_own = torch.arange(rank * q_local, (rank + 1) * q_local)
        kv_own = torch.arange(rank * kv_local, (rank + 1) * kv_local)
        local = copy.copy(attn)
        local._modules = dict(attn._modules)
        local.wq, local.wk, local.wv = _rows(attn.wq, q_own), _rows(attn.wk, kv_own), _rows(attn.wv, kv_own)
        local.wo = _cols(attn.wo, q_own, keep_bias=False)
        local.n_heads, local.n_kv_heads = attn.n_heads // TP, attn.n_kv_heads // TP
        out += local(x, rope)
    torch.testing.assert_close(out, full, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_same_seed_same_weights_and_shapes(model: str) -> None:
    a, b = build_module(model), build_module(model)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
    logits = a(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)
    other_seed = build_module(model, seed=1).state_dict()
    matrices = [name for name, tensor in a.state_dict().items() if tensor.dim() == 2]
    assert not any(torch.equal(other_seed[name], a.state_dict()[name]) for name in matrices)
