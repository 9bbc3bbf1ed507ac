"""Model families of the test zoo beyond ``tests/models.py``'s four: third-party code where a package ships it
(the Hugging Face builders live in ``tests/zoo_hf.py``), and models written in styles no package ships. Each is
built from a config (no downloads), has the harness's vocabulary (64) and sequence length (16), returns logits, and
is written without any knowledge of parallelism.

Every entry of :data:`ZOO` names its builder, the config field holding its number of blocks, and the layouts it is
trained under against single-process Lightning (``tests/test_zoo.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests import zoo_hf as hf

VOCAB, SEQ = hf.VOCAB, hf.SEQ


# ----------------------------------------------------------------------------------------------------------------
# torchtitan-style Llama: blocks in an nn.ModuleDict keyed by layer id, a complex rotary buffer on the root
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TitanConfig:
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 4
    hidden: int = 64


def precompute_freqs_cis(head_dim: int, end: int, theta: float = 10000.0) -> Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    return torch.polar(torch.ones(end, head_dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary(x: Tensor, freqs_cis: Tensor) -> Tensor:
    """``x`` of shape ``(B, T, H, D)`` rotated by complex multiplication, as torchtitan does."""
    x_complex = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    rotated = torch.view_as_real(x_complex * freqs_cis[: x.shape[1]].view(1, x.shape[1], 1, -1)).flatten(3)
    return rotated.type_as(x)


class TitanAttention(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.dim, bias=False)
        self.wk = nn.Linear(config.dim, config.dim, bias=False)
        self.wv = nn.Linear(config.dim, config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim) for proj in (self.wq, self.wk, self.wv))
        q, k = apply_rotary(q, freqs_cis), apply_rotary(k, freqs_cis)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class TitanBlock(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.dim)
        self.attention = TitanAttention(config)
        self.ffn_norm = nn.RMSNorm(config.dim)
        self.w1 = nn.Linear(config.dim, config.hidden, bias=False)
        self.w2 = nn.Linear(config.hidden, config.dim, bias=False)
        self.w3 = nn.Linear(config.dim, config.hidden, bias=False)

    def forward(self, x: Tensor, freqs_cis: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), freqs_cis)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class TitanLlama(nn.Module):
    def __init__(self, config: TitanConfig) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, config.dim)
        self.register_buffer("freqs_cis", precompute_freqs_cis(config.dim // config.n_heads, SEQ), persistent=True)
        self.layers = nn.ModuleDict({str(i): TitanBlock(config) for i in range(config.n_layers)})
        self.norm = nn.RMSNorm(config.dim)
        self.output = nn.Linear(config.dim, VOCAB, bias=False)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        return self.output(self.norm(h))


# ----------------------------------------------------------------------------------------------------------------
# No repeated blocks at all: data parallelism must still shard it (one FSDP2 unit)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class FlatConfig:
    dim: int = 32
    n_layers: int = 1  # unused: the model has no block list


class FlatLM(nn.Module):
    """Embedding, one attention-free mixing layer and a gated MLP written inline, head: nothing repeats."""

    def __init__(self, config: FlatConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.mix = nn.Linear(SEQ, SEQ)  # mixes positions (causality does not matter for the test)
        self.up = nn.Linear(config.dim, 2 * config.dim)
        self.down = nn.Linear(config.dim, config.dim)
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        x = x + self.mix(x.transpose(1, 2)).transpose(1, 2) / math.sqrt(SEQ)
        gate, value = self.up(x).chunk(2, dim=-1)
        x = x + self.down(F.silu(gate) * value)
        return self.head(x)


# ----------------------------------------------------------------------------------------------------------------
# Parameters outside any submodule, tied weights, attributes of modules read across the trunk
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class SmallConfig:
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 4


class PlainBlock(nn.Module):
    """Pre-norm attention + MLP with separate projections; head counts read from attributes."""

    def __init__(self, config: SmallConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.n_heads, config.dim // config.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.q, self.k, self.v, self.o = (nn.Linear(config.dim, config.dim) for _ in range(4))
        self.up, self.down = nn.Linear(config.dim, 2 * config.dim), nn.Linear(2 * config.dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.o(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class RootParametersLM(nn.Module):
    """Learned position table and scales held directly by the model, next to its blocks: ``pos`` is read before
    the blocks, ``out_scale`` after them, ``temperature`` on both sides (a table tied across the trunk)."""

    def __init__(self, config: SmallConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.pos = nn.Parameter(0.02 * torch.randn(SEQ, config.dim))
        self.temperature = nn.Parameter(torch.ones(()))
        self.out_scale = nn.Parameter(torch.ones(config.dim))
        self.blocks = nn.ModuleList(PlainBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = (self.embed(tokens) + self.pos[: tokens.shape[1]]) * self.temperature
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x) * self.out_scale) / self.temperature


class TiedLM(nn.Module):
    """GPT-2-style tying: the output head is the token embedding (``head.weight is embed.weight``); the forward
    also reads attributes of modules that live on the other side of the trunk (a weight's dtype, a width)."""

    def __init__(self, config: SmallConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.pos = nn.Embedding(SEQ, config.dim)
        self.blocks = nn.ModuleList(PlainBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        # Read on every stage, wherever the head and the norm live (a vision transformer reads its patch
        # projection's dtype the same way).
        x = (self.embed(tokens) + self.pos(positions)).to(self.head.weight.dtype) * self.norm.weight.shape[0] ** 0
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class FusedGQABlock(nn.Module):
    """litgpt-style grouped-query attention with one fused ``qkv`` projection of unequal pieces (q: all heads, k
    and v: the key/value groups), then a plain MLP."""

    def __init__(self, config: SmallConfig, n_kv: int = 2) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = config.n_heads, n_kv, config.dim // config.n_heads
        self.norm1, self.norm2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.qkv = nn.Linear(config.dim, (config.n_heads + 2 * n_kv) * self.head_dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.up, self.down = nn.Linear(config.dim, 2 * config.dim), nn.Linear(2 * config.dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(
            [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = (z.view(b, t, self.n_kv, self.head_dim).transpose(1, 2) for z in (k, v))
        k, v = (z.repeat_interleave(self.n_heads // self.n_kv, dim=1) for z in (k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(attended)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class FusedGQALM(nn.Module):
    block_class: type[nn.Module] = FusedGQABlock

    def __init__(self, config: SmallConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.blocks = nn.ModuleList(self.block_class(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# ----------------------------------------------------------------------------------------------------------------
# Parts tensor parallelism cannot shard: a position table inside each block, a head count tp=2 does not divide
# ----------------------------------------------------------------------------------------------------------------
class PositionTable(nn.Module):
    """A learned position table each block adds to its input: a 2-D parameter in no linear layer."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.table = nn.Parameter(0.02 * torch.randn(SEQ, dim))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.table[: x.shape[1]]


class OddPartsBlock(PlainBlock):
    """:class:`PlainBlock` (3 heads of 7 at width 21: tp=2 divides neither) after a :class:`PositionTable`."""

    def __init__(self, config: SmallConfig) -> None:
        super().__init__(config)
        self.pos = PositionTable(config.dim)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(self.pos(x))


class OddPartsLM(FusedGQALM):
    r""":class:`FusedGQALM`'s trunk of :class:`OddPartsBlock`\ s: tensor parallelism at tp=2 keeps each block's
    position table and attention whole and shards its MLP, the embedding and the head
    (``tests/tensor_parallel/test_fallback.py``)."""

    block_class = OddPartsBlock


def _flow(name: str) -> Callable[[dict[str, Any]], nn.Module]:
    def build(config: dict[str, Any]) -> nn.Module:
        from tests import zoo_flow  # data-flow mechanisms: two block lists, values that skip stages

        return getattr(zoo_flow, name)(zoo_flow.FlowConfig(**config))

    return build


@dataclass(frozen=True)
class ZooEntry:
    """A family: how to build it from config overrides, and its number-of-blocks field."""

    build: Callable[[dict[str, Any]], nn.Module]
    layers_field: str


ZOO: dict[str, ZooEntry] = {
    "titan": ZooEntry(lambda config: TitanLlama(TitanConfig(**config)), "n_layers"),
    "flat": ZooEntry(lambda config: FlatLM(FlatConfig(**config)), "n_layers"),
    "root_params": ZooEntry(lambda config: RootParametersLM(SmallConfig(**config)), "n_layers"),
    "tied": ZooEntry(lambda config: TiedLM(SmallConfig(**config)), "n_layers"),
    "hf_gpt2": ZooEntry(hf.hugging_face_gpt2, "n_layer"),
    "fused_gqa": ZooEntry(lambda config: FusedGQALM(SmallConfig(**config)), "n_layers"),
    "hf_qwen2": ZooEntry(hf.hugging_face_qwen2, "num_hidden_layers"),
    "hf_phi3": ZooEntry(hf.hugging_face_phi3, "num_hidden_layers"),
    "hf_mixtral": ZooEntry(hf.hugging_face_mixtral, "num_hidden_layers"),
    "hf_gpt_neox": ZooEntry(hf.hugging_face_gpt_neox, "num_hidden_layers"),
    "hf_bert": ZooEntry(hf.hugging_face_bert, "num_hidden_layers"),
    "hf_vit": ZooEntry(hf.TokensAsImageViT, "num_hidden_layers"),
    "hf_t5_encoder": ZooEntry(hf.T5EncoderLM, "num_layers"),
    "mixed_moe": ZooEntry(lambda config: _mixed_moe(config), "n_layers"),
    "hf_bart": ZooEntry(hf.BartLM, "layers"),
    "hf_mamba": ZooEntry(hf.hugging_face_mamba, "num_hidden_layers"),
    "hf_deepseek_v3": ZooEntry(hf.hugging_face_deepseek_v3, "num_hidden_layers"),
    "hf_qwen3_moe": ZooEntry(hf.hugging_face_qwen3_moe, "num_hidden_layers"),
    "hf_olmo2": ZooEntry(hf.hugging_face_olmo2, "num_hidden_layers"),
    "hf_gpt_oss": ZooEntry(hf.hugging_face_gpt_oss, "num_hidden_layers"),
    "hf_zamba2": ZooEntry(hf.hugging_face_zamba2, "num_hidden_layers"),
    "hf_llama4": ZooEntry(hf.hugging_face_llama4, "num_hidden_layers"),
    "hf_swin": ZooEntry(hf.TokensAsImageSwin, "layers"),
    "diffusers_dit": ZooEntry(hf.TokensAsLatentsDiT, "layers"),
    "peft_lora": ZooEntry(hf.peft_lora_llama, "num_hidden_layers"),
    "litgpt": ZooEntry(hf.litgpt_gpt, "n_layer"),
    "two_lists": ZooEntry(_flow("ConditionedTwoListLM"), "n_layers"),
    "encoder_decoder": ZooEntry(_flow("EncoderDecoderLM"), "n_layers"),
    # not trained by the zoo: a step the pipeline cannot split right, for the setup verification to stop
    "early_exit_sum": ZooEntry(_flow("EarlyExitSumLM"), "n_layers"),
    "batch_normed": ZooEntry(_flow("BatchNormedLM"), "n_layers"),
    "odd_parts": ZooEntry(lambda config: OddPartsLM(SmallConfig(**{"dim": 21, "n_heads": 3, "n_layers": 2,
                                                                   **config})), "n_layers"),
    # the same family in another configuration: other width and head count, one key/value head, untied head
    "hf_qwen2_mqa": ZooEntry(lambda config: hf.hugging_face_qwen2(
        {"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 1, "tie_word_embeddings": False,
         **config}), "num_hidden_layers"),
}


def _mixed_moe(config: dict[str, Any]) -> nn.Module:
    from tests.zoo_mixed import MixedConfig, MixedLM  # it builds on this module's blocks

    return MixedLM(MixedConfig(**config))
