"""What the planner varies and what it predicts: a :class:`Layout` (the HybridStrategy arguments of one candidate)
and its :class:`Estimate` (memory on the fullest GPU, time per step, throughput, and why it cannot run).

Example::

    layout = Layout(dp=8, tp=4, pp=2, pp_schedule="interleaved_1f1b", microbatches=16, virtual_stages=2)
    str(layout)                                                    # "dp8 tp4 pp2 interleaved_1f1b m16 v2 z3"
    parse_layout("tp8 pp8 interleaved_1f1b m96 ac", gpus=1536)    # dp = 1536 / (8·8) = 24
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional, Union

from lightning_hybrid.checks import check_positive_values
from lightning_hybrid.options.hybrid_options import check_zero_level, default_zero_level
from lightning_hybrid.planner.syntax import layout_words

#: The activation checkpointing modes :func:`~lightning_hybrid.planner.search.plan` tries by default (an integer N,
#: every N-th block, is predicted too when asked for).
CHECKPOINTING = (None, "every", "selective")
#: ``HybridStrategy(reduce_dtype=...)`` values the cost model knows (``None``: the precision's default).
REDUCE_DTYPES = (None, "fp32", "bf16")
#: How a reason for an infeasible layout that is only about memory begins.
OUT_OF_MEMORY = "out of memory"


@dataclass(frozen=True)
class Layout:
    """The HybridStrategy arguments the planner varies (``dp`` is the sharding degree, ``dp_shard``)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    ep: int = 1  # expert parallelism: each MoE block's experts spread over ep of the dp (shard) ranks
    cp: int = 1  # context parallelism: each sequence split over cp ranks (world = dp·cp·tp·pp·rep)
    zero: int = 3
    activation_checkpointing: Union[None, str, int] = None  # None, "every", "selective" or N (every N-th block)
    pp_schedule: str = "1f1b"
    # pp > 1: the pipeline's microbatches, default pp × virtual_stages; pp = 1: gradient-accumulation steps,
    # Trainer(accumulate_grad_batches=microbatches) (not a HybridStrategy argument), default 1
    microbatches: Optional[int] = None
    virtual_stages: Optional[int] = None  # default: 2 for interleaved_1f1b, else 1
    shard_vocab: bool = True  # tp > 1: token embedding and head sharded over the vocabulary (if tp divides it)
    # pp > 1: Trainer(accumulate_grad_batches=accumulate) on top of the pipeline (each of the ``accumulate`` batches
    # runs the pipeline's ``microbatches``); with pp = 1 it is folded into ``microbatches``
    accumulate: int = 1
    compile: bool = False  # HybridStrategy(compile=True)
    offload: bool = False  # HybridStrategy(offload=True): FSDP2's CPU offload
    reduce_dtype: Optional[str] = None  # HybridStrategy(reduce_dtype=...): "bf16" halves gradient traffic
    loss_parallel: bool = False  # HybridStrategy(loss_parallel=True): logits stay sharded over the vocabulary

    def __post_init__(self) -> None:
        check_positive_values("Layout", dp=self.dp, tp=self.tp, pp=self.pp, dp_replicate=self.dp_replicate,
                              accumulate=self.accumulate, ep=self.ep, cp=self.cp)
        optional = {name: getattr(self, name) for name in ("microbatches", "virtual_stages")}
        check_positive_values("Layout", **{name: value for name, value in optional.items() if value is not None})
        check_zero_level(self.zero)
        object.__setattr__(self, "activation_checkpointing", _checked_checkpointing(self.activation_checkpointing))
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(f"Layout(reduce_dtype={self.reduce_dtype!r}): choose one of {REDUCE_DTYPES}.")
        if self.pp == 1 and self.accumulate > 1:  # without a pipeline the accumulation steps are the microbatches
            if self.microbatches not in (None, self.accumulate):
                raise ValueError(f"Layout(pp=1, microbatches={self.microbatches}, accumulate={self.accumulate}):"
                                 " with pp = 1 both are the accumulation steps; give one.")
            object.__setattr__(self, "microbatches", self.accumulate)  # frozen: normalized once, here
            object.__setattr__(self, "accumulate", 1)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.dp_replicate * self.cp

    @property
    def accumulation_steps(self) -> int:
        """``Trainer(accumulate_grad_batches=...)`` of this layout: ``microbatches`` when pp = 1, else
        ``accumulate``."""
        return (self.microbatches or 1) if self.pp == 1 else self.accumulate

    def __str__(self) -> str:
        """The layout in the words :func:`parse_layout` reads back."""
        text = f"dp{self.dp} tp{self.tp} pp{self.pp}" + (f" rep{self.dp_replicate}" if self.dp_replicate > 1 else "")
        text += f" ep{self.ep}" if self.ep > 1 else ""
        text += f" cp{self.cp}" if self.cp > 1 else ""
        text += f" acc{self.accumulation_steps}" if self.accumulation_steps > 1 else ""
        if self.pp > 1:
            text += f" {self.pp_schedule}" + (f" m{self.microbatches}" if self.microbatches else "")
            text += f" v{self.virtual_stages}" if (self.virtual_stages or 1) > 1 else ""
        mode = self.activation_checkpointing
        text += f" z{self.zero}" + ("" if mode is None else " ac" if mode == "every" else f" ac={mode}")
        flags = {"whole-vocab": self.tp > 1 and not self.shard_vocab, "compile": self.compile,
                 "offload": self.offload, "loss-parallel": self.loss_parallel}
        text += "".join(f" {flag}" for flag, given in flags.items() if given)
        return text + (f" reduce={self.reduce_dtype}" if self.reduce_dtype else "")


def _checked_checkpointing(mode: object) -> Union[None, str, int]:
    """``HybridStrategy(activation_checkpointing=...)``'s values, normalized: ``"none"`` is None, 1 is "every"."""
    if mode is None or mode == "none":
        return None
    if mode in ("every", "selective"):
        return mode  # type: ignore[return-value]
    if isinstance(mode, int) and not isinstance(mode, bool) and mode >= 1:
        return "every" if mode == 1 else mode
    raise ValueError(f"Layout(activation_checkpointing={mode!r}): choose None, 'every', 'selective' or an integer"
                     " N ≥ 1 (every N-th block), as HybridStrategy takes.")


def parse_layout(text: str, gpus: Optional[int] = None) -> Layout:
    """The :class:`Layout` that ``text`` describes (:data:`~lightning_hybrid.planner.syntax.LAYOUT_SYNTAX`; what
    ``str(layout)`` prints reads back equal). Without ``dpN``, dp is ``gpus`` ÷ (tp·pp·rep·cp); without ``zN``,
    HybridStrategy's default level (2 with a pipeline, else 3). Unknown words raise ``ValueError``."""
    values = layout_words(text)
    values.setdefault("zero", default_zero_level(values.get("pp", 1) > 1))
    if "dp" not in values:
        others = values.get("tp", 1) * values.get("pp", 1) * values.get("dp_replicate", 1) * values.get("cp", 1)
        if gpus is None or gpus % others:
            raise ValueError(f"layout {text!r} has no dpN, and {gpus} GPUs do not split into tp × pp × rep × cp ="
                             f" {others}")
        values["dp"] = gpus // others
    return Layout(**values)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes on one GPU of the pipeline stage ``stage`` (``"only"`` without pipelining, ``"first"``, ``"middle"``,
    ``"last"``)."""

    stage: str
    parameters: float
    gradients: float
    optimizer_state: float
    gathered_parameters: float
    activations: float  # pipeline receive buffers included
    logits: float
    receive_buffers: float = 0.0  # beyond the inputs in flight (≤ 3·b·s·h), part of ``activations``
    offloaded: float = 0.0  # offload=True: model states held in CPU memory instead (not in ``total``)

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_state

    @property
    def total(self) -> float:
        return self.model_states + self.gathered_parameters + self.activations + self.logits


@dataclass(frozen=True)
class TimeBreakdown:
    """Seconds per step: compute (matmuls and memory-bound kernels), TP and PP messages and data-parallel traffic
    (all of it, and what is exposed) of the busiest rank, the pipeline bubble, the optimizer step, and the step."""

    compute: float
    tensor_parallel: float
    pipeline: float
    data_parallel: float
    data_parallel_exposed: float
    bubble: float
    step: float
    memory_bound: float = 0.0  # the part of ``compute`` that memory-bound kernels take
    optimizer: float = 0.0  # AdamW over the rank's shards (on CPU with offload=True)
    experts: float = 0.0  # expert parallelism's all-to-all exchanges (exposed, like TP messages)
    context: float = 0.0  # context parallelism's all-to-all exchanges and gathers (exposed, like TP messages)


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
