"""A small GPT language model and its LightningModule.

This file is deliberately *parallelism-unaware*: it is written the way an
ordinary user writes a GPT, with no FSDP, tensor-parallel or pipeline code.
``lightning_hybrid.HybridStrategy`` is expected to shard it as-is.

Usage::

    from recipes.gpt import GPTConfig, GPTLightning

    config = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=128)
    module = GPTLightning(config, lr=3e-3, weight_decay=0.1, warmup_steps=20, max_steps=200)
    logits = module(torch.randint(0, 64, (2, 64)))  # (B, T, vocab_size)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT", "GPTConfig", "GPTLightning", "Block", "CausalSelfAttention", "MLP"]


@dataclass
class GPTConfig:
    """Model dimensions.

    ``vocab_size`` should be a multiple of the tensor-parallel degree if the
    LM head is sharded over the vocabulary (the recipe pads it to 64).
    """

    vocab_size: int = 64
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        # Shapes are read from ``self`` (never from ``x.size(-1)``): under tensor
        # parallelism the planner rescales ``n_head``/``n_embd`` to the local
        # per-rank values while ``x`` still carries the full hidden size.
        B, T = x.shape[:2]
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.n_embd)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward network (4x expansion, GELU)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer: embeddings -> ``blocks`` -> final LN -> LM head.

    The LM head is not tied to the token embedding (a choice of this model:
    a tied pair would also train, one weight sharded over the vocabulary).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.apply(self._init_weights)
        # GPT-2 style: scale the residual output projections by 1/sqrt(2*n_layer)
        # so the residual stream variance does not grow with depth.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""
        T = idx.size(1)
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        return self.lm_head(x)


def cosine_with_warmup(warmup_steps: int, max_steps: int, min_ratio: float = 0.1) -> Callable[[int], float]:
    """Return a LambdaLR multiplier: linear warmup, then cosine decay to ``min_ratio``."""

    def lr_lambda(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda


class GPTLightning(pl.LightningModule):
    """Next-token-prediction training of :class:`GPT`.

    Usage::

        module = GPTLightning(GPTConfig(vocab_size=64), lr=3e-3, weight_decay=0.1,
                              warmup_steps=20, max_steps=200)
        trainer = pl.Trainer(max_steps=200)
        trainer.fit(module, datamodule=...)
    """

    def __init__(
        self,
        config: GPTConfig,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 20,
        max_steps: int = 200,
        meta_init: bool = False,
    ) -> None:
        """``meta_init=True``: the GPT is built on the meta device in :meth:`configure_model` (no memory; a model
        larger than one host) and ``HybridStrategy`` initializes each rank's shards with :meth:`init_module_weights`
        (GPT-2's scheme, other draws than the eager build's). Default: built and initialized here, on the CPU."""
        super().__init__()
        # Accept a plain dict too, so ``load_from_checkpoint`` can rebuild the
        # module from the (YAML-friendly) hyperparameters saved below. The hint
        # names GPTConfig alone: LightningCLI then reads ``config`` as a group of
        # fields, which a configuration can set and link one by one (a union with
        # Mapping would be one opaque value).
        if not isinstance(config, GPTConfig):
            config = GPTConfig(**config)
        self.config = config
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.save_hyperparameters(
            {"config": asdict(config), "lr": lr, "weight_decay": weight_decay,
             "warmup_steps": warmup_steps, "max_steps": max_steps, "meta_init": meta_init}
        )
        self.model = None if meta_init else GPT(config)

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = GPT(self.config)

    def init_module_weights(self, module: nn.Module) -> None:
        """GPT-2's initialization of ``module`` (called by ``HybridStrategy`` for a meta-built model, children
        first): what :class:`GPT`'s ``__init__`` does, module by module; LayerNorms keep ``reset_parameters()``."""
        GPT._init_weights(module)
        if isinstance(module, (CausalSelfAttention, MLP)):
            nn.init.normal_(module.c_proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.config.n_layer))

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(idx)

    def _loss(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        # Weight-decay only matrices/embeddings; biases and LayerNorm weights are
        # 1-D and decaying them just hurts (standard GPT-2/nanoGPT practice).
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.ndim >= 2]
        no_decay = [p for p in params if p.ndim < 2]
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": self.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=self.lr,
            betas=(0.9, 0.95),
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, cosine_with_warmup(self.warmup_steps, self.max_steps)
        )
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 1},
        }
