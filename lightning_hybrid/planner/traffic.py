"""Bytes the memory-bound kernels of a step move through GPU memory: what the planner charges at the GPU's memory
bandwidth (``Cluster.memory_bandwidth``) next to the matmuls' FLOPs.

Why it matters: a block's matmuls grow as h² per token, its element-wise kernels (norms, residual adds, dropout,
the MLP's activation, a materialized attention's softmax) as h and a·s. A small model spends a large share of its
time in them and a large one little: on Narayanan et al. 2021's Table 1 the blocks' count below takes 44 % of the
matmul time at 1.7B (h = 2304, materialized scores) and 5 % at 1T (h = 25600, t = 8), which is most of why their
throughput per GPU grows with the model while one efficiency per GPU cannot (BENCHMARKS.md, "Planner").

Per token and block on one tp rank, forward, E bytes per element (1-byte dropout masks), reads + writes:

* two norms: h in, h out each (torch's one-kernel layer_norm / rms_norm), whole over tp: 4h·E; Llama's reference
  RMSNorm in eager PyTorch (``ModelShape.fp32_norm``) instead runs its upcast (E in, 4 out), square (4, 4), mean (4
  in), scale (4, 4), downcast (4, E) and weight (E, E) as kernels of their own: 28 + 4E bytes an element, 18E at
  bf16, each norm;
* rotary embeddings (``ModelShape.rotary``) on the q and k heads of the rank: fused, E in and out; eager (Llama's
  complex form, or the rotate-half one) upcast, rotate and downcast: 16 + 2E bytes an element;
* two residual adds: 2 in, 1 out: 6h·E; with dropout before each, eager 2·(2h·E + h) more, fused into the add
  (Megatron's bias-dropout-add) the add's traffic and the mask only;
* the MLP's activation on ffn/t: GeLU 2 passes; SwiGLU eager 5 (silu in and out, the product's 2 in and 1 out),
  fused 3;
* materialized attention (no flash): a·s/t scores per token written by the QKᵀ matmul and read by the one with V
  (2 passes), scale, mask and softmax eager 6 passes, fused (Megatron's scale-mask-softmax) 2; dropout on the
  probabilities 2 passes and a mask. Flash attention keeps the scores on chip: its FLOPs count as matmuls.

Backward moves 1.5 × the forward's bytes (an element-wise backward reads the output gradient and the saved input and
writes the input gradient where the forward read one tensor and wrote one); a recomputed block (full or selective
checkpointing) repeats its forward's. Fused (``ModelShape.fused_elementwise``, or ``compile=True``, whose inductor
fuses the same chains) is that count; eager PyTorch runs one kernel per operation. Matmuls' own operand traffic is
not counted (large matmuls are compute-bound).

Also charged: the loss over the rank's V/t logits per token (fp32 log-softmax: the logits read and upcast, the
log-softmax written, read and its gradient written in fp32, the logits' gradient written: 2·E + 24 bytes per
logit); under a pipeline the unsharded gradient accumulation every microbatch (FSDP2 adds each microbatch's gradient,
compute dtype, to an accumulator in the reduce dtype: E + 2·reduce bytes per local parameter); the AdamW step over
the rank's shards (reads parameters, gradients and both moments, writes parameters and moments).
"""

from __future__ import annotations

from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.step import Precision

#: Backward's element-wise bytes per forward byte (see the module docstring).
BACKWARD_PER_FORWARD = 1.5


def block_elementwise_bytes(model: ModelShape, tp: int, element_bytes: int, fused: bool) -> float:
    """Bytes the element-wise kernels of one block's forward move per token on one tp rank."""
    h, e = model.hidden, element_bytes
    norms = 2 * h * (28 + 4 * e if model.fp32_norm and not fused else 2 * e)
    if model.rotary:  # q and k: the rank's query heads and key heads
        width = (model.heads + model.kv_heads) * (h // model.heads) / tp
        norms += width * (2 * e if fused else 16 + 2 * e)
    residual = 2 * 3 * h * e
    if model.dropout:  # a mask byte per element either way; eager also reads and writes the dropped tensor
        residual += 2 * (h + (0 if fused else 2 * h * e))
    ffn = model.ffn_hidden / tp
    activation = ((3 if fused else 5) if model.gated_mlp else 2) * ffn * e
    scores = 0.0
    if not model.flash_attention:
        passes = 2 + (2 if fused else 6) + (2 if model.dropout else 0)
        scores = model.heads * model.seq_len / tp * (passes * e + (1 if model.dropout else 0))
    return norms + residual + activation + scores


def float8_cast_bytes(gemms: list[tuple[float, float, float, float, float]], fused: bool) -> tuple[float, float]:
    """(forward, backward) bytes one block's casts to float8 move for its GEMMs ``gemms`` (m, n, k, count, share;
    :func:`~.kernels.block_gemms`), as torchao's Float8Linear runs them with tensorwise scales: forward, the input
    (m × k) and the weight (k × n) each read for its absolute maximum and read again to write it in fp8 (2 + 2 + 1
    bytes an element); backward, the output gradient (m × n) the same way, and the fp8 copies the other two GEMMs
    need transposed (x, the output gradient and the weight: 1 byte read, 1 written). ``fused`` (torch.compile):
    the maximum is reduced inside the kernel that produced the tensor, which writes it anyway; the cast's read and
    write remain (the scale needs the whole tensor's maximum first), 2 + 1 bytes."""
    cast = 3 if fused else 5
    forward = backward = 0.0
    for m, n, k, count, share in gemms:
        forward += share * count * cast * (m * k + k * n)
        backward += share * count * (cast * m * n + 2 * (m * k + m * n + k * n))
    return forward, backward


def loss_bytes_per_token(vocab_local: float, element_bytes: int) -> float:
    """Bytes the loss moves per token over ``vocab_local`` logits (fp32 log-softmax, forward and backward)."""
    return vocab_local * (2 * element_bytes + 6 * 4)


def accumulation_bytes(local_parameters: float, sizes: Precision) -> float:
    """Bytes one microbatch's gradient accumulation moves into an unsharded accumulator (pipeline stages)."""
    return local_parameters * (sizes.compute + 2 * sizes.reduce)


def optimizer_bytes(sharded_parameters: float, sizes: Precision) -> float:
    """Bytes one AdamW step moves over ``sharded_parameters``: reads parameters, gradients and both moments, writes
    parameters and moments."""
    return sharded_parameters * (2 * sizes.parameter + sizes.gradient + 2 * sizes.optimizer)
