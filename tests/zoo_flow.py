"""Zoo models for data-flow mechanisms no package isolates: two block lists run one after the other, values that
skip stages (a conditioning vector and an encoder's output handed to every block), and a block's module called
from outside its block. Written without any knowledge of parallelism, like the rest of the zoo (vocabulary 64,
sequence length 16, logits out)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.zoo_hf import VOCAB


@dataclass
class FlowConfig:
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 4  # blocks of each list


class Attention(nn.Module):
    """Multi-head attention; ``memory`` (another sequence) gives the keys and values of cross-attention."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x: Tensor, memory: Tensor | None = None, causal: bool = False) -> Tensor:
        memory = x if memory is None else memory
        b, t, d = x.shape

        def split(y: Tensor) -> Tensor:
            return y.view(b, -1, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(memory)), split(self.v(memory)),
                                           is_causal=causal)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Modulation(nn.Module):
    """adaLN: shift and scale from the conditioning vector; ``emb`` also builds that vector (as diffusers' DiT
    calls ``transformer_blocks[0].norm1.emb`` from its forward)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.emb = nn.Linear(dim, dim)
        self.to_shift_scale = nn.Linear(dim, 2 * dim)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False)

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        shift, scale = self.to_shift_scale(F.silu(cond)).unsqueeze(1).chunk(2, dim=-1)
        return self.norm(x) * (1 + scale) + shift


class DoubleStreamBlock(nn.Module):
    """Two streams (image and text in a diffusion transformer) attending jointly, each with its own weights."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        d = config.dim
        self.mod_a, self.mod_b = Modulation(d), Modulation(d)
        self.attn = Attention(d, config.n_heads)
        self.mlp_a = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.mlp_b = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, a: Tensor, b: Tensor, cond: Tensor) -> tuple[Tensor, Tensor]:
        joint = torch.cat([self.mod_a(a, cond), self.mod_b(b, cond)], dim=1)
        mixed = self.attn(joint, causal=True)
        a, b = a + mixed[:, : a.shape[1]], b + mixed[:, a.shape[1]:]
        return a + self.mlp_a(a), b + self.mlp_b(b)


class SingleStreamBlock(nn.Module):
    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.mod = Modulation(config.dim)
        self.attn = Attention(config.dim, config.n_heads)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 2 * config.dim), nn.GELU(), nn.Linear(2 * config.dim, config.dim))

    def forward(self, x: Tensor, cond: Tensor) -> Tensor:
        x = x + self.attn(self.mod(x, cond), causal=True)
        return x + self.mlp(x)


class ConditionedTwoListLM(nn.Module):
    """A diffusion-transformer-shaped LM: a conditioning vector computed before the trunk (by a module of the
    first block, called from outside it) reaches every block of two lists — double-stream, then single-stream
    over the joined streams; the final layer's conditioning is computed again after the trunk by the same module
    of the first block (as diffusers' ``DiTTransformer2DModel`` calls ``transformer_blocks[0].norm1.emb``)."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        d = config.dim
        self.embed = nn.Embedding(VOCAB, d)
        self.side = nn.Linear(d, d)  # the second stream, from the same tokens
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(config) for _ in range(config.n_layers))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(config) for _ in range(config.n_layers))
        self.final = Modulation(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        cond = self.double_blocks[0].mod_a.emb(x.mean(dim=1))  # a block's module, called from outside its block
        a, b = x, self.side(x)
        for block in self.double_blocks:
            a, b = block(a, b, cond)
        h = torch.cat([b, a], dim=1)
        for block in self.single_blocks:
            h = block(h, cond)
        final_cond = self.double_blocks[0].mod_a.emb(self.embed(tokens).mean(dim=1))
        return self.head(self.final(h[:, b.shape[1]:], final_cond))


class EncoderBlock(nn.Module):
    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(config.dim), nn.LayerNorm(config.dim)
        self.attn = Attention(config.dim, config.n_heads)
        self.mlp = nn.Sequential(nn.Linear(config.dim, 2 * config.dim), nn.GELU(), nn.Linear(2 * config.dim, config.dim))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class DecoderBlock(EncoderBlock):
    def __init__(self, config: FlowConfig) -> None:
        super().__init__(config)
        self.norm_cross = nn.LayerNorm(config.dim)
        self.cross = Attention(config.dim, config.n_heads)

    def forward(self, x: Tensor, memory: Tensor) -> Tensor:  # type: ignore[override]
        x = x + self.attn(self.norm1(x), causal=True)
        x = x + self.cross(self.norm_cross(x), memory=memory)
        return x + self.mlp(self.norm2(x))


class EncoderDecoderLM(nn.Module):
    """An encoder over the tokens, then a causal decoder whose every block cross-attends to the encoder's output
    (after the encoder's final norm)."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.encoder = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layers))
        self.encoder_norm = nn.LayerNorm(config.dim)
        self.decoder = nn.ModuleList(DecoderBlock(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        memory = self.embed(tokens)
        for block in self.encoder:
            memory = block(memory)
        memory = self.encoder_norm(memory)
        x = self.embed(tokens.roll(1, dims=1))
        for block in self.decoder:
            x = block(x, memory)
        return self.head(self.norm(x))


class EarlyExitSumLM(nn.Module):
    """Adds the first block's output to the last block's after the trunk, a value no block is handed: under a
    pipeline it is another stage's, so the last stage cannot know it; the setup verification must stop it."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layers))
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        early = x
        for index, block in enumerate(self.blocks):
            x = block(x)
            if index == 0:
                early = x
        return self.head(x + early)


class BatchNormedLM(nn.Module):
    """Normalizes the embeddings with BatchNorm (statistics over the samples a forward sees): microbatches change
    the step, which the setup verification must name (with or without the unsplit model)."""

    def __init__(self, config: FlowConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, config.dim)
        self.norm = nn.BatchNorm1d(config.dim)
        self.blocks = nn.ModuleList(EncoderBlock(config) for _ in range(config.n_layers))
        self.head = nn.Linear(config.dim, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.norm(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x)
