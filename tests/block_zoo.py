"""Transformer blocks written in the styles found in the wild, for the tensor-parallel planner's tests.

Each block takes ``x`` of shape ``(B, T, DIM)`` and is written as its source project writes it (names, reshape
idioms, where head counts live); none knows about parallelism.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

DIM, HEADS = 32, 4


class TimmAttention(nn.Module):
    """timm ViT style: ``qkv.reshape(B, N, 3, heads, head_dim).permute(2, 0, 3, 1, 4)`` then ``unbind``."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.head_dim = DIM // HEADS
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, N = x.shape[:2]
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, -1))


class LitStyleAttention(nn.Module):
    """litgpt style: sizes read from a shared config object, fused qkv split by explicit sizes."""

    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.attn = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[:2]
        size = self.config.n_head * self.config.head_size
        q, k, v = self.attn(x).split((size, size, size), dim=-1)
        q, k, v = (t.view(B, T, self.config.n_head, self.config.head_size).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, size))


class HFAttention(nn.Module):
    """Hugging Face style: separate projections, ``view(*input_shape, -1, head_dim)``, no head count used."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.num_key_value_groups = 2
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM // 2, bias=False)
        self.v_proj = nn.Linear(DIM, DIM // 2, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        input_shape = x.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(x).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(x).view(hidden_shape).transpose(1, 2).repeat_interleave(self.num_key_value_groups, dim=1)
        v = self.v_proj(x).view(hidden_shape).transpose(1, 2).repeat_interleave(self.num_key_value_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(*input_shape, -1).contiguous())


class WindowedAttention(HFAttention):
    """Reads a ``sliding_window`` equal to its head count that changes nothing here (Gemma 3: the mask is built
    outside; a full-attention layer of the same class holds ``None``): rescaling it is never needed."""

    def __init__(self) -> None:
        super().__init__()
        self.sliding_window = HEADS

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) if self.sliding_window is None or self.sliding_window > 0 else x


class NanoGPTAttention(nn.Module):
    """nanoGPT style: the head size is derived from the input width ``C // n_head`` (cannot run on local heads)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.n_embd = HEADS, DIM
        self.c_attn = nn.Linear(DIM, 3 * DIM)
        self.c_proj = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class FusedGQAttention(nn.Module):
    """A fused projection with fewer key/value heads: q, k, v pieces of unequal width."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.n_kv, self.head_dim = HEADS, HEADS // 2, DIM // HEADS
        self.qkv = nn.Linear(DIM, DIM + 2 * (DIM // 2))
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[:2]
        q, k, v = self.qkv(x).split((self.n_head * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim), -1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2).repeat_interleave(2, dim=1)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2).repeat_interleave(2, dim=1)
        return self.out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class GroupedQKVAttention(nn.Module):
    """One fused projection laid out per key/value group (Megatron's, ChatGLM's ``query_key_value``): for each of
    the 2 groups its 2 query heads, then its key and its value head (q q k v | q q k v)."""

    def __init__(self) -> None:
        super().__init__()
        self.n_kv, self.per_group, self.head_dim = HEADS // 2, 2, DIM // HEADS
        self.query_key_value = nn.Linear(DIM, self.n_kv * (self.per_group + 2) * self.head_dim)
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[:2]
        grouped = self.query_key_value(x).view(B, T, self.n_kv, (self.per_group + 2) * self.head_dim)
        q, k, v = grouped.split((self.per_group * self.head_dim, self.head_dim, self.head_dim), dim=-1)
        q = q.reshape(B, T, -1, self.head_dim).transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(self.per_group, dim=1)
        v = v.transpose(1, 2).repeat_interleave(self.per_group, dim=1)
        return self.dense(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, -1))


class SlicedQKVAttention(nn.Module):
    """Phi-3 style: one fused ``qkv_proj`` of unequal pieces cut by slicing with sizes read from a config object,
    ``num_key_value_groups`` query heads per key/value head (``repeat_interleave``)."""

    def __init__(self, kv_heads: int = 2) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=HEADS)
        self.head_dim, self.num_key_value_heads = DIM // HEADS, kv_heads
        self.num_key_value_groups = HEADS // kv_heads
        self.qkv_proj = nn.Linear(DIM, DIM + 2 * kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        shape = (*x.shape[:-1], -1, self.head_dim)
        qkv = self.qkv_proj(x)
        query_pos = self.config.num_attention_heads * self.head_dim
        q = qkv[..., :query_pos]
        k = qkv[..., query_pos: query_pos + self.num_key_value_heads * self.head_dim]
        v = qkv[..., query_pos + self.num_key_value_heads * self.head_dim:]
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        k, v = (t.repeat_interleave(self.num_key_value_groups, dim=1) for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(*x.shape[:-1], -1))


class MultiQueryAttention(HFAttention):
    """Hugging Face style with a single key/value head: fewer key/value heads than tensor-parallel ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.num_key_value_groups = HEADS
        self.k_proj = nn.Linear(DIM, DIM // HEADS, bias=False)
        self.v_proj = nn.Linear(DIM, DIM // HEADS, bias=False)


class SelectiveScanMixer(nn.Module):
    """A Mamba-style state-space mixer as the reference implementation writes it: ``in_proj`` to x|z cut after a
    transpose, a depthwise ``conv1d`` called as a module (``groups`` = channels), ``x_proj`` to dt|B|C, ``dt_proj``
    called as a module, a sequential scan reading ``A_log`` and ``D`` and sized by ``self.inner``, ``out_proj``."""

    def __init__(self, state: int = 4, rank: int = 4, kernel: int = 3) -> None:
        super().__init__()
        self.inner, self.state, self.rank = 2 * DIM, state, rank
        self.in_proj = nn.Linear(DIM, 2 * self.inner)
        self.conv1d = nn.Conv1d(self.inner, self.inner, kernel, groups=self.inner, padding=kernel - 1)
        self.x_proj = nn.Linear(self.inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, self.inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(self.inner, 1))
        self.D = nn.Parameter(torch.ones(self.inner))
        self.out_proj = nn.Linear(self.inner, DIM)

    def forward(self, x: Tensor) -> Tensor:
        length = x.shape[1]
        h, z = self.in_proj(x).transpose(1, 2).chunk(2, dim=1)
        h = F.silu(self.conv1d(h)[..., :length]).transpose(1, 2)
        dt, B, C = self.x_proj(h).split([self.rank, self.state, self.state], dim=-1)
        dt, A = F.softplus(self.dt_proj(dt)), -torch.exp(self.A_log)
        state, ys = x.new_zeros(x.shape[0], self.inner, self.state), []
        for t in range(length):
            state = torch.exp(dt[:, t, :, None] * A) * state + dt[:, t, :, None] * B[:, t, None] * h[:, t, :, None]
            ys.append((state * C[:, t, None]).sum(-1))
        return self.out_proj((torch.stack(ys, dim=1) + h * self.D) * F.silu(z.transpose(1, 2)))


class GateUpMLP(nn.Module):
    """Phi-3 style: gate and up projections fused into one layer, cut with ``chunk(2)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down_proj = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * F.silu(gate))


class GeluMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class ThreeLayerMLP(nn.Module):
    """up → mid → down: only one column/row pair fits; the third layer must stay whole."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.mid = nn.Linear(2 * DIM, DIM)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.mid(F.gelu(self.up(x)))))


class WeightNormalizedMLP(GeluMLP):
    """Normalizes by hand by its up layer's weight norm: the weight is read outside the layer's own call, which no
    sharding of it can serve (a sharded weight is a DTensor there)."""

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x) / self.up.weight.norm()))


class Conv1D(nn.Module):
    """GPT-2's transposed linear (weight ``[in, out]``, applied as ``x @ w``)."""

    def __init__(self, nx: int, nf: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.weight + self.bias


class ConvMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = Conv1D(DIM, 4 * DIM)
        self.c_proj = Conv1D(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class ScoresReturningAttention(TimmAttention):
    """Returns its attention probabilities next to its output, as Hugging Face's eager attention does."""

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T = x.shape[:2]
        q, k, v = self.qkv(x).reshape(B, T, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1) * self.head_dim**-0.5).softmax(-1)
        return self.proj((scores @ v).transpose(1, 2).reshape(B, T, -1)), scores


class ScoresReturningBlock(nn.Module):
    """A decoder layer returning ``(hidden, attention probabilities)``; the model drops the probabilities."""

    def __init__(self) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), ScoresReturningAttention(), nn.LayerNorm(DIM), GeluMLP()

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        attended, scores = self.attn(self.ln_1(x))
        x = x + attended
        return x + self.mlp(self.ln_2(x)), scores


class SequentialBlock(nn.Module):
    """Pre-norm ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.ln_1, self.attn, self.ln_2, self.mlp = nn.LayerNorm(DIM), attn, nn.LayerNorm(DIM), mlp

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class ParallelBlock(nn.Module):
    """GPT-J / PaLM style: attention and MLP read the same normalized input, ``x + attn + mlp``."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.attn, self.mlp = nn.LayerNorm(DIM), TimmAttention(), GeluMLP()

    def forward(self, x: Tensor) -> Tensor:
        h = self.ln(x)
        return x + self.attn(h) + self.mlp(h)


def build(style: str) -> nn.Module:
    """A fresh block of the given style (seeded, so every rank builds the same weights)."""
    torch.manual_seed(0)
    return {
        "timm": lambda: SequentialBlock(TimmAttention(), GeluMLP()),
        "litgpt": lambda: SequentialBlock(LitStyleAttention(SimpleNamespace(n_head=HEADS, head_size=DIM // HEADS,
                                                                             n_embd=DIM)), GeluMLP()),
        "hf": lambda: SequentialBlock(HFAttention(), GeluMLP()),
        "nanogpt": lambda: SequentialBlock(NanoGPTAttention(), GeluMLP()),
        "fused_gqa": lambda: SequentialBlock(FusedGQAttention(), GeluMLP()),
        "three_layer_mlp": lambda: SequentialBlock(HFAttention(), ThreeLayerMLP()),
        "weight_normalized": lambda: SequentialBlock(NanoGPTAttention(), WeightNormalizedMLP()),
        "conv1d": lambda: SequentialBlock(TimmAttention(), ConvMLP()),
        "parallel": ParallelBlock,
        "phi3": lambda: SequentialBlock(SlicedQKVAttention(), GateUpMLP()),
        "phi3_mqa": lambda: SequentialBlock(SlicedQKVAttention(kv_heads=1), GateUpMLP()),
        "mqa": lambda: SequentialBlock(MultiQueryAttention(), GeluMLP()),
        "grouped_qkv": lambda: SequentialBlock(GroupedQKVAttention(), GeluMLP()),
        "selective_scan": lambda: SequentialBlock(SelectiveScanMixer(), GeluMLP()),
        "returns_scores": ScoresReturningBlock,
        "windowed": lambda: SequentialBlock(WindowedAttention(), GeluMLP()),
    }[style]()
