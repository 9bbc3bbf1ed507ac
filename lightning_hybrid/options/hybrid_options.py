"""The strategy's arguments, validated once into one frozen :class:`HybridOptions`.

Everything that reads a parallelism choice reads it from here: the driver (:mod:`lightning_hybrid.parallel.parallelize`),
the pipeline (its :class:`~lightning_hybrid.options.schedules.PipelineSchedule`), the auto layout (which degrees are
``"auto"``, what the candidate layouts keep fixed) and the strategy. Bad values fail at construction, before any
process starts; only checks that need the world size or the model wait (``ParallelDims``, the stage split).

Example::

    options = HybridOptions(tp=2, pp=2, pp_schedule="interleaved_1f1b", activation_checkpointing="every")
    options.pipeline_schedule          # PipelineSchedule(name='interleaved_1f1b', pp=2, virtual_stages=2, ...)
    options.zero, options.checkpointing   # 2 (the default under pp), CheckpointPlan(every=1, selective=False)
    chosen = HybridOptions(tp="auto", pp="auto").with_degrees(dp=2, tp=1, pp=2, dp_replicate=1)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from torch.distributed.tensor.parallel import ParallelStyle

from lightning_hybrid.checks import check_positive
from lightning_hybrid.hardware import Cluster
from lightning_hybrid.options.feature_checks import (Compile, check_async_checkpoint, check_context_parallel,
                                                     check_flags, check_loss_parallel, checked_reduce_dtype,
                                                     checked_watchdog_timeout, compile_arguments)
from lightning_hybrid.options.recompute import ActivationCheckpointing, CheckpointPlan
from lightning_hybrid.options.schedules import PLANNED_SCHEDULES, PipelineSchedule

AUTO = "auto"
#: ``pp_split`` value that balances the stages by the step's measured times (:mod:`lightning_hybrid.pipeline.timed_split`).
MEASURED_SPLIT = "measured"
Degree = Union[int, Literal["auto"]]
#: Lightning precision flags the strategy serves (see :mod:`lightning_hybrid.glue.precision`).
SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "16-true")
#: ZeRO levels FSDP2 offers (see :mod:`lightning_hybrid.parallel.fsdp`).
ZERO_LEVELS = (2, 3)
#: ``HybridStrategy(pp_schedule=...)`` when none is given (and the layout is not chosen).
DEFAULT_SCHEDULE = "1f1b"
#: The watchdog's default bound in seconds (see :mod:`lightning_hybrid.resilience.watchdog`).
DEFAULT_WATCHDOG_TIMEOUT_S = 180.0


@dataclass(frozen=True)
class HybridOptions:
    """The parallelism arguments of ``HybridStrategy(...)``, checked. Derived on construction: ``zero`` (its default
    depends on the schedule), :attr:`pipeline_schedule` (``None`` for pp = 1 and until an ``"auto"`` pp is chosen)
    and :attr:`checkpointing`.

    Arguments:
        dp: Data-parallel sharding degree; ``"auto"`` takes what the world size leaves.
        tp: Tensor-parallel degree. The linear layers of the model's repeated blocks are paired into
            column-/row-parallel layers by how data flows between them; see :mod:`lightning_hybrid.tensor_parallel.block_plan`.
            ``"auto"``: chosen at setup (see below).
        pp: Pipeline-parallel degree. The block list is cut into ``pp × virtual_stages`` stages balanced by
            traced FLOPs; modules outside the blocks go with the stage that runs them. The model's own step runs
            on every stage (see :mod:`lightning_hybrid.pipeline.dispatch`). ``"auto"``: chosen at setup.
            With ``tp="auto"`` and/or ``pp="auto"`` the strategy measures the module (parameter counts, and heads
            and sequence length from the first block's attention on the first batch) and the hardware, estimates
            every layout the other arguments leave open with the planner's cost model, and
            takes the one with the most tokens per second that fits in memory; it logs the choice with its
            predicted memory, and why each option it chose beats its alternatives, and keeps the estimate in
            ``HybridStrategy.layout_estimate``. Options left unset are chosen in the same search:
            ``pp_schedule`` (of 1F1B, GPipe, interleaved 1F1B), ``microbatches`` and ``virtual_stages``,
            ``zero`` (2 or 3) and ``activation_checkpointing`` (none, ``"every"``, ``"selective"``; pass
            ``"none"`` to rule checkpointing out). See :mod:`lightning_hybrid.planner.auto_layout`.
        dp_replicate: Replicas of the sharded model (HSDP): parameters are sharded within a replica and gradients
            all-reduced across replicas.
        ep: Expert-parallel degree: each mixture-of-experts layer's experts spread over ``ep`` of a stage's ``dp``
            sharding ranks (``ep`` divides ``dp``; the world size is unchanged), tokens sent all-to-all to the rank
            holding their chosen expert; the router runs unchanged, dense layers stay data-parallel. Experts found
            by structure (stacked 3-D parameters, or a list a router chooses among): :mod:`lightning_hybrid.expert_parallel`.
        cp: Context-parallel degree: each sample's sequence split over ``cp`` ranks (``world = dp × cp × tp × pp ×
            dp_replicate``) that read the same samples; every block runs on its part of the sequence, attention
            on the whole sequence for ``heads / cp`` heads (an all-to-all each way), the rest of the step whole.
            A block that mixes positions elsewhere stays whole, found at setup: :mod:`lightning_hybrid.context_parallel`.
        zero: 3 shards parameters between forward and backward too; 2 keeps them gathered for the step (see
            :mod:`lightning_hybrid.parallel.fsdp`). Default: 3 without a pipeline, 2 with one (ZeRO-3 would
            gather each block 2 × microbatches times per step instead of once); zero-bubble schedules need 2.
        tp_plan: ``{module name pattern: "colwise" | "rowwise" | "replicate" | ParallelStyle}``, names from the
            LightningModule (``fnmatch`` patterns, e.g. ``"model.blocks.*.attn.qkv"``). Overrides or completes
            the automatic plan; entries outside the blocks are applied as given.
        shard_vocab: With tp > 1 (default ``True``), shard the token embedding over the vocabulary (row-wise,
            outputs all-reduced) and the language-model head column-wise (logits all-gathered: the loss still
            receives full logits); a tied pair keeps one sharded weight. Found from a traced step; an ambiguous
            structure or a vocabulary tp does not divide stays whole, logged. ``False``: both stay whole on every
            tp rank (sharded over dp only). See :mod:`lightning_hybrid.tensor_parallel.vocab`.
        blocks: Name of the container of repeated blocks (found automatically when ``None``).
        pp_schedule: ``"1f1b"`` (default; chosen with an ``"auto"`` layout), ``"gpipe"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"`` (torch's schedules).
        microbatches: Microbatches per step (each rank's batch is split into this many); default
            ``pp × virtual_stages`` (chosen with an ``"auto"`` layout). The batch size must be divisible by it.
        virtual_stages: Stages per pipeline rank: 1 for ``gpipe``/``1f1b``, default 2 for the others.
        pp_split: Blocks per stage (``pp × virtual_stages`` numbers), overriding the balanced split; ``"measured"``
            balances the stages by each block's forward + backward time, measured at setup on the first microbatch
            (not with ``pp="auto"`` or a meta-device model; logged, and kept in
            ``HybridStrategy.pipeline.measured_split``; see :mod:`lightning_hybrid.pipeline.timed_split`).
        activation_checkpointing: ``None`` (default: none; chosen with an ``"auto"`` layout), ``"none"``,
            ``"every"`` block, an integer N (every N-th block) or
            ``"selective"`` (every block, keeping matmul and attention outputs); see
            :mod:`lightning_hybrid.parallel.activation_checkpointing`.
        offload: Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
            ``CPUOffloadPolicy``); parameters are copied to the device for each block's forward and backward and
            the optimizer steps on CPU.
        verify_tp_plan: Run one block unsharded and sharded at setup and refuse a plan whose outputs differ.
        verify_pipeline: With pp > 1, run the first batch's training step pipelined and unsplit at setup (loss and
            every gradient, dropout off) and refuse a pipeline whose numbers differ, or a step that microbatching
            changes (BatchNorm, a loss coupling a batch's samples); then, once the weights are in place, run it
            pipelined with NaN in what stands in for other stages and refuse a stage that computes with it (the
            check a model on the meta device gets). Costs one step with the whole model on each rank and two
            pipelined steps at setup.
        tp_strict: Where tensor parallelism cannot shard part of a block correctly (a matrix parameter in no linear
            layer the planner recognizes, a layer width tp does not divide, a sharding the plan check finds
            changes the block's output; where only the heads do not divide, or no rank can compute a share of
            them, the weights are still sharded with the activations gathered), ``False`` (default) keeps those
            modules whole on every tp rank — as
            ``tp_plan={...: "replicate"}`` does — or, where the check fails for the plan as a whole, the whole block
            structure, and trains; the share of each block structure's parameters tp shards, what stays whole and
            why, and the memory that costs per tp rank are logged at setup, written as TensorBoard text
            ``run/tp_plan`` and kept in ``HybridStrategy.tp_plan_applied.structures``. ``True`` refuses at setup
            instead, naming the module and the ``tp_plan`` entry that keeps it whole. A failing style the user's
            own ``tp_plan`` gives is refused either way. See :mod:`lightning_hybrid.tensor_parallel.fallback`.
        save_distributed_checkpoint: One DCP shard per rank (``True``) or one consolidated file on rank 0.
        cluster: The hardware an ``"auto"`` layout is planned for (a :class:`~lightning_hybrid.Cluster`
            whose nodes × GPUs per node match the Trainer's); by default GPUs are recognised by name and CPUs probed.
        weights: A Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``) loaded into the
            LightningModule's ``PreTrainedModel`` right after sharding, each rank reading only the slices it holds
            (:mod:`lightning_hybrid.checkpoint.hf_load`); the model may be built on the meta device.
        reduce_dtype: The dtype FSDP2 reduces gradients in over the data-parallel ranks (reduce-scatter, and the
            all-reduce across ``dp_replicate`` replicas): ``"bf16"`` halves that traffic, each rank's gradient
            rounded to bf16 before the sum; ``None``/``"fp32"`` (default) reduce in fp32 (under ``bf16-mixed``
            too) or in the parameters' dtype.
        compile: ``True`` compiles every block with ``torch.compile`` (in place, after activation checkpointing and
            before FSDP2), a dict compiles them with these ``torch.compile`` keyword arguments (``{"mode":
            "max-autotune-no-cudagraphs"}``); blocks the LightningModule compiled itself are left as they are. Each
            block class compiles at its first call, the first training step. See
            :mod:`lightning_hybrid.parallel.compile`.
        watchdog_timeout: Seconds a rank may go without a heartbeat, or the job without a finished batch, before
            every rank is ended with one message naming the rank(s) that stopped (default 180; ×5 for a first
            batch or a checkpoint save); ``None`` or 0 turns the watchdog off. See
            :mod:`lightning_hybrid.resilience.watchdog`.
        loss_parallel: With tp > 1 and the head sharded over the vocabulary (``shard_vocab``), keep the head's
            logits a DTensor sharded over the vocabulary instead of all-gathering them, and run each step and its
            backward inside torch's ``loss_parallel()``, which computes ``F.cross_entropy`` from the shards. Values
            the step returns or logs are handed to Lightning as plain tensors; any other operation on the logits
            receives the sharded DTensor. Not with pp > 1. See :mod:`lightning_hybrid.tensor_parallel.loss_parallel`.
        async_checkpoint: ``True``: ``trainer.save_checkpoint`` (and so ``ModelCheckpoint``) returns once this
            rank's shards are copied to host memory; they are written in the background over a gloo group of their
            own and the folder gets its final name once every rank's write is complete. At most one save is in
            flight (the next waits); ``fit`` returns with every checkpoint published. See
            :mod:`lightning_hybrid.checkpoint.async_save`.
        check_replicas_every_n_steps: Every N optimizer steps, compare what must be identical on several ranks (HSDP
            replicas, parameters tensor parallelism keeps whole, tied copies across pipeline stages) by an exact
            fingerprint of each copy, and stop with :class:`~lightning_hybrid.resilience.replicas.ReplicaDivergence`
            naming the tensors and ranks that disagree; ``None`` (default): no check. See
            :mod:`lightning_hybrid.resilience.replicas`.
    """

    dp: Degree = AUTO
    tp: Degree = 1
    pp: Degree = 1
    dp_replicate: int = 1
    ep: int = 1
    cp: int = 1
    zero: Optional[int] = None
    tp_plan: Optional[Mapping[str, Union[str, ParallelStyle]]] = None  # a dict once constructed
    shard_vocab: bool = True
    blocks: Optional[str] = None
    pp_schedule: Optional[str] = None
    microbatches: Optional[int] = None
    virtual_stages: Optional[int] = None
    pp_split: Union[None, Literal["measured"], Sequence[int]] = None
    activation_checkpointing: ActivationCheckpointing = None
    offload: bool = False
    verify_tp_plan: bool = True
    verify_pipeline: bool = True
    tp_strict: bool = False
    save_distributed_checkpoint: bool = True
    cluster: Optional[Cluster] = None
    weights: Optional[Union[str, os.PathLike]] = None
    reduce_dtype: Optional[str] = None
    compile: Compile = False
    watchdog_timeout: Optional[float] = DEFAULT_WATCHDOG_TIMEOUT_S
    loss_parallel: bool = False
    async_checkpoint: bool = False
    check_replicas_every_n_steps: Optional[int] = None
    #: The resolved schedule (``None`` when pp = 1, or pp = "auto" before the layout is chosen).
    pipeline_schedule: Optional[PipelineSchedule] = field(init=False, default=None)
    #: ``zero`` as given (``None``: the default for the layout, see :func:`default_zero_level`).
    zero_given: Optional[int] = field(init=False, default=None, repr=False)
    #: ``pp_schedule`` as given (``None``: ``"1f1b"``, or the planner's choice under ``pp="auto"``/``tp="auto"``).
    pp_schedule_given: Optional[str] = field(init=False, default=None, repr=False)
    #: Which blocks are activation-checkpointed (``None``: none).
    checkpointing: Optional[CheckpointPlan] = field(init=False, default=None)
    #: The ``torch.compile`` keyword arguments for every block (``None``: no compilation).
    compile_arguments: Optional[dict[str, Any]] = field(init=False, default=None)

    def __post_init__(self) -> None:
        check_degrees(self.dp, self.tp, self.pp, self.dp_replicate, auto=("dp", "tp", "pp"))
        check_positive("HybridStrategy", "ep", self.ep)
        check_context_parallel(self.cp, self.compile, self.chooses_layout)
        self._set("tp_plan", dict(self.tp_plan or {}))
        self._set("pp_schedule_given", self.pp_schedule)
        self._set("pp_schedule", DEFAULT_SCHEDULE if self.pp_schedule is None else self.pp_schedule)
        self._set("pipeline_schedule", self._checked_pipeline())
        self._set("zero_given", self.zero)
        self._set("zero", check_zero_level(_zero_level(self.zero, self.pipeline_schedule)))
        self._set("checkpointing", CheckpointPlan.resolve(self.activation_checkpointing))
        _check_checkpointing_with_schedule(self.checkpointing, self.pipeline_schedule)
        self._set("compile_arguments", compile_arguments(self.compile))
        self._check_auto_layout()
        self._set("reduce_dtype", checked_reduce_dtype(self.reduce_dtype))
        self._set("watchdog_timeout", checked_watchdog_timeout(self.watchdog_timeout))
        check_flags(offload=self.offload, shard_vocab=self.shard_vocab, tp_strict=self.tp_strict)
        check_loss_parallel(self.loss_parallel, self.tp, self.pp, self.shard_vocab)
        check_async_checkpoint(self.async_checkpoint, self.save_distributed_checkpoint)
        if self.check_replicas_every_n_steps is not None:
            check_positive("HybridStrategy", "check_replicas_every_n_steps", self.check_replicas_every_n_steps,
                           also=" or None (no check)")
        if self.weights is not None and not isinstance(self.weights, (str, os.PathLike)):
            raise ValueError(f"HybridStrategy(weights={self.weights!r}) must be the path of a Hugging Face checkpoint"
                             " directory.")

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: derived fields are filled in once, here

    @property
    def degrees(self) -> dict[str, Degree]:
        """``{"dp": ..., "tp": ..., "pp": ..., "dp_replicate": ...}`` (``"auto"`` where still to be chosen)."""
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "dp_replicate": self.dp_replicate}

    @property
    def chooses_layout(self) -> bool:
        """Whether tp or pp is ``"auto"``: the layout is chosen at setup (:mod:`lightning_hybrid.planner.auto_layout`)."""
        return AUTO in (self.tp, self.pp)

    @property
    def planned_checkpointing(self) -> Union[None, str, int]:
        """These options' checkpointing as the planner's ``Layout`` spells it: None, ``"every"``, ``"selective"``
        or N (every N-th block)."""
        plan = self.checkpointing
        if plan is None:
            return None
        return "selective" if plan.selective else "every" if plan.every == 1 else plan.every

    def with_degrees(self, dp: int, tp: int, pp: int, dp_replicate: int) -> "HybridOptions":
        """These options with a chosen layout's degrees (the schedule resolved for its pp); ``cluster``, which
        served the choice, is dropped, and so are the pipeline options when the layout has no pipeline (they were
        given for the case that one is chosen)."""
        no_pipeline = dict(microbatches=None, virtual_stages=None, pp_split=None) if pp == 1 else {}
        return self.changed(dp=dp, tp=tp, pp=pp, dp_replicate=dp_replicate, cluster=None, **no_pipeline)

    def changed(self, **changes: Any) -> "HybridOptions":
        """These options with ``changes``; what was left unset stays unset (``dataclasses.replace`` would pass
        the resolved ``zero`` and ``pp_schedule`` on as if given)."""
        return replace(self, **{**self.arguments(), **changes})

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments these options are built from: ``HybridOptions(**options.arguments()) == options``
        (``zero`` and ``pp_schedule`` as given, not as resolved)."""
        given = {"zero": self.zero_given, "pp_schedule": self.pp_schedule_given}
        return {item.name: given.get(item.name, getattr(self, item.name)) for item in fields(self) if item.init}

    def _checked_pipeline(self) -> Optional[PipelineSchedule]:
        if not (self.pp_split is None or self.pp_split == MEASURED_SPLIT or isinstance(self.pp_split, (list, tuple))):
            raise ValueError(f"HybridStrategy(pp_split={self.pp_split!r}) is invalid: pass the blocks of each stage"
                             f" (e.g. [3, 5]), '{MEASURED_SPLIT}' (balanced by measured time) or None (by FLOPs).")
        if self.pp == AUTO:
            _check_pipeline_may_be_chosen(self.pp_split, self.save_distributed_checkpoint)
            return None
        if self.pp == 1:
            if self.microbatches is not None or self.virtual_stages is not None or self.pp_split is not None:
                raise ValueError("HybridStrategy(microbatches=, virtual_stages=, pp_split=) are pipeline options:"
                                 " set pp > 1.")
            return None
        schedule = PipelineSchedule.resolve(self.pp_schedule, int(self.pp), self.virtual_stages, self.microbatches)
        if not self.save_distributed_checkpoint:
            raise ValueError(_CONSOLIDATED_WITH_PIPELINE)
        return schedule

    def _check_auto_layout(self) -> None:
        if self.cluster is not None and not isinstance(self.cluster, Cluster):
            raise ValueError(f"HybridStrategy(cluster={self.cluster!r}) must be a lightning_hybrid.Cluster.")
        if not self.chooses_layout:
            if self.cluster is not None:
                raise ValueError("HybridStrategy(cluster=) describes the hardware for tp='auto'/pp='auto'; pass one"
                                 " of them.")
            return
        if self.pp == AUTO and self.pp_schedule not in PLANNED_SCHEDULES:
            raise ValueError(
                f"HybridStrategy(pp='auto', pp_schedule={self.pp_schedule!r}): the planner models the schedules"
                f" {', '.join(PLANNED_SCHEDULES)}. Choose one of them, or pass pp=N for {self.pp_schedule!r}."
            )

    def check_fixed_degrees_divide(self, world_size: int, nodes: int, devices: int) -> None:
        """With an ``"auto"`` layout: the fixed degrees must divide the world size, and ``cluster=`` must describe
        the Trainer's nodes × devices."""
        fixed = {name: value for name, value in self.degrees.items() if value != AUTO}
        product = math.prod(fixed.values())
        if world_size % product:
            given = " × ".join(f"{name}={value}" for name, value in fixed.items() if value > 1)
            raise ValueError(f"{given} = {product} does not divide the world size {world_size} (devices × num_nodes):"
                             " no layout can be chosen. Change the fixed degrees or the number of devices.")
        cluster = self.cluster
        if cluster is not None and (cluster.nodes, cluster.gpus_per_node) != (nodes, devices):
            raise ValueError(f"HybridStrategy(cluster=...) describes {cluster.nodes} node(s) × {cluster.gpus_per_node}"
                             f" devices, but the Trainer runs num_nodes={nodes} × devices={devices}. Make them match.")


def check_degrees(dp: Degree, tp: Degree, pp: Degree, dp_replicate: int, auto: tuple[str, ...] = ("dp",)) -> None:
    """Reject degrees that are not positive integers; those named in ``auto`` may also be ``"auto"``."""
    for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("dp_replicate", dp_replicate)):
        if not (name in auto and value == AUTO):
            check_positive("HybridStrategy", name, value, also=" or 'auto'" if name in auto else "")


def check_zero_level(zero: object) -> int:
    """Validate a ZeRO level and return it."""
    if zero == 1:
        raise ValueError(
            "HybridStrategy(zero=1) is not offered: FSDP2 always shards gradients, so zero=2 (sharded gradients and"
            " optimizer state, parameters gathered once per step) uses less memory than ZeRO-1 at the same"
            " communication volume. Use zero=2, or zero=3 to also shard parameters between forward and backward."
        )
    if zero not in ZERO_LEVELS:
        raise ValueError(f"HybridStrategy(zero={zero!r}) is invalid: choose 2 or 3.")
    return int(zero)  # type: ignore[arg-type]


def check_precision(precision: str) -> None:
    """Refuse a Lightning precision flag the strategy does not serve."""
    if precision not in SUPPORTED_PRECISION:
        raise ValueError(f"precision={precision!r} is invalid: choose one of {', '.join(SUPPORTED_PRECISION)}.")


_CONSOLIDATED_WITH_PIPELINE = (
    # Lightning's consolidated save gathers on global rank 0, which holds only the first stage.
    "HybridStrategy(pp > 1, save_distributed_checkpoint=False) would write only the first pipeline stage's parameters"
    " into the consolidated file. Keep save_distributed_checkpoint=True (one DCP shard per rank, loadable under any"
    " layout)."
)


def _check_pipeline_may_be_chosen(pp_split: object, save_distributed_checkpoint: bool) -> None:
    if pp_split == MEASURED_SPLIT:
        raise ValueError("HybridStrategy(pp='auto', pp_split='measured') is not supported: the automatic layout plans"
                         " its stages with its cost model. Pass pp=N with pp_split='measured', or leave pp_split out.")
    if pp_split is not None:
        raise ValueError("HybridStrategy(pp='auto', pp_split=...): a split fixes the number of stages; pass pp=N with"
                         " it, or leave pp_split out and let the strategy balance the stages.")
    if not save_distributed_checkpoint:
        raise ValueError(_CONSOLIDATED_WITH_PIPELINE.replace("pp > 1", "pp='auto'", 1)
                         + " (pp='auto' may choose a pipeline.)")


def default_zero_level(pipelined: bool) -> int:
    """The ZeRO level when none is given. Under pp each step runs every microbatch's forward and backward through
    the stage: ZeRO-3 reshards a block after each forward and gathers it again for the next forward and for each
    backward (2 × microbatches all-gathers per block and step), ZeRO-2 gathers it once and keeps it to the step's
    last backward. Measured (``benchmarks/zero_under_pp.py``, BENCHMARKS.md): 4.6 × the all-gather bytes and
    1.2 × the step time for ZeRO-3 at dp2 × pp2 with 4 microbatches; the planner's cost model agrees."""
    return 2 if pipelined else 3


def _zero_level(zero: Optional[int], schedule: Optional[PipelineSchedule]) -> object:
    if schedule is None or not schedule.splits_weight_gradients:
        return default_zero_level(schedule is not None) if zero is None else zero
    if zero == 3:
        # torch computes a zero-bubble weight gradient against the parameters the module holds at that time; under
        # ZeRO-3 those are the resharded ones, not the gathered ones the forward used, and gradients come out wrong.
        raise ValueError(
            f"pp_schedule={schedule.name!r} computes weight gradients in a separate pass after backward, which"
            " needs parameters to stay gathered from forward to backward: use zero=2 (its default)."
        )
    return 2 if zero is None else zero


def _check_checkpointing_with_schedule(plan: Optional[CheckpointPlan], schedule: Optional[PipelineSchedule]) -> None:
    # Zero-bubble schedules run backward through a stage twice: input gradients first, then one weight-gradient
    # pass per group of parameters, each of which unpacks the checkpointed activations again.
    if plan is None or schedule is None or not schedule.splits_weight_gradients:
        return
    if plan.selective:
        raise ValueError(
            f"activation_checkpointing='selective' cannot run under pp_schedule={schedule.name!r}: torch's selective"
            " checkpointing allows one backward pass per checkpointed region, and zero-bubble schedules run two"
            " (input gradients, then weight gradients). Use activation_checkpointing='every' or an integer N, or a"
            " schedule without split weight gradients ('1f1b', 'interleaved_1f1b')."
        )
    from lightning.fabric.utilities.rank_zero import rank_zero_warn  # Lightning loads slowly; only this path needs it

    rank_zero_warn(
        f"activation checkpointing under pp_schedule={schedule.name!r} recomputes a checkpointed block once per"
        " weight-gradient pass (measured 4-7 recomputations per micro-batch on a GPT block instead of 1): numbers are"
        " unchanged but the recompute cost multiplies. 'interleaved_1f1b' recomputes each block once."
    )
