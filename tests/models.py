"""Tiny, parallelism-unaware language models used by the equivalence tests.

Both models are written the way an ordinary user writes them: no FSDP, tensor-parallel or pipeline code, no
knowledge of the mesh. ``HybridStrategy`` must shard them as they are, and the equivalence tests check that the
sharded training produces the same numbers as plain single-process Lightning.

Two architectures on purpose, because they stress different parts of a tensor-parallel planner:

* :class:`TinyGPT` - learned positional embedding, fused ``qkv`` projection (``nn.Linear(C, 3C)``) and linear
  biases, bias-free LayerNorm, GELU MLP.
* :class:`TinyLlama` - no positional embedding, rotary embedding tables computed once in the model's forward
  and passed to every block as a second argument, grouped-query attention (``n_kv_heads < n_heads``) with
  separate ``wq/wk/wv/wo`` without bias, RMSNorm, SwiGLU MLP.

Attention modules keep their head counts and sizes as integer attributes and read every shape from them, never
from ``x.size(-1)``: a tensor-parallel planner rescales those attributes to the per-rank (local) values while
the block input ``x`` still has the full hidden size.

Both are deliberately tiny (vocab 64, sequence 16, hidden 32, 2 layers) so a multi-process CPU run over gloo
takes seconds, and have no dropout so that nothing random happens after initialisation.

Numerical choices that keep the reference-vs-parallel noise floor far below the tests' 1e-5 tolerance
------------------------------------------------------------------------------------------------------
A parallel run sums the same numbers in a different order, so gradients differ from the reference by fp32
rounding (~1e-7 relative, more where a gradient is a near-cancelling sum). Adam divides by ``sqrt(v) + eps`` and
so turns a gradient entry near ``eps`` into an O(lr) update whose exact value depends on that rounding. Measured
against Lightning's DDP (which is correct by construction), with AdamW's default ``eps=1e-8`` the worst parameter
differed by up to 2e-5 (Llama) and 2e-3 (GPT); this is why:

* ``adam_eps=1e-5``: far above gradient rounding noise (~1e-10 here) and far below typical gradient entries
  (~1e-3 after clipping), so Adam still normalises real gradients but no longer amplifies noise into updates.
* ``lr=3e-3``: parameters still move by ~1e-2 (three orders of magnitude above the tolerance), but rounding
  differences grow less over the steps than at 1e-2 (measured worst case 1.8e-6 vs 4.6e-6 over 6 seeds).
* GPT's LayerNorms have no bias (as in GPT variants built with ``bias=False``): a LayerNorm bias in front of
  ``qkv`` receives an exactly-cancelling gradient through the key path and starts at zero, so its per-tensor
  relative difference was the largest in the model. The ``qkv`` bias is kept because sharding a fused bias is
  something a tensor-parallel planner must get right (its key third also has an exactly-zero gradient, which is
  harmless with the ``eps`` above because that tensor does not start at zero).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from tests.zoo import ZOO

__all__ = [
    "MODEL_NAMES",
    "GPTConfig",
    "LlamaConfig",
    "TinyGPT",
    "TinyLlama",
    "RMSNorm",
    "ALL_MODEL_NAMES",
    "LAYERS_FIELD",
    "PIPELINE_MODEL_NAMES",
    "LMLightningModule",
    "RandomTokenDataset",
    "build_module",
    "default_config",
]

ModelName = Literal["gpt", "llama", "tuple", "hf_llama"]
#: The two models every layout is tested on.
MODEL_NAMES: tuple[ModelName, ...] = ("gpt", "llama")
#: Models for pipeline parallelism only: blocks returning tuples and taking keyword arguments built outside the
#: trunk (``tuple``), and an unmodified Hugging Face ``LlamaForCausalLM`` (``hf_llama``).
PIPELINE_MODEL_NAMES: tuple[ModelName, ...] = ("tuple", "hf_llama")
#: These and the families of the zoo (``tests/zoo.py``).
ALL_MODEL_NAMES: tuple[str, ...] = MODEL_NAMES + PIPELINE_MODEL_NAMES + tuple(ZOO)
#: The config field holding each model's number of blocks.
LAYERS_FIELD: dict[str, str] = {
    "gpt": "num_layers", "llama": "n_layers", "tuple": "num_layers", "hf_llama": "num_hidden_layers",
    **{name: entry.layers_field for name, entry in ZOO.items()},
}


# ----------------------------------------------------------------------------------------------------------------
# GPT-style model (fused QKV)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class GPTConfig:
    """Dimensions of :class:`TinyGPT`. Head count and vocabulary are divisible by 2 and 4 (tensor-parallel)."""

    vocab_size: int = 64
    seq_len: int = 16
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    mlp_ratio: int = 4


class FusedSelfAttention(nn.Module):
    """Causal multi-head self-attention with one fused ``qkv`` projection."""

    def __init__(self, embed_dim: int, num_heads: int) -> None:
        super().__init__()
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        # Integer attributes a tensor-parallel planner may rescale to local (per-rank) values.
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.qkv = nn.Linear(embed_dim, 3 * embed_dim)
        self.proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        B, T = x.shape[:2]
        # Split by the (possibly local) embed_dim attribute, not by x's last dimension.
        q, k, v = self.qkv(x).split(self.embed_dim, dim=-1)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(B, T, self.embed_dim)
        return self.proj(y)


class GeluMLP(nn.Module):
    """Two-layer feed-forward network with GELU."""

    def __init__(self, embed_dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc_in = nn.Linear(embed_dim, hidden_dim)
        self.fc_out = nn.Linear(hidden_dim, embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc_out(F.gelu(self.fc_in(x)))


class GPTBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.embed_dim, bias=False)
        self.attn = FusedSelfAttention(config.embed_dim, config.num_heads)
        self.ln_2 = nn.LayerNorm(config.embed_dim, bias=False)
        self.mlp = GeluMLP(config.embed_dim, config.mlp_ratio * config.embed_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """GPT-style decoder: token + learned position embeddings, ``blocks``, final LayerNorm, untied ``head``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.embed_dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.embed_dim)
        self.blocks = nn.ModuleList(GPTBlock(config) for _ in range(config.num_layers))
        self.ln_f = nn.LayerNorm(config.embed_dim, bias=False)
        # Untied on purpose: weight tying across an embedding and a head sharded differently is out of scope.
        self.head = nn.Linear(config.embed_dim, config.vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------------------------------------------
# Llama-style model (RoPE, GQA, SwiGLU, RMSNorm)
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class LlamaConfig:
    """Dimensions of :class:`TinyLlama`. ``n_heads`` and ``n_kv_heads`` are divisible by a tensor-parallel 2."""

    vocab_size: int = 64
    seq_len: int = 16
    dim: int = 32
    n_heads: int = 4
    n_kv_heads: int = 2
    n_layers: int = 2
    ffn_hidden: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale (no bias, no mean subtraction)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | None = None) -> Tensor:
    """Rotary tables as ONE tensor of shape ``(seq_len, head_dim // 2, 2)`` holding ``(cos, sin)`` pairs.

    A single tensor (rather than a tuple) keeps the extra block argument simple for module hooks, activation
    checkpointing and pipeline stages.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: Tensor, rope: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(B, H, T, head_dim)`` with the "rotate half" convention."""
    cos, sin = rope[..., 0], rope[..., 1]  # (T, head_dim // 2) each, broadcast over B and H
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class GQAttention(nn.Module):
    """Causal grouped-query attention with separate bias-free projections ``wq, wk, wv, wo``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        if config.dim % config.n_heads or config.n_heads % config.n_kv_heads:
            raise ValueError("dim must be divisible by n_heads and n_heads by n_kv_heads")
        # Integer attributes a tensor-parallel planner may rescale to local (per-rank) values.
        self.n_heads = config.n_heads
        self.n_kv_heads = config.n_kv_heads
        self.head_dim = config.dim // config.n_heads
        self.wq = nn.Linear(config.dim, config.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * self.head_dim, config.dim, bias=False)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        B, T = x.shape[:2]
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # Query head h uses kv head h // n_rep; with contiguous head sharding this stays rank-local.
        n_rep = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """SwiGLU feed-forward: ``w2(silu(w1(x)) * w3(x))`` (gate ``w1``, up ``w3``, down ``w2``)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm Llama block taking the rotary tables as a second argument."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = GQAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config.dim, config.ffn_hidden)

    def forward(self, x: Tensor, rope: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x), rope)
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLlama(nn.Module):
    """Llama-style decoder: token embedding, ``layers`` (each ``block(x, rope)``), final RMSNorm, ``output``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        """Map token ids ``(B, T)`` to logits ``(B, T, vocab_size)``."""
        # Computed once here, outside the trunk, and handed to every block (as torchtitan's Llama does): the
        # blocks must accept an extra non-parameter tensor argument, which is what the strategy has to support.
        head_dim = self.config.dim // self.config.n_heads
        rope = rope_tables(idx.shape[1], head_dim, self.config.rope_theta, device=idx.device)
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, rope)
        return self.output(self.norm(x))


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face-style blocks: keyword arguments built outside the trunk, tuple outputs
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class TupleConfig:
    """Dimensions of :class:`TupleBlocksLM`."""

    vocab_size: int = 64
    seq_len: int = 16
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 4


class TupleBlock(nn.Module):
    """``block(hidden_states, attention_mask=..., position_bias=...) -> (hidden_states, attention_probs)``."""

    def __init__(self, config: TupleConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.embed_dim // config.num_heads
        self.norm = nn.LayerNorm(config.embed_dim)
        self.query = nn.Linear(config.embed_dim, config.embed_dim)
        self.key = nn.Linear(config.embed_dim, config.embed_dim)
        self.value = nn.Linear(config.embed_dim, config.embed_dim)
        self.out = nn.Linear(config.embed_dim, config.embed_dim)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor, position_bias: Tensor) -> tuple[Tensor, Tensor]:
        b, t, _ = hidden_states.shape
        x = self.norm(hidden_states)
        q, k, v = (proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2) for proj in (self.query, self.key, self.value))
        scores = q @ k.transpose(-1, -2) / self.head_dim**0.5 + attention_mask + position_bias
        probs = scores.softmax(-1)
        attended = (probs @ v).transpose(1, 2).reshape(b, t, -1)
        return hidden_states + self.out(attended), probs


class TupleBlocksLM(nn.Module):
    """Blocks in ``layers`` take a causal mask and a position bias computed in the model's forward as keyword
    arguments, and return ``(hidden_states, attention_probs)`` of which the model keeps element 0."""

    def __init__(self, config: TupleConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.embed_dim)
        self.layers = nn.ModuleList(TupleBlock(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.embed_dim)
        self.lm_head = nn.Linear(config.embed_dim, config.vocab_size)

    def forward(self, idx: Tensor) -> Tensor:
        hidden_states = self.embed(idx)
        t = idx.shape[1]
        positions = torch.arange(t, device=idx.device)
        mask = torch.full((t, t), float("-inf"), device=idx.device, dtype=hidden_states.dtype).triu(1)
        bias = -0.1 * (positions[:, None] - positions[None, :]).abs().to(hidden_states.dtype)
        for layer in self.layers:
            outputs = layer(hidden_states, attention_mask=mask, position_bias=bias)
            hidden_states = outputs[0]
        return self.lm_head(self.final_norm(hidden_states))


def hugging_face_llama(config: dict[str, Any]) -> nn.Module:
    """An unmodified ``transformers.LlamaForCausalLM`` (untied embeddings), tiny, returning logits."""
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    settings = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, attn_implementation="eager",
    )
    settings.update(config)
    return LlamaForCausalLM(HFLlamaConfig(**settings))


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------
class RandomTokenDataset(Dataset):
    """``num_samples`` fixed random token sequences; item ``i`` is ``(tokens[:-1], tokens[1:])``.

    Generated once from a private generator so the content is identical in every process and every run,
    independent of the global RNG state.
    """

    def __init__(self, num_samples: int = 64, seq_len: int = 16, vocab_size: int = 64, seed: int = 1234) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab_size, (num_samples, seq_len + 1), generator=generator)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        row = self.tokens[index]
        return row[:-1], row[1:]


# ----------------------------------------------------------------------------------------------------------------
# LightningModule
# ----------------------------------------------------------------------------------------------------------------
def _warmup_then_constant(warmup_steps: int) -> Callable[[int], float]:
    """Learning-rate factor: linear warm-up over ``warmup_steps`` optimizer steps, then 1."""

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / warmup_steps)

    return factor


class LMLightningModule(pl.LightningModule):
    """Plain LightningModule around :class:`TinyGPT` or :class:`TinyLlama`.

    The model is built eagerly in ``__init__`` right after ``torch.manual_seed(seed)``, so every process of a
    distributed run starts from bit-identical weights without any broadcast (the strategy may still broadcast).

    Arguments:
        model: ``"gpt"`` (:class:`TinyGPT`) or ``"llama"`` (:class:`TinyLlama`).
        seed: Seed for the initial weights.
        lr, weight_decay, adam_eps: AdamW settings (see the module docstring for the non-default ``eps``).
        warmup_steps: Optimizer steps of linear learning-rate warm-up (a ``LambdaLR`` stepped every step, so a
            strategy that miscounts steps shows up in the numbers).
        config: Overrides of the model's config dataclass fields.
        init: ``"eager"`` builds the model in ``__init__`` after ``torch.manual_seed(seed)``; ``"meta"`` builds it
            on the meta device in ``configure_model`` (the strategy materializes and initializes it);
            ``"per_module"`` builds it eagerly in ``configure_model`` and initializes it with
            :func:`lightning_hybrid.parallel.initialization.init_weights` — what ``"meta"`` must equal on one device.
        pretrained: A Hugging Face checkpoint directory whose weights replace the built model's (as
            ``from_pretrained`` loads them): the single-device reference of ``HybridStrategy(weights=...)``.
        compile_blocks: The module compiles its blocks itself (``block.compile()`` on each, as built): the compiled
            single-device reference of ``HybridStrategy(compile=True)``, and a module the strategy must not
            compile twice.
        sync_loss: ``False`` logs ``train_loss`` without ``sync_dist`` (each rank's own value: the global one without
            data parallelism), the other path through Lightning's result collection.
        freeze: Name prefixes (relative to the built model, e.g. ``"blocks.0"``) of parameters built with
            ``requires_grad=False``: fine-tuning part of a model, or a pipeline stage without any gradient.
        left_padding: Treat each sample's first ``tokens[0] % 4`` positions as left padding (a Hugging Face model):
            ``attention_mask`` passed to the model, the padded targets ignored by the loss (its mean over the
            remaining tokens), as a padded batch of unequal lengths.
        ignore_padded: With ``left_padding``, ``False`` keeps the padded positions' targets in the loss (a mean over
            every token, which microbatching does not change).
    """

    def __init__(
        self,
        model: ModelName = "gpt",
        seed: int = 42,
        lr: float = 3e-3,
        weight_decay: float = 0.1,
        warmup_steps: int = 3,
        adam_eps: float = 1e-5,
        config: dict[str, Any] | None = None,
        init: Literal["eager", "meta", "per_module"] = "eager",
        log_metrics: bool = False,
        pretrained: str | None = None,
        compile_blocks: bool = False,
        sync_loss: bool = True,
        freeze: tuple[str, ...] = (),
        left_padding: bool = False,
        ignore_padded: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        if log_metrics:  # Lightning's documented way: the torchmetrics object itself goes to self.log
            from torchmetrics.classification import MulticlassAccuracy

            self.train_acc = MulticlassAccuracy(num_classes=64, average="micro")
            self.val_acc = MulticlassAccuracy(num_classes=64, average="micro")
        if model not in ALL_MODEL_NAMES:
            raise ValueError(f"unknown model {model!r}; expected one of {ALL_MODEL_NAMES}")
        self.model: nn.Module | None = None
        torch.manual_seed(seed)  # as seed_everything(seed) would; the strategy initializes meta models from it
        if init == "eager":
            self.model = self._build()

    def _build(self) -> nn.Module:
        model = self._build_model()
        for name, parameter in model.named_parameters():
            if name.startswith(tuple(self.hparams.freeze)):
                parameter.requires_grad_(False)
        return model

    def _build_model(self) -> nn.Module:
        model, config = self.hparams.model, self.hparams.config or {}
        if model == "gpt":
            return self._compiled(TinyGPT(GPTConfig(**config)))
        if model == "llama":
            return self._compiled(TinyLlama(LlamaConfig(**config)))
        if model == "tuple":
            return self._compiled(TupleBlocksLM(TupleConfig(**config)))
        built = ZOO[model].build(config) if model in ZOO else hugging_face_llama(config)
        if self.hparams.pretrained:
            built.load_state_dict(type(built).from_pretrained(self.hparams.pretrained).state_dict())
        return self._compiled(built)

    def _compiled(self, model: nn.Module) -> nn.Module:
        if self.hparams.compile_blocks:
            for block in model.blocks if hasattr(model, "blocks") else model.layers:
                block.compile()
        return model

    def configure_model(self) -> None:
        if self.model is not None:
            return  # built in __init__, or by an earlier fit (Lightning calls this hook again for test/predict)
        if self.hparams.init == "meta":
            with torch.device("meta"):
                self.model = self._build()
        else:
            from lightning_hybrid.parallel.initialization import init_weights

            self.model = self._build()
            init_weights(self, self.hparams.seed)

    def _attention_mask(self, idx: Tensor) -> Tensor | None:
        if not self.hparams.get("left_padding"):
            return None
        return (torch.arange(idx.shape[1], device=idx.device) >= (idx[:, :1] % 4)).long()

    def forward(self, idx: Tensor) -> Tensor:
        mask = self._attention_mask(idx)
        output = self.model(idx) if mask is None else self.model(idx, attention_mask=mask)
        # A mixture of experts asked for its router logits (``output_router_logits=True``) returns its load-balancing
        # loss beside the logits: the step adds it, weighted as the model's own loss would.
        self._aux_loss = getattr(output, "aux_loss", None)
        return getattr(output, "logits", output)  # Hugging Face models return an output object

    def _loss(self, batch: tuple[Tensor, Tensor], accuracy: Any = None, name: str = "") -> Tensor:
        inputs, targets = batch
        logits = self(inputs)
        mask = self._attention_mask(inputs)
        if mask is not None and self.hparams.get("ignore_padded", True):  # the mean over the unpadded targets
            targets = targets.masked_fill(mask == 0, -100)
        if accuracy is not None:
            accuracy(logits.argmax(-1).reshape(-1), targets.reshape(-1))
            self.log(name, accuracy, on_step=name.startswith("train"), on_epoch=True)
        # Mean over all B*T tokens of this rank's batch. Every data-parallel rank has the same batch size, so
        # the mean over ranks equals the mean over the global batch (what a single process computes).
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        aux, self._aux_loss = getattr(self, "_aux_loss", None), None
        if aux is None:
            return loss
        self.log("aux_loss", aux.detach(), sync_dist=True)
        return loss + self.model.config.router_aux_loss_coef * aux

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = self._loss(batch, getattr(self, "train_acc", None), "train_acc")
        self.log("train_loss", loss, sync_dist=self.hparams.sync_loss, on_step=True)
        # A summed metric: over data-parallel ranks it must add up to the global batch, whatever tp/pp are.
        self.log("tokens", float(batch[1].numel()), sync_dist=True, on_step=True, reduce_fx="sum")
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch, getattr(self, "val_acc", None), "val_acc"), sync_dist=True)

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self) -> dict[str, Any]:
        optimizer = torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay, eps=self.hparams.adam_eps
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _warmup_then_constant(self.hparams.warmup_steps))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def build_module(model: ModelName, seed: int = 42, **kwargs: Any) -> LMLightningModule:
    """Convenience constructor used by the harness and tests."""
    return LMLightningModule(model=model, seed=seed, **kwargs)


def default_config(model: ModelName) -> dict[str, Any]:
    """The dataclass defaults of ``model`` as a dict (handy for sizing the dataset)."""
    if model in ("tuple", "hf_llama") or model in ZOO:
        return asdict(TupleConfig())  # same vocabulary and sequence length
    return asdict(GPTConfig() if model == "gpt" else LlamaConfig())

