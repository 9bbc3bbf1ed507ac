"""Choose a layout before launching: per-GPU memory and step time of HybridStrategy layouts, from a cost model.

Example::

    from lightning_hybrid.planning import Cluster, Layout, ModelShape, estimate, plan

    llama7b = ModelShape(layers=32, hidden=4096, heads=32, ffn_hidden=11008, gated_mlp=True, vocab=32000, seq_len=4096)
    cluster = Cluster.preset("h100-sxm", nodes=4)                      # 4 × 8 GPUs
    best = plan(llama7b, cluster, global_batch=256)[0]                 # the fastest layout that fits
    print(best.layout, best.time.step, best.memory.total / 2**30)
    estimate(llama7b, cluster, Layout(dp=8, tp=4), global_batch=256)   # one layout's breakdown

or ``lightning-hybrid plan --params 7e9 --seq-len 4096 --gpu h100-sxm --nodes 4 --global-batch 256``, or inside a
run ``HybridStrategy(tp="auto", pp="auto")`` (:mod:`lightning_hybrid.auto_layout`).

Symbols: b sequences per microbatch, s sequence, h hidden, a heads, V vocabulary, L layers; t, d, R, p, v, m =
tp, dp (shard), dp_replicate, pp, virtual stages, microbatches. The first and last pipeline ranks are computed
(middle ones hold no more than the first); the worst counts.

Gradient accumulation: with p = 1, ``Layout.microbatches`` = m is ``Trainer(accumulate_grad_batches=m)`` with a
DataLoader batch of b = global batch / (d·R·m): the m microbatches run one after another, forward and backward
each, so a rank holds one microbatch's activations; compute and TP bytes are those of the whole batch. FSDP2 is
not told to wait (Lightning's ``block_backward_sync`` only pauses DDP, HybridStrategy keeps it), so every
microbatch all-gathers and reduce-scatters as a whole step would. (With p > 1, m are the pipeline's microbatches.)

Memory per GPU
    Model states: parameters + gradients + AdamW moments per the README's dtype table (32-true 4+4+8 B,
    bf16-mixed 4+4+8 with fp32 master weights, bf16-true 2+2+4) × the rank's tp-local parameters ÷ d. Only blocks
    are tensor-parallel (matrices ÷ t, 1-D norms/biases whole); embeddings (first stage), final norm and head
    (last stage) are whole on every tp rank. Gradients count at the activation peak (conservative: Lightning
    frees them between steps). Gathered parameters, compute dtype, plus the root unit, as FSDP2's peak was measured
    (BENCHMARKS.md, Planner): ZeRO-3 three blocks (a prefetched block's all-gather output and its copied-out
    parameters exist together), ZeRO-2 the stage and two blocks' all-gather buffers; none without FSDP2, which
    HybridStrategy leaves out on one data-parallel rank (d·R = 1) except for bf16-mixed (its casting policy).
    With pp > 1 torch's pipeline keeps
    parameters gathered after a backward and accumulates *unsharded* gradients (reduce dtype) until the last
    microbatch: both ZeRO levels hold the whole stage gathered, and its full gradients instead of the sharded
    ones. With p = 1 FSDP2 reduce-scatters each accumulation step and adds the result to the sharded gradients:
    no unsharded copy.
    Activations per block and microbatch: Korthikanti et al. 2022, Table 2, per tensor (so GQA, ``ffn_hidden``,
    gated MLPs fit): with kv_heads = a, ffn = 4h, dropout and materialized scores at 16 bits exactly their
    s·b·h·(10 + 24/t + 5·a·s/(h·t)), 34 + 5·a·s/h at t = 1 (no sequence parallelism). Defaults: no dropout masks
    (dropout 0, as in LLM pretraining) and flash SDPA (no a·s² scores; a 4-byte logsumexp per head and token);
    fp32 doubles tensors, not 1-byte masks. Full recomputation: s·b·h per block + one block's working set.
    Chunk-microbatches held on rank r: one with p = 1 (accumulation steps run in turn), GPipe m, 1F1B
    min(m, p − r), interleaved min(m·v, (v−1)·p + 2·(p−1−r) + 1) (torch's warm-up; rank 0: Korthikanti's
    L·(1 + (p−1)/(p·v)) layers).
    Receive buffers: one b·s·h per microbatch and chunk (both directions when v > 1), kept by torch's pipeline.
    Last stage: logits b·s·V and the loss's log-softmax per microbatch held (GPipe m, else 1). ⌈L/(p·v)⌉
    blocks per stage (HybridStrategy balances FLOPs, which may move one off the head's stage). A layout fits if
    its total is at most ``usable_memory_fraction`` of the GPU.

Time per step
    Compute: forward FLOPs per token 2·(L·P_block + V·h) + 4·L·s·h (embedding lookups are free), ×3 with
    backward, ×4 with recomputation; a rank runs its blocks ÷ t plus, last stage, the whole head; ÷ (peak ×
    efficiency). TP: 4 all-reduces of b·s·h per block and microbatch (6 with recomputation), ring 2·(t−1)/t ×
    bytes. PP: an activation and a gradient of b·s·h per microbatch and chunk. FSDP: all-gathers of the stage's
    tp-local parameters, compute dtype (ZeRO-3: forward and backward of every microbatch, 2·m, an upper bound;
    ZeRO-2: one per step with p > 1, where the pipeline keeps the stage gathered, but one per accumulation step,
    m, with p = 1, where FSDP2 reshards after each backward) and reduce-scatters, reduce dtype, (d−1)/d × bytes
    each (one per step with p > 1, m with p = 1); HSDP adds as many all-reduces of the shards over R. Links:
    mesh pp × dp_replicate × dp_shard × tp (tp innermost); a dimension uses NVLink iff each of its groups lies
    in one node. Every message also costs the cluster's ``latency`` α: TP one all-reduce per block, pass and
    microbatch, PP two messages per chunk-microbatch, FSDP one collective per unit (each block and the root) and
    pass. Overlap: TP and PP messages are exposed; FSDP/HSDP traffic hides behind compute and only the excess
    shows, but with pp > 1 the reduce-scatter/all-reduce follow the last backward (exposed); with
    ``overlap_communication=False`` (CPUs) all of it shows. Step = busiest rank's (compute + TP + PP) ×
    (m·v + p − 1)/(m·v), i.e. bubble (p−1)/(m·v+p−1), + exposed data-parallel time. MFU = 3 × forward FLOPs / (step × GPUs × peak).
    Checked with :class:`~lightning_hybrid.counting.StepCounter` (recipes/gpt.py, 2 blocks of width 64, dp=2,
    m = 1 and 2): per optimizer step ZeRO-3 all-gathers 2·m × the parameters' bytes and both levels
    reduce-scatter m × them, exactly; ZeRO-2 gathers the root (embeddings, head) twice per microbatch, 1.09·m ×
    the parameters here, not m.
    Not modeled: accumulation on top of a pipeline (``accumulate_grad_batches`` with p > 1), smaller
    microbatches' lower efficiency (so at equal predicted time :func:`plan` ranks fewer accumulation steps
    first), "selective" or every-N checkpointing, zero-bubble schedules, CPU offload.
"""

from __future__ import annotations

import importlib
import itertools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import torch
from torch import nn

from lightning_hybrid.blocks import find_block_list
from lightning_hybrid.pipeline import PipelineSchedule
from lightning_hybrid.precision import SUPPORTED_PRECISION
from lightning_hybrid.sharding import check_zero_level

GIB = 2**30
PLANNED_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
CHECKPOINTING = (None, "every")
OUT_OF_MEMORY = "out of memory"


def _check_positive(owner: str, integer: bool, **values: Any) -> None:
    kinds = (int,) if integer else (int, float)
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
            kind = "a positive integer" if integer else "a positive number"
            raise ValueError(f"{owner}({name}={value!r}) is invalid: {name} must be {kind}.")


# ----------------------------------------------------------------------------------------------------- model
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
    parameters_per_block: Optional[int] = None
    whole_parameters_per_block: Optional[int] = None  # left whole by tensor parallelism
    first_stage_parameters: Optional[int] = None  # embeddings
    last_stage_parameters: Optional[int] = None  # final norm and head

    def __post_init__(self) -> None:
        _check_positive("ModelShape", True, layers=self.layers, hidden=self.hidden, heads=self.heads,
                        vocab=self.vocab, seq_len=self.seq_len)
        self._default("kv_heads", self.heads)
        self._default("ffn_hidden", 4 * self.hidden)
        _check_positive("ModelShape", True, kv_heads=self.kv_heads, ffn_hidden=self.ffn_hidden)
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"ModelShape: hidden ({self.hidden}) must be divisible by heads ({self.heads}) and heads"
                             f" by kv_heads ({self.kv_heads}).")
        h, kv_width = self.hidden, self.kv_heads * (self.hidden // self.heads)
        self._default("whole_parameters_per_block", 2 * h)
        matrices = 2 * h * h + 2 * h * kv_width + (3 if self.gated_mlp else 2) * h * self.ffn_hidden
        self._default("parameters_per_block", matrices + self.whole_parameters_per_block)
        self._default("first_stage_parameters", self.vocab * h)
        self._default("last_stage_parameters", h + (0 if self.tied_embeddings else self.vocab * h))

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
        _check_positive("ModelShape.from_parameter_count", False, parameters=parameters)
        _check_positive("ModelShape.from_parameter_count", True, seq_len=seq_len, vocab=vocab)
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
        tied weights. Heads and sequence length are not in the parameters: pass them."""
        missing = [f"{name}= (CLI {flag})" for name, flag, value in (("seq_len", "--seq-len", seq_len),
                                                                      ("heads", "--heads", heads)) if value is None]
        if missing:
            raise ValueError(f"ModelShape.from_module({target!r}) cannot read {' and '.join(missing)} from the"
                             " module's parameters: pass them.")
        return cls.measure(_instantiate_on_meta(target, kwargs or {}), seq_len=seq_len, heads=heads,
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
        return cls(
            layers=len(block_list), hidden=hidden, heads=heads, vocab=max(widths), seq_len=seq_len,
            kv_heads=kv_heads or _kv_heads(block_list[0], hidden, heads), ffn_hidden=ffn_hidden, gated_mlp=gated,
            flash_attention=flash_attention,
            tied_embeddings=len(list(module.named_parameters(remove_duplicate=False))) > len(list(module.parameters())),
            parameters_per_block=max(sum(p.numel() for p in block.parameters()) for block in block_list),
            whole_parameters_per_block=sum(p.numel() for p in block_list[0].parameters() if p.dim() < 2),
            first_stage_parameters=embedding_parameters,
            last_stage_parameters=outside_parameters - embedding_parameters)


def _instantiate_on_meta(target: str, kwargs: Mapping[str, Any]) -> nn.Module:
    module_name, _, class_name = target.partition(":")
    if not module_name or not class_name:
        raise ValueError(f"Expected 'package.module:ClassName', got {target!r}.")
    try:
        module_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import {target!r}: {error}") from error
    try:
        with torch.device("meta"):  # no memory and no initialization: any size can be measured
            module = module_class(**kwargs)
            if callable(getattr(module, "configure_model", None)):
                module.configure_model()
    except Exception as error:  # the user's constructor: report it as bad input, with its message
        raise ValueError(f"Building {target}(**{dict(kwargs)!r}) on the meta device failed: {error!r}") from error
    return module


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


# --------------------------------------------------------------------------------------------------- cluster
class GpuSpec(NamedTuple):
    """One GPU's public numbers: memory, dense peak TFLOP/s (16-bit tensor cores; fp32 without TF32, which torch
    leaves off for fp32 matmuls by default), NVLink/PCIe GB/s per direction, and the inter-node GB/s per GPU of
    a typical system (assumed: one NIC per GPU, as in NVIDIA's DGX)."""

    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float


GPU_PRESETS: dict[str, GpuSpec] = {
    # A100 SXM datasheet: 312 TFLOPS BF16 dense, 19.5 FP32, NVLink 3 600 GB/s (300 per direction);
    # DGX A100: one 200 Gb/s HDR InfiniBand port per GPU = 25 GB/s.
    "a100-40gb": GpuSpec(40, 312, 19.5, 300, 25),
    "a100-80gb": GpuSpec(80, 312, 19.5, 300, 25),
    # H100 SXM datasheet: 989 TFLOPS BF16 dense (1979 with sparsity), 67 FP32, NVLink 4 900 GB/s;
    # DGX H100: one 400 Gb/s NDR port per GPU = 50 GB/s.
    "h100-sxm": GpuSpec(80, 989, 67, 450, 50),
    # H200 SXM: H100's compute and NVLink, 141 GB HBM3e (the driver reports about 140 GiB).
    "h200": GpuSpec(140, 989, 67, 450, 50),
    # L4 datasheet: 121 TFLOPS BF16 dense (242 with sparsity), 30.3 FP32, 24 GB, no NVLink: PCIe Gen4 x16
    # 32 GB/s per direction; network assumed 100 Gb/s per GPU.
    "l4": GpuSpec(24, 121, 30.3, 32, 12.5),
}


#: α of the GPU presets: NCCL's time for a tiny collective is tens of microseconds (assumed, one value for NVLink and
#: the network; small next to the bandwidth term except for many small messages: deep tensor parallelism or many
#: pipeline microbatches).
NCCL_LATENCY = 20e-6


@dataclass(frozen=True)
class Cluster:
    """GPUs, memory per GPU (bytes), peak FLOP/s per GPU in the training dtype, link bandwidths (bytes/s per GPU
    and direction). ``efficiency``: the share of peak that compute reaches (0.5: well-tuned dense transformer
    training reports 40-60% MFU). ``usable_memory_fraction``: room for the CUDA context, NCCL buffers and
    allocator fragmentation. ``latency``: seconds every collective call or point-to-point message costs whatever
    its size (α of the α–β model: a message of n bytes takes α + n / bandwidth). ``overlap_communication``:
    whether data-parallel traffic can hide behind compute (GPUs: NCCL on its own stream); ``False`` where the
    collectives need the compute's own cores (CPUs with gloo)."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    efficiency: float = 0.5
    usable_memory_fraction: float = 0.9
    latency: float = 0.0
    overlap_communication: bool = True

    def __post_init__(self) -> None:
        _check_positive("Cluster", True, nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        _check_positive("Cluster", False, memory_bytes=self.memory_bytes, peak_flops=self.peak_flops,
                        intra_node_bandwidth=self.intra_node_bandwidth, inter_node_bandwidth=self.inter_node_bandwidth,
                        efficiency=self.efficiency, usable_memory_fraction=self.usable_memory_fraction)
        for name in ("efficiency", "usable_memory_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"Cluster({name}={getattr(self, name)!r}) is invalid: a fraction, at most 1.")
        if not self.latency >= 0:
            raise ValueError(f"Cluster(latency={self.latency!r}) is invalid: seconds per message, at least 0.")

    @classmethod
    def preset(cls, gpu: str, nodes: int = 1, gpus_per_node: int = 8, precision: str = "bf16-mixed",
               **overrides: Any) -> "Cluster":
        """Nodes of :data:`GPU_PRESETS` GPUs; ``precision`` picks the peak (fp32 for ``32-true``); ``overrides``
        replace any field."""
        spec = GPU_PRESETS.get(gpu.lower())
        if spec is None:
            raise ValueError(f"Unknown GPU preset {gpu!r}. Choose one of: {', '.join(GPU_PRESETS)}.")
        tflops = spec.fp32_tflops if precision == "32-true" else spec.bf16_tflops
        fields = dict(nodes=nodes, gpus_per_node=gpus_per_node, memory_bytes=spec.memory_gib * GIB,
                      peak_flops=tflops * 1e12, intra_node_bandwidth=spec.intra_node_gbps * 1e9,
                      inter_node_bandwidth=spec.inter_node_gbps * 1e9, latency=NCCL_LATENCY)
        return cls(**{**fields, **overrides})

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def link_bandwidth(self, size: int, stride: int) -> float:
        """Bandwidth of the mesh groups of ``size`` ranks ``stride`` apart. They tile aligned blocks of
        size·stride consecutive ranks, so all of them lie within nodes iff such a block divides a node."""
        intra = self.nodes == 1 or size == 1 or self.gpus_per_node % (size * stride) == 0
        return self.intra_node_bandwidth if intra else self.inter_node_bandwidth


# ---------------------------------------------------------------------------------------------------- layout
@dataclass(frozen=True)
class Layout:
    """The HybridStrategy arguments the planner varies (``dp`` is the sharding degree, ``dp_shard``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    zero: int = 3
    activation_checkpointing: Optional[str] = None
    pp_schedule: str = "1f1b"
    # pp > 1: the pipeline's microbatches, default pp × virtual_stages; pp = 1: gradient-accumulation steps,
    # Trainer(accumulate_grad_batches=microbatches) (not a HybridStrategy argument), default 1
    microbatches: Optional[int] = None
    virtual_stages: Optional[int] = None  # default: 2 for interleaved_1f1b, else 1

    def __post_init__(self) -> None:
        _check_positive("Layout", True, dp=self.dp, tp=self.tp, pp=self.pp, dp_replicate=self.dp_replicate)
        optional = {name: getattr(self, name) for name in ("microbatches", "virtual_stages")}
        _check_positive("Layout", True, **{name: value for name, value in optional.items() if value is not None})
        check_zero_level(self.zero)
        if self.activation_checkpointing not in CHECKPOINTING:
            raise ValueError(f"Layout(activation_checkpointing={self.activation_checkpointing!r}): the planner models"
                             " None and 'every'.")

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.dp_replicate

    @property
    def accumulation_steps(self) -> int:
        """``Trainer(accumulate_grad_batches=...)`` of this layout: ``microbatches`` when pp = 1, else 1."""
        return (self.microbatches or 1) if self.pp == 1 else 1

    def __str__(self) -> str:
        text = f"dp{self.dp} tp{self.tp} pp{self.pp}" + (f" rep{self.dp_replicate}" if self.dp_replicate > 1 else "")
        text += f" acc{self.accumulation_steps}" if self.accumulation_steps > 1 else ""
        if self.pp > 1:
            text += f" {self.pp_schedule}" + (f" m{self.microbatches}" if self.microbatches else "")
            text += f" v{self.virtual_stages}" if (self.virtual_stages or 1) > 1 else ""
        return text + f" z{self.zero}" + (" ac" if self.activation_checkpointing else "")


# ------------------------------------------------------------------------------------------------- estimates
@dataclass(frozen=True)
class _Precision:
    """Bytes per element of each kind of tensor (the README's dtype table)."""

    parameter: int  # sharded parameter (master weight)
    gradient: int  # sharded gradient
    optimizer: int  # AdamW's two moments
    compute: int  # gathered parameters, activations, messages
    reduce: int  # gradient reduction, and unsharded accumulation with pp > 1


_PRECISIONS = {"32-true": _Precision(4, 4, 8, 4, 4), "bf16-mixed": _Precision(4, 4, 8, 2, 4),
               "bf16-true": _Precision(2, 2, 4, 2, 2)}


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of the pipeline stage ``stage`` (``"only"`` without pipelining, ``"first"``, ``"last"``)."""

    stage: str
    parameters: float
    gradients: float
    optimizer_state: float
    gathered_parameters: float
    activations: float  # pipeline receive buffers included
    logits: float

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + self.gathered_parameters + self.activations + self.logits


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per step: compute, TP and PP messages and data-parallel traffic (all of it, and what is exposed)
    of the busiest rank, the pipeline bubble, and the step."""

    compute: float
    tensor_parallel: float
    pipeline: float
    data_parallel: float
    data_parallel_exposed: float
    bubble: float
    step: float


@dataclass(frozen=True)
class Estimate:
    """A layout's memory (fullest GPU), time, throughput, and why it cannot run (empty if it can)."""

    layout: Layout
    memory: MemoryBreakdown
    time: TimeBreakdown
    tokens_per_second: float
    mfu: float
    reasons: tuple[str, ...] = ()

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def out_of_memory(self) -> bool:
        return any(reason.startswith(OUT_OF_MEMORY) for reason in self.reasons)

    def to_dict(self) -> dict[str, Any]:
        memory = {**asdict(self.memory), "model_states": self.memory.model_states, "total": self.memory.total}
        return {"layout": str(self.layout), "degrees": asdict(self.layout), "feasible": self.feasible,
                "reasons": list(self.reasons), "memory_bytes": memory, "time_s": asdict(self.time),
                "tokens_per_second": self.tokens_per_second, "mfu": self.mfu}


def layer_activation_bytes(model: ModelShape, micro_batch: float, tp: int, element_bytes: int) -> float:
    """Bytes one block saves for backward per microbatch (Korthikanti et al. 2022, Table 2, per tensor)."""
    s, h, a = model.seq_len, model.hidden, model.heads
    # q, k, v, attention output, MLP intermediates (fc, activation; gated: gate, up, activation, product)
    sharded = h + 2 * model.kv_heads * (h // a) + h + (4 if model.gated_mlp else 2) * model.ffn_hidden
    per_token = (4 * h + sharded / tp) * element_bytes  # + both norm inputs, attention and MLP inputs (whole)
    per_token += 4 * a / tp if model.flash_attention else a * s / tp * element_bytes  # logsumexp / softmax
    if model.dropout:  # 1-byte masks after attention and MLP (+ on the probabilities, and their dropped copy)
        per_token += 2 * h + (0 if model.flash_attention else a * s / tp * (1 + element_bytes))
    return s * micro_batch * per_token


@dataclass(frozen=True)
class _Step:
    """What every rank of one layout shares (see :func:`_step`)."""

    model: ModelShape
    cluster: Cluster
    layout: Layout
    schedule: Optional[PipelineSchedule]
    bytes: _Precision
    global_batch: int
    microbatches: int
    virtual_stages: int
    micro_batch: float  # b: sequences per microbatch
    residual_bytes: float  # one b·s·h tensor: a block's input, a pipeline receive buffer
    block_local_parameters: float  # one block's parameters on one tp rank
    checkpointed: bool
    fsdp: bool  # HybridStrategy applies FSDP2 (see _memory)


def _step(model: ModelShape, cluster: Cluster, layout: Layout, schedule: Optional[PipelineSchedule],
          precision: str, global_batch: int) -> _Step:
    bytes_ = _PRECISIONS[precision]
    m, v = (schedule.microbatches, schedule.virtual_stages) if schedule else (layout.accumulation_steps, 1)
    micro_batch = global_batch / (layout.dp * layout.dp_replicate * m)
    whole = model.whole_parameters_per_block
    return _Step(model, cluster, layout, schedule, bytes_, global_batch, m, v, micro_batch,
                 residual_bytes=micro_batch * model.seq_len * model.hidden * bytes_.compute,
                 block_local_parameters=(model.parameters_per_block - whole) / layout.tp + whole,
                 checkpointed=layout.activation_checkpointing == "every",
                 fsdp=layout.dp * layout.dp_replicate > 1 or precision == "bf16-mixed")


@dataclass(frozen=True)
class _Rank:
    """A pipeline rank: its blocks, whether it holds the embeddings / the head, and how many chunk-microbatches'
    activations it holds at its peak."""

    stage: str
    blocks: int
    first: bool
    last: bool
    in_flight: int

    def local_parameters(self, step: _Step) -> float:
        return (self.blocks * step.block_local_parameters + self.first * step.model.first_stage_parameters
                + self.last * step.model.last_stage_parameters)


def _ranks(step: _Step) -> list[_Rank]:
    schedule = step.schedule
    if schedule is None:
        return [_Rank("only", step.model.layers, True, True, 1)]
    p, v, m = schedule.pp, schedule.virtual_stages, schedule.microbatches
    blocks = math.ceil(step.model.layers / (p * v)) * v

    def in_flight(rank: int) -> int:
        if schedule.name == "gpipe":
            return m
        if schedule.name == "1f1b":
            return min(m, p - rank)
        return min(m * v, (v - 1) * p + 2 * (p - 1 - rank) + 1)

    return [_Rank("first", blocks, True, False, in_flight(0)), _Rank("last", blocks, False, True, in_flight(p - 1))]


def _memory(step: _Step, rank: _Rank) -> MemoryBreakdown:
    local = rank.local_parameters(step)
    sharded = local / step.layout.dp
    if step.schedule is not None:
        gathered_blocks = rank.blocks
    else:  # FSDP2's peak, measured: 3 blocks at ZeRO-3; the stage and 2 more blocks' buffers at ZeRO-2
        gathered_blocks = min(3, rank.blocks) if step.layout.zero == 3 else rank.blocks + min(2, rank.blocks)
    gathered = local - (rank.blocks - gathered_blocks) * step.block_local_parameters if step.fsdp else 0.0
    per_layer = layer_activation_bytes(step.model, step.micro_batch, step.layout.tp, step.bytes.compute)
    chunk_blocks = rank.blocks // step.virtual_stages
    activations = rank.in_flight * chunk_blocks * (step.residual_bytes if step.checkpointed else per_layer)
    activations += per_layer if step.checkpointed else 0.0  # the block being recomputed
    if step.schedule is not None:
        directions = 2 if step.virtual_stages > 1 else 1
        activations += step.microbatches * step.virtual_stages * directions * step.residual_bytes
    held_losses = step.microbatches if step.schedule and step.schedule.name == "gpipe" else 1
    logits = (held_losses + 1) * step.micro_batch * step.model.seq_len * step.model.vocab * step.bytes.compute
    gradients = local * step.bytes.reduce if step.schedule is not None else sharded * step.bytes.gradient
    return MemoryBreakdown(
        stage=rank.stage, parameters=sharded * step.bytes.parameter, gradients=gradients,
        optimizer_state=sharded * step.bytes.optimizer, gathered_parameters=gathered * step.bytes.compute,
        activations=activations, logits=logits if rank.last else 0.0)


def _ring(bytes_moved: float, size: int, bandwidth: float, all_reduce: bool = False) -> float:
    """Seconds of a ring all-gather or reduce-scatter ((n−1)/n × bytes) or all-reduce (twice that)."""
    return (2 if all_reduce else 1) * (size - 1) / size * bytes_moved / bandwidth if size > 1 else 0.0


def _times(step: _Step, rank: _Rank) -> tuple[float, float, float, float, float]:
    """(compute, TP, PP, data-parallel, exposed data-parallel) seconds of one rank per step."""
    model, cluster, layout, m = step.model, step.cluster, step.layout, step.microbatches
    t, d, r, p = layout.tp, layout.dp, layout.dp_replicate, layout.pp
    tokens = step.global_batch * model.seq_len / (d * r)
    # TP and PP move b·s·h per microbatch; summed from the replica's batch directly, so layouts that differ only in
    # m tie exactly (no rounding of m × b) and the tie-break in plan() decides.
    replica_activation_bytes = tokens * model.hidden * step.bytes.compute
    block_flops = 2 * model.parameters_per_block + 4 * model.seq_len * model.hidden  # forward, per token
    forward = tokens * (rank.blocks * block_flops / t + rank.last * 2 * model.vocab * model.hidden)
    compute = (4 if step.checkpointed else 3) * forward / (cluster.peak_flops * cluster.efficiency)
    all_reduces = 6 if step.checkpointed else 4  # 2 in forward (+2 recomputed), 2 in backward
    alpha, chunk_microbatches = cluster.latency, m * step.virtual_stages
    tensor = rank.blocks * all_reduces * _ring(replica_activation_bytes, t, cluster.link_bandwidth(t, 1), True)
    tensor += rank.blocks * all_reduces * m * alpha if t > 1 else 0.0  # one all-reduce per microbatch each
    pipe = 2 * step.virtual_stages * replica_activation_bytes / cluster.link_bandwidth(p, r * d * t) if p > 1 else 0.0
    pipe += 2 * chunk_microbatches * alpha if p > 1 else 0.0  # an activation out, a gradient back
    local, dp_link = rank.local_parameters(step), cluster.link_bandwidth(d, t)
    syncs = m if p == 1 else 1  # FSDP2 syncs every accumulation step; the pipeline once, after its last backward
    gather_passes = 2 * m if layout.zero == 3 else syncs
    units = rank.blocks + 1  # FSDP2 communicates per unit: each block, and the root's own parameters
    gathers = gather_passes * (_ring(local * step.bytes.compute, d, dp_link) + (units * alpha if d > 1 else 0.0))
    reductions = syncs * (_ring(local * step.bytes.reduce, d, dp_link) + (units * alpha if d > 1 else 0.0))
    reductions += syncs * (_ring(local / d * step.bytes.reduce, r, cluster.link_bandwidth(r, d * t), True)
                           + (units * alpha if r > 1 else 0.0))
    if not cluster.overlap_communication:
        exposed = gathers + reductions
    elif p > 1:
        exposed = max(0.0, gathers - compute) + reductions
    else:
        exposed = max(0.0, gathers + reductions - compute)
    return compute, tensor, pipe, gathers + reductions, exposed


def _schedule(layout: Layout) -> Optional[PipelineSchedule]:
    if layout.pp == 1:
        if (layout.virtual_stages or 1) != 1:
            raise ValueError("virtual_stages is a pipeline option: set pp > 1")
        return None
    if layout.pp_schedule not in PLANNED_SCHEDULES:
        raise ValueError(f"the planner models pp_schedule {', '.join(PLANNED_SCHEDULES)}, not {layout.pp_schedule!r}")
    return PipelineSchedule.resolve(layout.pp_schedule, layout.pp, layout.virtual_stages, layout.microbatches)


def _structural_reasons(step: _Step) -> list[str]:
    model, layout = step.model, step.layout
    sizes = {"heads": model.heads, "kv_heads": model.kv_heads, "hidden": model.hidden, "ffn_hidden": model.ffn_hidden}
    if model.kv_heads == model.heads:
        del sizes["kv_heads"]  # one reason is enough
    reasons = [f"tp={layout.tp} does not divide {name}={value}" for name, value in sizes.items() if value % layout.tp]
    stages = layout.pp * step.virtual_stages
    if stages > model.layers:
        reasons.append(f"{stages} pipeline stages for {model.layers} layers")
    if layout.pp > 1 and model.tied_embeddings:
        reasons.append("tied (shared) weights cannot be split across pipeline stages")
    splits = layout.dp * layout.dp_replicate * step.microbatches
    if step.global_batch % splits:
        reasons.append(f"global batch {step.global_batch} is not divisible by dp × dp_replicate × microbatches ="
                       f" {splits}")
    return reasons


def check_model_fits_cluster(model: ModelShape, cluster: Cluster, precision: str) -> None:
    """Refuse a model whose model states alone exceed the usable memory of all the cluster's GPUs together."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(f"precision={precision!r} is invalid: choose one of {', '.join(SUPPORTED_PRECISION)}.")
    bytes_ = _PRECISIONS[precision]
    per_parameter = bytes_.parameter + bytes_.gradient + bytes_.optimizer
    needed = per_parameter * model.total_parameters
    if needed > cluster.gpus * cluster.usable_memory:
        raise ValueError(
            f"The model states alone need {needed:,} bytes ({per_parameter} B/param × {model.total_parameters:,}"
            f" parameters, {precision} with AdamW): at least {math.ceil(needed / cluster.usable_memory)} GPUs of"
            f" {cluster.memory_bytes / GIB:g} GiB ({cluster.usable_memory_fraction:.0%} usable), and the cluster"
            f" has {cluster.gpus}.")


def estimate(model: ModelShape, cluster: Cluster, layout: Layout, global_batch: int,
             precision: str = "bf16-mixed") -> Estimate:
    """Memory, time and feasibility of one layout. Bad input raises ``ValueError`` (degrees that do not multiply
    to the cluster's GPUs, a model larger than the cluster); what only rules out this layout is in ``reasons``."""
    _check_positive("estimate", True, global_batch=global_batch)
    check_model_fits_cluster(model, cluster, precision)
    if layout.gpus != cluster.gpus:
        raise ValueError(f"Layout {layout} uses {layout.gpus} GPUs; the cluster has {cluster.gpus}.")
    reasons = []
    try:
        schedule = _schedule(layout)
    except ValueError as error:
        reasons.append(str(error))
        # Still sized, as GPipe (the most activation memory) with the requested microbatches.
        schedule = PipelineSchedule("gpipe", layout.pp, 1, layout.microbatches or layout.pp) if layout.pp > 1 else None
    step = _step(model, cluster, layout, schedule, precision, global_batch)
    reasons += _structural_reasons(step)
    ranks = _ranks(step)
    memory = max((_memory(step, rank) for rank in ranks), key=lambda breakdown: breakdown.total)
    times = [_times(step, rank) for rank in ranks]
    compute, tensor, pipe, data, _ = max(times, key=lambda rank_times: sum(rank_times[:3]))
    busy, slots = compute + tensor + pipe, step.microbatches * step.virtual_stages
    pipelined = busy * (slots + layout.pp - 1) / slots  # the bubble is (p − 1) / (m·v + p − 1) of this
    seconds = pipelined + max(rank_times[4] for rank_times in times)
    if memory.total > cluster.usable_memory:
        where = "" if memory.stage == "only" else f" on the {memory.stage} pipeline stage"
        reasons.append(f"{OUT_OF_MEMORY}: {memory.total / GIB:.1f} GiB per GPU{where},"
                       f" {(memory.total - cluster.usable_memory) / GIB:.1f} GiB over the usable"
                       f" {cluster.usable_memory / GIB:.1f} GiB")
    model_flops = 3 * global_batch * model.seq_len * (
        2 * (model.layers * model.parameters_per_block + model.vocab * model.hidden)
        + 4 * model.layers * model.seq_len * model.hidden)
    if schedule is not None:
        layout = replace(layout, microbatches=schedule.microbatches, virtual_stages=schedule.virtual_stages)
    time = TimeBreakdown(compute, tensor, pipe, data, seconds - pipelined, pipelined - busy, seconds)
    return Estimate(layout, memory, time, tokens_per_second=global_batch * model.seq_len / seconds,
                    mfu=model_flops / (seconds * cluster.gpus * cluster.peak_flops), reasons=tuple(reasons))


def divisors(n: int) -> list[int]:
    """The positive divisors of ``n``, ascending: the degrees a dimension of ``n`` devices can take."""
    return [k for k in range(1, n + 1) if n % k == 0]


def candidate_layouts(cluster: Cluster, global_batch: int, schedules: Sequence[str] = PLANNED_SCHEDULES,
                      zero_levels: Sequence[int] = (2, 3),
                      checkpointing: Sequence[Optional[str]] = CHECKPOINTING) -> list[Layout]:
    """Every dp_replicate × dp × tp × pp = GPUs with each ZeRO level and checkpointing choice; with pp > 1, each
    schedule with each microbatch count ≥ pp that divides a replica's batch (the default count if none does); with
    pp = 1, each gradient-accumulation count that divides it (1 written as ``microbatches=None``)."""
    layouts = []
    for tp, pp, replicate in itertools.product(divisors(cluster.gpus), repeat=3):
        if cluster.gpus % (tp * pp * replicate):
            continue
        dp = cluster.gpus // (tp * pp * replicate)
        per_replica = global_batch // (dp * replicate) if global_batch % (dp * replicate) == 0 else 0
        base = Layout(dp=dp, tp=tp, pp=pp, dp_replicate=replicate)
        if pp > 1:
            counts = [k for k in divisors(per_replica) if k >= pp] or [None]
            variants = [replace(base, pp_schedule=name, microbatches=count,
                                virtual_stages=2 if name == "interleaved_1f1b" else 1)
                        for name in schedules for count in counts]
        else:
            variants = [replace(base, microbatches=k if k > 1 else None) for k in divisors(per_replica) or [1]]
        layouts += [replace(layout, zero=zero, activation_checkpointing=mode)
                    for layout in variants for zero in zero_levels for mode in checkpointing]
    return layouts


def plan(model: ModelShape, cluster: Cluster, global_batch: int, precision: str = "bf16-mixed",
         schedules: Sequence[str] = PLANNED_SCHEDULES, zero_levels: Sequence[int] = (2, 3),
         checkpointing: Sequence[Optional[str]] = CHECKPOINTING) -> list[Estimate]:
    """Estimate every :func:`candidate_layouts` layout: the feasible ones first, fastest first (ties: fewer
    accumulation steps, less memory, less traffic), then the infeasible ones, those only out of memory first,
    nearest to fitting first."""
    _check_positive("plan", True, global_batch=global_batch)
    check_model_fits_cluster(model, cluster, precision)
    candidates = candidate_layouts(cluster, global_batch, schedules, zero_levels, checkpointing)
    estimates = [estimate(model, cluster, layout, global_batch, precision) for layout in candidates]
    # At equal predicted time, fewer accumulation steps: smaller microbatches run less efficiently (not modeled).
    feasible = sorted((e for e in estimates if e.feasible),
                      key=lambda e: (e.time.step, e.layout.accumulation_steps, e.memory.total, e.time.data_parallel))
    infeasible = sorted((e for e in estimates if not e.feasible),
                        key=lambda e: (len(e.reasons) - e.out_of_memory, e.memory.total, e.time.step))
    return feasible + infeasible
