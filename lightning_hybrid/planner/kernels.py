"""Seconds of a step's matrix multiplications and attention kernels from their shapes, where the cluster names its
GPU's kernel profile (``Cluster.streaming_multiprocessors``: the presets do; a hand-made cluster without it keeps
one efficiency for every matmul).

Why shapes: one matmul efficiency for every GEMM overrates small widths, and attention on H100s runs far below the
GEMMs' share of peak (FlashAttention-2, which SDPA's flash backend runs, does not use Hopper's asynchronous tensor
cores). The model, per GEMM of m × n × k (bf16, on one tp rank):

* **tile and wave quantization**: the GEMM runs as ⌈m/128⌉·⌈n/128⌉ output tiles, in waves of one tile per
  streaming multiprocessor; a wave's time is that of a whole tile, so a partial last tile or wave costs in full;
* **each tile's fixed cost**: a tile spends the time of :data:`K_OVERHEAD` more elements of k outside its main loop
  (pipeline fill, epilogue writing C), so a short k runs at k/(k + K_OVERHEAD) of the long-k rate;
* **roofline**: at least its bytes (A, B read, C written once) ÷ the memory bandwidth (low arithmetic intensity);
* the rest is one fitted number per GPU generation, ``Cluster.efficiency``: the share of peak a large, aligned GEMM
  sustains in its main loop, i.e. as k grows (:data:`~lightning_hybrid.hardware.GPU_PRESETS`, BENCHMARKS.md "Planner
  on modern kernels").

Backward runs each forward GEMM (m, n, k) twice more: the input gradient (m, k, n) and the weight gradient
(n, k, m). The parameter-counted FLOPs (:mod:`~.step_time`) stay the measure of work; the shapes give the factor by
which a block's or the head's GEMMs run slower than a large aligned one (:func:`shape_factor`).

Attention core: flash SDPA (``ModelShape.flash_attention``) computes the causal half of the scores, forward
2·b·s²·h/t FLOPs and backward 2.5 times that (it recomputes the scores), at ``Cluster.attention_efficiency`` of peak
(published kernel benchmarks per GPU generation, not fitted). Materialized scores run as batched GEMMs per head
(QKᵀ: s × s × d, scores × V: s × d × s; backward four more), all of the square computed, through the GEMM model;
their softmax and masks are memory-bound traffic (:mod:`~.traffic`).
"""

from __future__ import annotations

import math

from lightning_hybrid.hardware import Cluster
from lightning_hybrid.planner.model import ModelShape

#: Output tile of a GEMM (rows × columns): cuBLAS's common bf16 tile on A100 and H100.
TILE = 128
#: Elements of k whose main-loop time a tile spends outside that loop (prologue, epilogue, and what else makes short
#: k slow): one value for every GPU, fitted with the matmul efficiencies (the smallest error over their fitted runs;
#: benchmarks/planner_kernels.py).
K_OVERHEAD = 384
#: Bytes per element of a GEMM's operands (bf16).
OPERAND_BYTES = 2
#: Backward FLOPs of flash attention per forward FLOP (the scores recomputed: 5 matmuls against 2).
FLASH_BACKWARD = 2.5
#: Float8 tensor cores' dense peak per bf16 peak (A100 has none; H100 SXM: 1979 against 989 TFLOP/s).
FLOAT8_SPEEDUP = 2

Gemm = tuple[float, float, float, float, float]  # m, n, k, how many, share of blocks that run them


def gemm_seconds(cluster: Cluster, m: float, n: float, k: float, count: float = 1, float8: bool = False) -> float:
    """Seconds of ``count`` GEMMs of m × n × k on one GPU of ``cluster`` (see the module docstring); ``float8``: fp8
    operands (1 byte) at :data:`FLOAT8_SPEEDUP` × the rate, the same tiles and fixed cost, a bf16 output."""
    sms = cluster.streaming_multiprocessors or 1
    tiles = math.ceil(m / TILE) * math.ceil(n / TILE) * math.ceil(count)
    per_sm = cluster.peak_flops * cluster.efficiency * (FLOAT8_SPEEDUP if float8 else 1) / sms
    compute = math.ceil(tiles / sms) * 2 * TILE * TILE * (k + K_OVERHEAD) / per_sm
    operands = (m * k + k * n) * (1 if float8 else OPERAND_BYTES) + m * n * OPERAND_BYTES
    memory = count * operands / (cluster.memory_bandwidth or math.inf)
    return max(compute, memory)


def shape_factor(cluster: Cluster, gemms: list[Gemm], float8: bool = False) -> float:
    """How much slower the forward GEMMs ``gemms`` and their two backward GEMMs each run than their FLOPs at
    ``efficiency`` × the bf16 peak: 1 for large aligned shapes, more for small or ragged ones (about half as much
    in ``float8``, which torchao runs for all three)."""
    seconds = ideal = 0.0
    for m, n, k, count, share in gemms:
        for shape in ((m, n, k), (m, k, n), (n, k, m)):  # forward, input gradient, weight gradient
            seconds += share * gemm_seconds(cluster, *shape, count, float8)
            ideal += share * 2 * m * n * k * count / (cluster.peak_flops * cluster.efficiency)
    return seconds / ideal if ideal else 1.0


def block_gemms(model: ModelShape, tokens: float, tp: int, ep: int) -> list[Gemm]:
    """A block's forward GEMMs on one tp rank for ``tokens`` rows: q, k, v; the output projection; the MLP's up
    (and gate) and down projections, or, in a mixture of experts, the router, the shared experts and each local
    expert on its balanced share of the rows (whole over tp under expert parallelism)."""
    h, head = model.hidden, model.hidden // model.heads
    gemms: list[Gemm] = [(tokens, (h + 2 * model.kv_heads * head) / tp, h, 1, 1), (tokens, h, h / tp, 1, 1)]
    up = 2 if model.gated_mlp else 1
    dense = 1 - model.moe_layers / model.layers  # the share of blocks with a dense MLP
    if dense:
        ffn = model.ffn_hidden / tp
        gemms += [(tokens, up * ffn, h, 1, dense), (tokens, h, ffn, 1, dense)]
    if model.moe_layers:
        moe, width = 1 - dense, model.expert_ffn_hidden
        experts, split = (model.experts / ep, 1) if ep > 1 else (model.experts, tp)
        rows = tokens * model.experts_per_token * (ep if ep > 1 else 1) / model.experts
        gemms += [(tokens, model.experts, h, 1, moe), (rows, up * width / split, h, experts, moe),
                  (rows, h, width / split, experts, moe)]
        if model.shared_experts:
            shared = model.shared_experts * width / tp
            gemms += [(tokens, up * shared, h, 1, moe), (tokens, h, shared, 1, moe)]
    return gemms


def attention_seconds(cluster: Cluster, model: ModelShape, sequences: float, tp: int, cp: int) -> tuple[float, float]:
    """(forward, backward) seconds of one block's attention core for ``sequences`` sequences on one rank: its
    heads ÷ tp ÷ cp over the whole sequence."""
    s, head = model.seq_len, model.hidden // model.heads
    heads = sequences * model.heads / (tp * cp)
    if model.flash_attention:
        forward = 2 * heads * s * s * head  # the causal half of QKᵀ and scores × V
        seconds = forward / (cluster.peak_flops * (cluster.attention_efficiency or cluster.efficiency))
        return seconds, FLASH_BACKWARD * seconds
    forward = gemm_seconds(cluster, s, s, head, heads) + gemm_seconds(cluster, s, head, s, heads)
    backward = gemm_seconds(cluster, s, s, head, heads) + 3 * gemm_seconds(cluster, s, head, s, heads)
    return forward, backward
