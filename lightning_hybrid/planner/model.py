"""A transformer's sizes for the planner: :class:`ModelShape`, given by dimensions, by a parameter count, or measured
from a built module (on any device, the meta device included).

Example::

    ModelShape(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    ModelShape.from_parameter_count(7e9, seq_len=4096)                # a GPT-3-shaped model of about 7B
    ModelShape.from_module("recipes.gpt:GPTModule", {}, seq_len=128, heads=4)   # exact counts, on the meta device
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from torch import nn

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.checkpoint.module_class import instantiate_on_meta
from lightning_hybrid.probe.blocks import find_block_list


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer's sizes. Parameter counts left ``None`` follow from the dimensions: per block
    q and o h² each, k and v h·kv_heads·(h/heads) each, MLP (3 if gated else 2)·h·ffn_hidden, two norm weights
    of h (whole over tp), no biases; token embedding V·h (first stage); final norm h and head V·h unless tied
    (last stage). :meth:`from_module` gives exact counts instead."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    kv_heads: Optional[int] = None  # default: heads
    ffn_hidden: Optional[int] = None  # default: 4·hidden
    gated_mlp: bool = False
    tied_embeddings: bool = False
    dropout: bool = False  # dropout masks are saved for backward
    flash_attention: bool = True  # False: attention scores are materialized, a·s² per sequence
    # the blocks' element-wise chains run as fused kernels (Megatron's bias-GeLU, bias-dropout-add and
    # scale-mask-softmax); False: one kernel per operation, as eager PyTorch runs them (compile=True fuses them)
    fused_elementwise: bool = False
    # Llama's reference RMSNorm in eager PyTorch: upcast to fp32, square, mean, scale, downcast, weight (torchtitan's
    # and Hugging Face's); False: one kernel (torch's layer_norm, or any norm under compile)
    fp32_norm: bool = False
    rotary: bool = False  # rotary position embeddings on q and k in every block (learned positions cost nothing)
    # the blocks' linear layers train in float8 as torchao's Float8Linear does (tensorwise scales): their GEMMs at
    # the fp8 tensor-core rate, plus the casts (planner/kernels.py, traffic.py). Only to check the planner against
    # published float8 runs: HybridStrategy trains in bf16 and has no float8 option.
    float8_linears: bool = False
    parameters_per_block: Optional[int] = None
    whole_parameters_per_block: Optional[int] = None  # left whole by tensor parallelism
    first_stage_parameters: Optional[int] = None  # embeddings
    last_stage_parameters: Optional[int] = None  # final norm and head
    # mixture of experts: routed experts per MoE block (0: dense), each token's k of them, one expert's MLP width
    # (default ffn_hidden), how many blocks are MoE (default all; DeepSeek-V3's first 3 of 61 are dense), shared
    # experts every token goes through; an MoE block holds attention, a router (h·experts), shared and routed experts
    experts: int = 0
    experts_per_token: int = 1
    expert_ffn_hidden: Optional[int] = None
    moe_layers: Optional[int] = None
    shared_experts: int = 0

    def __post_init__(self) -> None:
        check_positive_values("ModelShape", layers=self.layers, hidden=self.hidden, heads=self.heads,
                        vocab=self.vocab, seq_len=self.seq_len)
        self._default("kv_heads", self.heads)
        self._default("ffn_hidden", 4 * self.hidden)
        check_positive_values("ModelShape", kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: hidden ({self.hidden}) must be divisible by heads ({self.heads}) and heads"
                             f" by kv_heads ({self.kv_heads}).")
        h, kv_width = self.hidden, self.kv_heads * (self.hidden // self.heads)
        self._default("whole_parameters_per_block", 2 * h)
        self._check_experts()
        attention = 2 * h * h + 2 * h * kv_width
        dense = attention + (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        moe = attention + h * self.experts + (self.experts + self.shared_experts) * self.expert_parameters
        average = ((self.layers - self.moe_layers) * dense + self.moe_layers * moe) / self.layers
        self._default("parameters_per_block", round(average) + self.whole_parameters_per_block)
        self._default("first_stage_parameters", self.vocab * h)
        self._default("last_stage_parameters", h + (0 if self.tied_embeddings else self.vocab * h))

    def _check_experts(self) -> None:
        self._default("expert_ffn_hidden", self.ffn_hidden)
        self._default("moe_layers", self.layers if self.experts else 0)
        if self.experts and not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(f"ModelShape: experts_per_token ({self.experts_per_token}) must be between 1 and experts"
                             f" ({self.experts}).")
        if not 0 <= self.moe_layers <= self.layers or (self.moe_layers and not self.experts):
            raise ValueError(f"ModelShape: moe_layers ({self.moe_layers}) must be at most layers ({self.layers}),"
                             " and needs experts > 0.")

    @property
    def expert_parameters(self) -> int:
        """One expert's parameters (an MLP of ``expert_ffn_hidden``)."""
        return (3 if self.gated_mlp else 2) * self.hidden * self.expert_ffn_hidden

    @property
    def routed_parameters_per_block(self) -> float:
        """The routed experts' parameters, averaged over the blocks (what expert parallelism spreads)."""
        return self.moe_layers * self.experts * self.expert_parameters / self.layers

    @property
    def active_parameters_per_block(self) -> float:
        """Parameters one token computes with per block, averaged over the blocks: the routed experts it is not
        sent to left out (what FLOPs follow)."""
        unused = self.moe_layers * (self.experts - self.experts_per_token) * self.expert_parameters / self.layers
        return self.parameters_per_block - unused

    @property
    def active_ffn_hidden(self) -> float:
        """The MLP width a token's activations span per block, averaged: k routed and the shared experts' in MoE
        blocks."""
        routed = (self.experts_per_token + self.shared_experts) * self.expert_ffn_hidden
        return ((self.layers - self.moe_layers) * self.ffn_hidden + self.moe_layers * routed) / self.layers

    def _default(self, name: str, value: int) -> None:
        if getattr(self, name) is None:
            object.__setattr__(self, name, value)  # frozen: defaults are filled in once, here

    @property
    def outside_block_parameters(self) -> int:
        return self.first_stage_parameters + self.last_stage_parameters

    @property
    def total_parameters(self) -> int:
        return self.layers * self.parameters_per_block + self.outside_block_parameters

    @classmethod
    def from_parameter_count(cls, parameters: float, seq_len: int, vocab: int = 32000) -> "ModelShape":
        """A GPT-3-shaped model of about ``parameters``: hidden ≈ 128 × layers (GPT-3's table: 4096/32 at 6.7B,
        12288/96 at 175B) rounded to a multiple of 1024, head size 128 (heads = hidden/128, a multiple of 8, so
        any tp ≤ 8 divides it), ffn 4·hidden, untied embeddings; of the depths that are multiples of 4, the one
        whose total is closest to ``parameters``."""
        check_positive_values("ModelShape.from_parameter_count", integer=False, parameters=parameters)
        check_positive_values("ModelShape.from_parameter_count", seq_len=seq_len, vocab=vocab)
        shapes = []
        for layers in range(4, 1025, 4):
            hidden = max(1024, int(128 * layers / 1024 + 0.5) * 1024)  # half up
            shapes.append(cls(layers=layers, hidden=hidden, heads=hidden // 128, vocab=vocab, seq_len=seq_len))
        return min(shapes, key=lambda shape: abs(shape.total_parameters - parameters))

    @classmethod
    def from_module(cls, target: str, kwargs: Optional[Mapping[str, Any]] = None, *, seq_len: Optional[int] = None,
                    heads: Optional[int] = None, kv_heads: Optional[int] = None) -> "ModelShape":
        """Measure ``"package.module:ClassName"`` built from ``kwargs`` on the meta device (``configure_model()``
        too). Exact counts: total, per block (blocks from :func:`find_block_list`; the largest block if they
        differ; its 1-D parameters count as whole over tp), embeddings (``nn.Embedding`` outside the blocks:
        first stage) and the rest (last stage). Read from the structure: hidden (first ``nn.Linear`` of a block,
        else the embedding width), vocabulary (widest embedding or linear outside the blocks), ``ffn_hidden`` and
        gating (the block's linears into and out of the MLP), ``kv_heads`` (k/v projections narrower than hidden),
        tied weights, mixtures of experts (stacked 3-D expert weights, or a list of like modules beside a linear
        router choosing among them: experts, their width, how many blocks hold them; each token's count of experts
        is not in the parameters and counts as 1). Heads and sequence length are not in the parameters: pass
        them."""
        missing = [f"{name}= (CLI {flag})" for name, flag, value in (("seq_len", "--seq-len", seq_len),
                                                                      ("heads", "--heads", heads)) if value is None]
        if missing:
            raise ValueError(f"ModelShape.from_module({target!r}) cannot read {' and '.join(missing)} from the"
                             " module's parameters: pass them.")
        return cls.measure(instantiate_on_meta(target, kwargs or {}), seq_len=seq_len, heads=heads,
                           kv_heads=kv_heads)

    @classmethod
    def measure(cls, module: nn.Module, *, seq_len: int, heads: int, kv_heads: Optional[int] = None,
                flash_attention: bool = True, blocks: Optional[str] = None) -> "ModelShape":
        """The shape of a built module (on any device, meta included), as :meth:`from_module` describes;
        ``blocks`` names the block list when :func:`find_block_list` should not search for it."""
        _, block_list = find_block_list(module, blocks)
        in_blocks = {id(p) for p in block_list.parameters()}
        outside = [m for m in module.modules() if not any(id(p) in in_blocks for p in m.parameters(recurse=False))]
        embeddings = [m for m in outside if isinstance(m, nn.Embedding)]
        embedding_parameters = sum(m.weight.numel() for m in embeddings)
        outside_parameters = sum(p.numel() for p in module.parameters() if id(p) not in in_blocks)
        hidden = _hidden_size(block_list[0], embeddings)
        ffn_hidden, gated = _mlp_shape(block_list[0], hidden)
        widths = [m.num_embeddings for m in embeddings] + [m.out_features for m in outside if isinstance(m, nn.Linear)]
        if not widths:
            raise ValueError(f"{type(module).__name__}: no nn.Embedding or nn.Linear outside the blocks to read the"
                             " vocabulary from.")
        experts, expert_parameters, moe_layers = _experts(block_list)
        return cls(
            layers=len(block_list), hidden=hidden, heads=heads, vocab=max(widths), seq_len=seq_len,
            experts=experts, moe_layers=moe_layers, expert_ffn_hidden=(
                max(1, round(expert_parameters / ((3 if gated else 2) * hidden))) if experts else None),
            kv_heads=kv_heads or _kv_heads(block_list[0], hidden, heads), ffn_hidden=ffn_hidden, gated_mlp=gated,
            flash_attention=flash_attention,
            tied_embeddings=len(list(module.named_parameters(remove_duplicate=False))) > len(list(module.parameters())),
            parameters_per_block=max(sum(p.numel() for p in block.parameters()) for block in block_list),
            whole_parameters_per_block=sum(p.numel() for p in block_list[0].parameters() if p.dim() < 2),
            first_stage_parameters=embedding_parameters,
            last_stage_parameters=outside_parameters - embedding_parameters)


def _experts(blocks: nn.Module) -> tuple[int, float, int]:
    """(experts per MoE block, parameters per expert, MoE blocks), by structure: a module stacking experts in its
    3-D weights, or a list of like modules with a linear layer of as many outputs (the router) beside it."""
    from lightning_hybrid.expert_parallel.stacked import expert_count  # the planner's --help imports no more

    found = []
    for block in blocks:
        for module in block.modules():
            count = expert_count(module)
            if count:
                found.append((count, sum(p.numel() for p in module.parameters(recurse=False)) / count))
                break
            lists = [child for child in module.children() if isinstance(child, nn.ModuleList) and len(child) > 1
                     and len({type(m) for m in child}) == 1]
            routers = {m.out_features for m in module.children() if isinstance(m, nn.Linear)}
            routed = [child for child in lists if len(child) in routers]
            if routed:
                found.append((len(routed[0]), sum(p.numel() for p in routed[0][0].parameters())))
                break
    if not found:
        return 0, 0.0, 0
    return max(count for count, _ in found), max(size for _, size in found), len(found)


def _linears(block: nn.Module) -> list[nn.Linear]:
    return [m for m in block.modules() if isinstance(m, nn.Linear)]


def _hidden_size(block: nn.Module, embeddings: list[nn.Embedding]) -> int:
    linears = _linears(block)
    if linears:
        return linears[0].in_features
    if embeddings:
        return embeddings[0].embedding_dim
    raise ValueError("Cannot read the hidden size: the blocks hold no nn.Linear and the model no nn.Embedding.")


def _mlp_shape(block: nn.Module, hidden: int) -> tuple[int, bool]:
    """(ffn_hidden, gated) from the down projection (wider → hidden) and the projections feeding it (one of ffn
    width: plain; two, or one fused of 2·ffn: gated); (4·hidden, False) if there is none (e.g. Conv1D layers)."""
    linears = _linears(block)
    down = [m.in_features for m in linears if m.out_features == hidden and m.in_features > hidden]
    if not down:
        return 4 * hidden, False
    ffn = down[0]
    up_width = sum(m.out_features for m in linears if m.in_features == hidden and m.out_features in (ffn, 2 * ffn))
    return ffn, up_width == 2 * ffn


def _kv_heads(block: nn.Module, hidden: int, heads: int) -> int:
    head_dim = hidden // heads
    narrow = [m.out_features // head_dim for m in _linears(block)
              if m.in_features == hidden and m.out_features < hidden and m.out_features % head_dim == 0]
    return min(narrow) if narrow and heads % min(narrow) == 0 else heads
