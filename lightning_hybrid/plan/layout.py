"""What the planner varies and what it predicts: a :class:`Layout` (the HybridStrategy arguments of one candidate)
and its :class:`Estimate` (memory on the fullest GPU, time per step, throughput, and why it cannot run).

Example::

    layout = Layout(dp=8, tp=4, pp=2, pp_schedule="interleaved_1f1b", microbatches=16, virtual_stages=2)
    str(layout)        # "dp8 tp4 pp2 interleaved_1f1b m16 v2 z3"
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.options import check_zero_level

#: The activation checkpointing modes the cost model predicts.
CHECKPOINTING = (None, "every")
#: How a reason for an infeasible layout that is only about memory begins.
OUT_OF_MEMORY = "out of memory"


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
    shard_vocab: bool = True  # tp > 1: token embedding and head sharded over the vocabulary (if tp divides it)

    def __post_init__(self) -> None:
        check_positive_values("Layout", dp=self.dp, tp=self.tp, pp=self.pp, dp_replicate=self.dp_replicate)
        optional = {name: getattr(self, name) for name in ("microbatches", "virtual_stages")}
        check_positive_values("Layout", **{name: value for name, value in optional.items() if value is not None})
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
        text += f" z{self.zero}" + (" ac" if self.activation_checkpointing else "")
        return text + (" whole-vocab" if self.tp > 1 and not self.shard_vocab else "")


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
