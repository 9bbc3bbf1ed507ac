"""What every term of the cost model shares about one layout: bytes per element of each kind of tensor, the shape of
a step (microbatches, sequences per microbatch, which blocks recompute) and the pipeline ranks whose memory and time
:func:`~lightning_hybrid.planner.cost.estimate` computes.

Example::

    step = describe_step(model, cluster, layout, schedule, "bf16-mixed", global_batch=512)
    [rank.stage for rank in pipeline_ranks(step)]      # ["first", "middle", "last"] for pp ≥ 3

Ranks computed: without a pipeline the one rank; with one, the first (embedding; the most microbatches in flight),
the last (head, logits) and, for pp ≥ 3, the second, standing for the middle ones: a middle stage receives both
activations and gradients, so it holds the most receive buffers (three b·s·h, independent of m). Blocks: ⌈L/(p·v)⌉
per stage (HybridStrategy balances FLOPs, which may move one off the head's stage).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.hardware import Cluster
from lightning_hybrid.planner.layout import Layout
from lightning_hybrid.planner.model import ModelShape


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor (the README's dtype table)."""

    parameter: int  # sharded parameter (master weight)
    gradient: int  # sharded gradient
    optimizer: int  # AdamW's two moments
    compute: int  # gathered parameters, activations, messages
    reduce: int  # gradient reduction, and unsharded accumulation with pp > 1


PRECISIONS = {"32-true": Precision(4, 4, 8, 4, 4), "bf16-mixed": Precision(4, 4, 8, 2, 4),
              "bf16-true": Precision(2, 2, 4, 2, 2), "16-true": Precision(2, 2, 4, 2, 2)}


def precision_bytes(precision: str, reduce_dtype: Optional[str]) -> Precision:
    """:data:`PRECISIONS` with ``HybridStrategy(reduce_dtype=...)``: gradients reduced (and, under a pipeline,
    accumulated unsharded: FSDP2 accumulates in its reduce dtype) in bf16 or fp32."""
    sizes = PRECISIONS[precision]
    return replace(sizes, reduce={"bf16": 2, "fp32": 4}[reduce_dtype]) if reduce_dtype else sizes


@dataclass(frozen=True)
class StepShape:
    """What every rank of one layout shares (see :func:`describe_step`)."""

    model: ModelShape
    cluster: Cluster
    layout: Layout
    schedule: Optional[PipelineSchedule]
    bytes: Precision
    global_batch: int
    microbatches: int  # pipeline microbatches per step, or (pp = 1) accumulation steps
    pipeline_steps: int  # pp > 1: accumulate_grad_batches, each a full pipeline step with its bubble; else 1
    virtual_stages: int
    micro_batch: float  # b: sequences per microbatch
    residual_bytes: float  # one b·s·h tensor: a block's input, a pipeline receive buffer
    block_local_parameters: float  # one block's parameters on one tp rank
    expert_local_parameters: float  # of which routed experts (÷ ep with expert parallelism, whole over tp; else ÷ t)
    vocab_shards: int  # t when the token embedding and head are sharded over the vocabulary, else 1
    fsdp: bool  # HybridStrategy applies FSDP2 (see plan/memory.py)
    fused: bool  # element-wise chains run fused (the model's own kernels, or compile=True)

    @property
    def tokens(self) -> float:
        """Tokens one data-parallel rank processes per optimizer step."""
        return self.global_batch * self.model.seq_len / (self.layout.dp * self.layout.dp_replicate)

    @property
    def shard_ranks(self) -> int:
        """The ranks FSDP2 shards a stage's parameters over: dp × cp (the cp ranks of a sequence shard them too)."""
        return self.layout.dp * self.layout.cp

    @property
    def expert_data_ranks(self) -> int:
        """The ranks FSDP2 shards each routed expert over: dp·cp ÷ ep (each holds other experts than the rest)."""
        return max(1, self.shard_ranks // self.layout.ep)  # (an ep dp cannot hold is refused: cost.py)

    def sharded(self, local: float, rank: "PipelineRank") -> float:
        """``local`` parameters of ``rank`` (one tp rank's) after FSDP2's sharding: the dense ones over dp·cp, the
        rank's routed experts over the ranks holding the same experts."""
        experts = rank.blocks * self.expert_local_parameters
        return (local - experts) / self.shard_ranks + experts / self.expert_data_ranks

    @property
    def all_microbatches(self) -> int:
        """Microbatches per optimizer step (each one a round of TP messages)."""
        return self.microbatches * self.pipeline_steps


def describe_step(model: ModelShape, cluster: Cluster, layout: Layout, schedule: Optional[PipelineSchedule],
                  precision: str, global_batch: int) -> StepShape:
    bytes_ = precision_bytes(precision, layout.reduce_dtype)
    m, v = (schedule.microbatches, schedule.virtual_stages) if schedule else (layout.accumulation_steps, 1)
    steps = layout.accumulate if schedule else 1
    micro_batch = global_batch / (layout.dp * layout.dp_replicate * m * steps)
    whole, routed = model.whole_parameters_per_block, model.routed_parameters_per_block
    experts = routed / layout.ep if layout.ep > 1 else routed / layout.tp  # expert_step.py: whole over tp under ep
    return StepShape(model, cluster, layout, schedule, bytes_, global_batch, m, steps, v, micro_batch,
                     residual_bytes=micro_batch * model.seq_len * model.hidden * bytes_.compute,
                     block_local_parameters=(model.parameters_per_block - whole - routed) / layout.tp + whole + experts,
                     expert_local_parameters=experts,
                     vocab_shards=layout.tp if layout.shard_vocab and model.vocab % layout.tp == 0 else 1,
                     # FSDP2 is left out on one data-parallel rank except for what only it provides (parallelize.py)
                     fsdp=layout.dp * layout.cp * layout.dp_replicate > 1 or precision == "bf16-mixed" or layout.offload,
                     fused=model.fused_elementwise or layout.compile)


@dataclass(frozen=True)
class PipelineRank:
    """A pipeline rank: its blocks, whether it holds the embedding / the head, how many chunk-microbatches'
    activations it holds at its peak, which of its blocks recompute, and its receive buffers."""

    stage: str  # "only", "first", "middle", "last"
    blocks: int
    first: bool
    last: bool
    in_flight: int
    recomputed_blocks: int  # checkpointed blocks whose whole forward runs again in backward
    selective_blocks: int  # blocks under selective checkpointing (element-wise operations recomputed)
    receive_buffers: int  # b·s·h tensors beyond the inputs in flight: 1 activation posted ahead, 2 gradients

    def local_parameters(self, step: StepShape) -> float:
        """Parameters this rank holds on one tp rank (before data-parallel sharding)."""
        model = step.model
        table = min(model.vocab * model.hidden, model.first_stage_parameters)  # the token embedding
        saved = table * (1 - 1 / step.vocab_shards)  # a vocabulary-sharded table keeps 1/t of its rows
        first = model.first_stage_parameters - saved
        last = model.last_stage_parameters - (0.0 if model.tied_embeddings else saved)
        if model.tied_embeddings and self.last and not self.first:
            last += table / step.vocab_shards  # the last stage keeps its own copy of a tied table (pipeline/shared.py)
        return self.blocks * step.block_local_parameters + self.first * first + self.last * last


def pipeline_ranks(step: StepShape) -> list[PipelineRank]:
    schedule, checkpointing = step.schedule, step.layout.activation_checkpointing
    if schedule is None:
        layers = step.model.layers
        return [PipelineRank("only", layers, True, True, 1, _recomputed(checkpointing, [(0, layers)]),
                             layers if checkpointing == "selective" else 0, 0)]
    p, v = schedule.pp, schedule.virtual_stages
    chunk = math.ceil(step.model.layers / (p * v))
    indices = [0, 1, p - 1] if p >= 3 else [0, p - 1]
    return [_pipeline_rank(schedule, index, chunk, checkpointing) for index in indices]


def _pipeline_rank(schedule: PipelineSchedule, index: int, chunk: int, checkpointing: object) -> PipelineRank:
    p, v, m = schedule.pp, schedule.virtual_stages, schedule.microbatches
    stages = [index + j * p for j in range(v)]  # torch's loop placement: rank r runs stages r, r + p, ...
    if schedule.name == "gpipe":
        in_flight = m
    elif schedule.name == "1f1b":
        in_flight = min(m, p - index)
    else:  # torch's interleaved warm-up (rank 0: Korthikanti's L·(1 + (p−1)/(p·v)) layers)
        in_flight = min(m * v, (v - 1) * p + 2 * (p - 1 - index) + 1)
    # The runtime allocates a buffer when its message is about to arrive and frees it after use. An activation buffer
    # becomes the stage's input, which the activations of each microbatch in flight already count: only the one
    # posted ahead of its forward adds. A gradient lives until its chunk's backward ends: one consumed, one posted.
    buffers = any(stage > 0 for stage in stages) + 2 * any(stage < p * v - 1 for stage in stages)
    stage = "first" if index == 0 else "last" if index == p - 1 else "middle"
    return PipelineRank(stage, chunk * v, index == 0, index == p - 1, in_flight,
                        _recomputed(checkpointing, [(s * chunk, chunk) for s in stages]),
                        chunk * v if checkpointing == "selective" else 0, buffers)


def _recomputed(checkpointing: object, spans: list[tuple[int, int]]) -> int:
    """How many blocks of the global index spans (start, count) recompute their forward: all with "every", the
    N-th, 2N-th, … of the whole model (0-based N−1, 2N−1, …) with an integer N, none otherwise."""
    if checkpointing == "every":
        return sum(count for _, count in spans)
    if isinstance(checkpointing, int):
        return sum((start + count) // checkpointing - start // checkpointing for start, count in spans)
    return 0
