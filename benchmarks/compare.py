"""HybridStrategy next to the alternatives: a hand-written torch loop, Lightning's ModelParallelStrategy, FSDPStrategy
and DDPStrategy -- step time, peak memory and communication per step, each pair on the same model, data and layout.

Model and data: ``recipes/gpt.py``'s GPT (parallelism-unaware) with :data:`CONFIG` (4 blocks, width 256, 8 heads,
vocabulary 256, sequence 128: 3,323,392 parameters, 3,159,040 of them in the blocks), fp32, AdamW (the recipe's
``configure_optimizers``: two weight-decay groups, betas 0.9/0.95, warm-up + cosine LambdaLR stepped per step), a
global batch of :data:`GLOBAL_BATCH` sequences of random tokens drawn with a fixed seed. Every side seeds
``torch.manual_seed`` and builds ``GPT(CONFIG)`` eagerly on every rank, so all start from the same weights; every
side draws batches with ``DistributedSampler(shuffle=True, seed=0)`` over the data-parallel ranks (what Lightning
injects), so all see the same sequences in the same order.

Sides (one process per rank, launched with ``python -m torch.distributed.run``, gloo on CPU, ``OMP_NUM_THREADS=1``):

``hybrid``         Lightning ``Trainer`` + ``HybridStrategy(dp=, tp=, pp=, monitor=False)``, module unchanged
                   (with tp, ``shard_vocab=False``: embeddings and head whole over tp, as on the other sides).
``manual``         No Lightning: ``init_process_group("gloo")``, ``init_device_mesh``, then the same torch primitives
                   the strategy applies, written by hand (:func:`manual_parallelize`, :func:`manual_pipeline`):
                   dp: ``fully_shard`` per block (resharded after forward) + the GPT root (kept gathered);
                   tp: ``parallelize_module`` with ``ColwiseParallel`` on ``attn.c_attn`` and ``mlp.c_fc``,
                   ``RowwiseParallel`` on ``attn.c_proj`` and ``mlp.c_proj`` and the attention's head counts
                   divided by tp -- HybridStrategy's automatic plan for this block (``tp_plan_applied`` is printed
                   with ``--verbose``); the fused q|k|v rows are reordered once so a contiguous row shard holds whole
                   heads of q, k and v (HybridStrategy reaches the same with a strided placement);
                   pp: the GPT cut by hand at the same block boundary as the strategy's split, one
                   ``PipelineStage`` per rank, ``Schedule1F1B`` with the same microbatch count.
                   Loop: fetch, forward/backward (or ``schedule.step``), ``optimizer.step()``,
                   ``scheduler.step()``, ``zero_grad(set_to_none=True)``.
``modelparallel``  Lightning's ``ModelParallelStrategy`` with a ``configure_model`` written as Lightning's docs show
                   it (``parallelize_module`` on the tensor-parallel mesh when tp > 1, then ``fully_shard`` per block
                   and on ``self.model`` when dp > 1), using the same plan as ``manual``.
``fsdp``           Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` (FSDP1, FULL_SHARD). Lightning refuses it on
                   CPU although torch's FSDP1 trains there; :func:`_cpu_fsdp_strategy_class` lifts only that refusal.
``ddp``            Lightning's ``DDPStrategy()``.
``manual_fsdp1``   ``manual`` plus ``fully_shard`` over the 1-rank data-parallel mesh (tp2, pp2): HybridStrategy applies
                   FSDP2 whatever the data-parallel degree, and this side shows what that alone costs.

What is measured, per launch (one launch = one side on one layout; every rank writes JSON, the parent aggregates).
A step runs from the end of the previous one to its own end: from one ``on_train_batch_end`` to the next (Lightning),
from one loop iteration's end to the next (``manual``). Data fetch, forward, backward, optimizer, LR scheduler and
the framework's own per-step work (for Lightning 2.6.6 also the sigterm-flag broadcast it issues before every batch,
``training_epoch_loop.py:_broadcast_sigterm_tensor``) all fall inside; timing, counting and memory tracking use this
same window.

Step time
    :data:`WARMUP_STEPS` warm-up steps (shape inference of the pipeline, lazy AdamW state, allocator warm-up),
    then ``--steps`` timed steps, timed by ``time.perf_counter()`` at each step's end. Per launch: the median over
    the timed steps on each rank, then the maximum over ranks (the slowest rank sets the pace). Per side: the median
    over rounds of those per-launch figures. Sides alternate: each round launches every side once, grouped by
    layout with the HybridStrategy launch in the middle of its group (shared by that layout's pairs), and the next
    round runs the list backwards, so drift of the machine -- other jobs share these 2 cores -- falls on both sides
    of a pair; the ratio is the median over rounds of the per-round ratio A/B (its range is printed). Interference
    from other jobs comes in bursts that can slow a whole launch, and only ever adds time, so the table also gives
    each side's best round (the smallest per-launch median) and their ratio: the least disturbed estimate.
CPU time per step
    ``time.process_time()`` of each rank's process (all its threads, gloo's included) between the same step ends;
    median over the timed steps, summed over ranks. It is the work a side does per step, and far less sensitive
    than wall time to other processes taking turns on the cores (not to cache or memory-bandwidth contention); it
    excludes time spent waiting, so a side that waits longer (pipeline bubble, a slow peer) is only seen in wall time.
Peak memory
    Tensor bytes, not the process's RSS: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, a
    TorchDispatchMode following every storage by weak reference) over the step after the counted one. Existing
    storages are registered at entry (parameters, current gradients, optimizer state, the pipeline's persistent
    receive buffers), so the peak is of everything alive: parameters + gradients + optimizer state + activations +
    temporaries + gathered parameters and communication buffers + the batch. Module hooks and the optimizer hook
    are off (:func:`make_peak_tracker`: a pipeline stage runs once per microbatch, which MemTracker's per-module
    bookkeeping refuses, and Lightning runs forward inside ``optimizer.step``); the phase of the peak and its
    breakdown by category are kept (``--json``). Reported: the maximum over ranks.
Communication
    ``lightning_hybrid.observe.counting.StepCounter`` around the step after the timed ones: bytes of the full tensor each
    collective works on, per collective type. :func:`make_comm_counter` also counts calls per type (``barrier``
    included: no payload, but a synchronization of all ranks) and books collectives on 1-rank process groups apart
    (no byte leaves the process; listed under the table). Reported: the maximum over ranks per type. Theoretical
    minimum per rank (E = 4 bytes, P = parameters, b = sequences per data-parallel rank, L blocks, T, C sequence and
    width; :func:`minimum_comm`):

    * dp (ZeRO-3, FSDP): all-gather ``2·P_blocks + P_root`` (blocks gathered in forward and again in backward; the
      root -- embeddings, final norm, head -- stays gathered from forward to backward, as HybridStrategy, FSDP2's
      default and FSDP1 all do; 3·P with the root resharded too), reduce-scatter ``P`` (all × E).
    * dp (DDP): one all-reduce of the gradients, ``P·E``.
    * tp (Megatron): per block 2 all-reduces of ``b·T·C·E`` in forward (after the two row-parallel layers) and 2 in
      backward (input gradients of the two column-parallel layers); embeddings, final norm and head are replicated
      and computed redundantly, their gradients already agree, so nothing else is needed.
    * pp: ``b·T·C·E`` of activations sent forward and as many gradient bytes sent back across each stage boundary,
      i.e. per rank of 2 stages: send ``b·T·C·E`` and receive ``b·T·C·E``.
Same computation
    The loss of step 1 and of the last step on each side (dp: mean over the data-parallel ranks; pp: the last
    stage's mean over microbatches) -- they must agree to float rounding.
Python overhead (``--profile DIR``)
    cProfile of each rank's timed steps (written to DIR) and the Python function calls per step, per side: a
    deterministic measure of framework work in Python, where time on a shared machine is not. The profiler slows
    Python-heavy sides more, so step times of such a run are distorted.

Usage::

    python benchmarks/compare.py                    # the 9 two-rank pairs, 3 rounds (about 9 minutes on 2 cores)
    python benchmarks/compare.py --quick            # one round, 5 timed steps (about 3 minutes)
    python benchmarks/compare.py --pairs manual-dp2,manual-pp2 --rounds 5
    python benchmarks/compare.py --list             # pair names (including the oversubscribed 4-rank ones)
    python benchmarks/compare.py --json out.json    # also every launch's raw numbers
    python benchmarks/compare.py --quick --profile prof/   # cProfile of the timed steps, Python calls per step
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
from torch import Tensor, nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from recipes.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
GLOBAL_BATCH = 8  # sequences per optimizer step over all data-parallel ranks
MICROBATCHES = 4  # pipeline layouts: microbatches per step, the same on both sides
WARMUP_STEPS = 2
TIMED_STEPS = 8
QUICK_TIMED_STEPS = 5
ROUNDS = 3
MODEL_SEED = 1234
DATA_SEED = 4321
LR, WEIGHT_DECAY, LR_WARMUP = 3e-3, 0.1, 2  # the recipe's optimizer settings, short warm-up
FP32 = 4
MiB = 2**20


# ============================================================================================ layouts, pairs
@dataclass(frozen=True)
class Layout:
    name: str
    dp: int = 1
    tp: int = 1
    pp: int = 1

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def oversubscribed(self) -> bool:
        return self.world > (os.cpu_count() or 1)


LAYOUTS = {layout.name: layout for layout in (
    Layout("dp2", dp=2), Layout("tp2", tp=2), Layout("pp2", pp=2), Layout("dp2-tp2", dp=2, tp=2),
)}

SIDES = {
    "hybrid": "Lightning + HybridStrategy",
    "manual": "hand-written torch loop",
    "modelparallel": "Lightning ModelParallelStrategy + configure_model",
    "fsdp": "Lightning FSDPStrategy (FSDP1)",
    "ddp": "Lightning DDPStrategy",
    "manual_fsdp1": "hand-written loop + FSDP2 over the 1-rank data mesh (HybridStrategy's dp=1 sharding)",
}


@dataclass(frozen=True)
class Pair:
    """Side ``a`` (HybridStrategy) against side ``b`` on one layout."""

    name: str
    layout: str
    a: str
    b: str


PAIRS = {pair.name: pair for pair in (
    Pair("manual-dp2", "dp2", "hybrid", "manual"),
    Pair("manual-tp2", "tp2", "hybrid", "manual"),
    Pair("manual-pp2", "pp2", "hybrid", "manual"),
    Pair("modelparallel-tp2", "tp2", "hybrid", "modelparallel"),
    Pair("modelparallel-dp2", "dp2", "hybrid", "modelparallel"),
    Pair("fsdp-dp2", "dp2", "hybrid", "fsdp"),
    Pair("ddp-dp2", "dp2", "hybrid", "ddp"),
    # Attribution: what FSDP2 on a 1-rank data mesh (which HybridStrategy applies at dp=1) costs by itself.
    Pair("manual_fsdp1-tp2", "tp2", "hybrid", "manual_fsdp1"),
    Pair("manual_fsdp1-pp2", "pp2", "hybrid", "manual_fsdp1"),
    # 4 ranks: oversubscribed on a 2-core machine, so not in the default set.
    Pair("manual-dp2-tp2", "dp2-tp2", "hybrid", "manual"),
    Pair("modelparallel-dp2-tp2", "dp2-tp2", "hybrid", "modelparallel"),
)}
DEFAULT_PAIRS = [name for name, pair in PAIRS.items() if LAYOUTS[pair.layout].world == 2]


# ============================================================================================== measurement
def make_comm_counter() -> Any:
    """``StepCounter`` that books collectives on 1-rank process groups apart (``local_bytes``): they move no data.
    (Subclassed here, on first use, so the parent process never imports ``lightning_hybrid``.)"""
    import torch.distributed as dist

    from lightning_hybrid.observe.counting import COLLECTIVE_TYPES, StepCounter

    class _CommCounter(StepCounter):
        def __init__(self) -> None:
            super().__init__()
            #: Calls per collective type on groups of more than one rank (``barrier`` included: it moves no
            #: payload but synchronizes the ranks, which StepCounter's byte count does not show).
            self.calls: dict[str, int] = defaultdict(int)
            self.local_bytes: dict[str, int] = defaultdict(int)
            self.local_calls: dict[str, int] = defaultdict(int)

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            if func.namespace not in ("c10d", "_c10d_functional"):
                return super().__torch_dispatch__(func, types, args, kwargs)
            before = dict(self.comm_bytes)
            out = super().__torch_dispatch__(func, types, args, kwargs)
            name = func._overloadpacket.__name__
            kind = COLLECTIVE_TYPES.get(name, "barrier" if name == "barrier" else None)
            if kind is None:  # wait_tensor and the like
                return out
            if _group_size(dist, func, args) == 1:
                self.local_calls[kind] += 1
                for moved_kind, value in list(self.comm_bytes.items()):
                    moved = value - before.get(moved_kind, 0)
                    if moved:
                        self.comm_bytes[moved_kind] -= moved
                        self.local_bytes[moved_kind] += moved
            else:
                self.calls[kind] += 1
            return out

    return _CommCounter()


def _group_size(dist: Any, func: Any, args: tuple) -> Optional[int]:
    """Size of the process group a collective runs on: a ProcessGroup script object (c10d ops) or a group name
    (functional collectives, the last string argument)."""
    if func.namespace == "c10d":
        for value in args:
            if isinstance(value, torch.ScriptObject):
                try:
                    return dist.ProcessGroup.unbox(value).size()
                except RuntimeError:  # another script object (a ReduceOp)
                    continue
        return None
    for value in reversed(args):
        if isinstance(value, str):
            try:
                return dist.distributed_c10d._resolve_process_group(value).size()
            except Exception:
                continue
    return None


def make_peak_tracker() -> Any:
    """MemTracker without module hooks: only the peak of the total tensor bytes is read (see the module doc)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    from benchmarks.memory import EngineOnly

    class PeakTracker(MemTracker):
        """Also notes the phase of the step the peak falls in and its breakdown by MemTracker's categories:
        storages existing at entry (``Parameter``, ``Gradient``, ``Optstate``), created in forward (``Activation``:
        activations, gathered parameters) or in backward (``Temp``: new gradients, activation gradients)."""

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = EngineOnly()  # type: ignore[assignment]
            self._backward_seen = False
            self.peak_phase = "entry"

        def _register_global_optimizer_hook(self) -> None:
            # MemTracker files everything inside optimizer.step() as optimizer state; Lightning runs forward and
            # backward inside optimizer.step(closure), which would blur the breakdown.
            pass

        def _update_peak_stats(self, peak_state: Any) -> None:
            before = self.peak_bytes()
            super()._update_peak_stats(peak_state)
            backward = self._mod_tracker.is_bw
            self._backward_seen |= backward
            if self.peak_bytes() > before:
                self.peak_phase = "backward" if backward else "optimizer step" if self._backward_seen else "forward"

        def peak_bytes(self) -> int:
            # Meta-device "storages" (the pipeline's shape-only stand-ins) hold no memory.
            return sum(total for device, total in self._peak_mem.items() if device.type != "meta")

        def peak_breakdown(self) -> dict[str, int]:
            result: dict[str, int] = defaultdict(int)
            for device, snapshot in self._peak_mem_snap.items():
                if device.type != "meta":
                    for key, value in snapshot.items():
                        name = str(getattr(key, "value", key))
                        if value and name != "Total":
                            result[name] += value
            return dict(result)

    return PeakTracker()


def pipeline_receive_buffers(stages: Iterable[Any]) -> list[Tensor]:
    """The receive buffers a ``PipelineStage`` allocates once per microbatch and keeps (private attributes)."""
    buffers: list[Tensor] = []
    for stage in stages:
        for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
            buffers += [info.buffer for info in infos if isinstance(getattr(info, "buffer", None), Tensor)]
    return buffers


@dataclass
class RankRecord:
    """What one rank of one launch measured (written as JSON)."""

    rank: int
    step_ends: list[float] = field(default_factory=list)
    step_cpu_ends: list[float] = field(default_factory=list)
    losses: list[Optional[float]] = field(default_factory=list)
    comm_bytes: dict[str, int] = field(default_factory=dict)
    comm_calls: dict[str, int] = field(default_factory=dict)
    local_comm_bytes: dict[str, int] = field(default_factory=dict)
    local_comm_calls: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class StepWindows:
    """Which steps are timed, counted, memory-tracked (and profiled), and the contexts that do it (shared by every
    side)."""

    def __init__(self, timed_steps: int, record: RankRecord, profile_to: Optional[Path] = None) -> None:
        self.count_step = WARMUP_STEPS + timed_steps
        self.memory_step = self.count_step + 1
        self.total_steps = self.memory_step + 1
        self.record = record
        self._counter: Any = None
        self._tracker: Any = None
        self._profile_to = profile_to
        self._profiler: Any = None

    def begin(self, step: int, track: Callable[[], list[Any]]) -> None:
        """Before step ``step``'s work; ``track()`` lists what exists already (modules, optimizers, tensors)."""
        if step == WARMUP_STEPS and self._profile_to is not None:
            import cProfile

            self._profiler = cProfile.Profile()
            self._profiler.enable()
        if step == self.count_step:
            self._counter = make_comm_counter()
            self._counter.__enter__()
        elif step == self.memory_step:
            self._tracker = make_peak_tracker()
            # Modules bring their parameters, buffers and current gradients; optimizers their state.
            self._tracker.track_external(*track())
            self._tracker.__enter__()

    def end(self, step: int, loss: Optional[float]) -> None:
        """After step ``step``'s work (optimizer step included)."""
        self.record.step_ends.append(time.perf_counter())
        self.record.step_cpu_ends.append(time.process_time())
        self.record.losses.append(loss)
        if self._profiler is not None and step == self.count_step - 1:  # the timed steps, and only those
            self._profiler.disable()
            self._profiler.dump_stats(self._profile_to)
            self._profiler = None
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self.record.comm_bytes = {k: v for k, v in self._counter.comm_bytes.items() if v}
            self.record.comm_calls = dict(self._counter.calls)
            self.record.local_comm_bytes = dict(self._counter.local_bytes)
            self.record.local_comm_calls = dict(self._counter.local_calls)
            self._counter = None
        if self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self.record.peak_bytes = self._tracker.peak_bytes()
            self.record.info["peak_phase"] = self._tracker.peak_phase
            self.record.info["peak_breakdown"] = self._tracker.peak_breakdown()
            self._tracker = None


# ==================================================================================================== data
def make_dataset(steps: int) -> Any:
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * steps, CONFIG.block_size + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def parameter_counts(config: GPTConfig = CONFIG) -> dict[str, int]:
    """Total, per-block and outside-the-blocks parameter counts of the GPT (no model is built)."""
    C, V, T, L = config.n_embd, config.vocab_size, config.block_size, config.n_layer
    per_block = 2 * 2 * C + (3 * C * C + 3 * C) + (C * C + C) + (4 * C * C + 4 * C) + (4 * C * C + C)
    root = V * C + T * C + 2 * C + C * V  # wte, wpe, ln_f, lm_head (no bias)
    return {"total": L * per_block + root, "block": per_block, "blocks": L * per_block, "root": root}


def block_parameters_per_tp_rank(tp: int, config: GPTConfig = CONFIG) -> int:
    """Parameters of one block a tensor-parallel rank holds under the Megatron plan: column layers' weights and
    biases and row layers' weights sharded, LayerNorms and the row layers' biases whole."""
    C = config.n_embd
    sharded = (3 * C * C + 3 * C) + C * C + (4 * C * C + 4 * C) + 4 * C * C
    whole = 2 * 2 * C + C + C
    return sharded // tp + whole


def minimum_comm(layout: Layout, side: str) -> dict[str, int]:
    """Theoretical minimum bytes per collective type per rank and step (formulas in the module docstring)."""
    counts = parameter_counts()
    b = GLOBAL_BATCH // layout.dp
    activation = b * CONFIG.block_size * CONFIG.n_embd * FP32
    result: dict[str, int] = defaultdict(int)
    if layout.tp > 1:
        result["all_reduce"] += 4 * CONFIG.n_layer * activation
    if layout.dp > 1:
        blocks = CONFIG.n_layer * block_parameters_per_tp_rank(layout.tp)
        if side == "ddp":
            result["all_reduce"] += (blocks + counts["root"]) * FP32
        else:
            result["all_gather"] += (2 * blocks + counts["root"]) * FP32
            result["reduce_scatter"] += (blocks + counts["root"]) * FP32
    if layout.pp > 1:
        result["send"] += activation
        result["recv"] += activation
    return dict(result)


# ============================================================================================ manual side
def make_optimizer(parameters: list[nn.Parameter], total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The recipe's optimizer and schedule (``GPTLightning.configure_optimizers``), built without Lightning."""
    from recipes.gpt import cosine_with_warmup

    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(LR_WARMUP, total_steps))
    return optimizer, scheduler


def tensor_parallelize_blocks(blocks: nn.ModuleList, tp_mesh: Any) -> None:
    """Megatron plan on every block with torch's ``parallelize_module``: q|k|v and MLP-up column-parallel, the two
    output projections row-parallel, attention head counts per rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in blocks:
        attn = block.attn
        # c_attn's rows are [q | k | v]. A contiguous row shard must hold whole heads of each, so deal the rows as
        # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] once (same values, same products; only the row order changes).
        with torch.no_grad():
            weight = attn.c_attn.weight
            attn.c_attn.weight.copy_(weight.view(3, tp, -1, weight.shape[1]).transpose(0, 1).reshape_as(weight))
            bias = attn.c_attn.bias
            attn.c_attn.bias.copy_(bias.view(3, tp, -1).transpose(0, 1).reshape_as(bias))
        attn.n_head //= tp
        attn.n_embd //= tp
        parallelize_module(block, tp_mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })


def fully_shard_model(model: nn.Module, blocks: Iterable[nn.Module], dp_mesh: Any) -> None:
    """FSDP2: each block one unit (resharded after forward: ZeRO-3), the root last (FSDP2's default keeps the root
    gathered from forward to backward)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh)


def manual_parallelize(model: nn.Module, layout: Layout, mesh: Any, shard_single_rank: bool = False) -> None:
    """tp, then FSDP2 when there is more than one data-parallel rank (or always, with ``shard_single_rank``:
    the ``manual_fsdp1`` side)."""
    if layout.tp > 1:
        tensor_parallelize_blocks(model.blocks, mesh["tp"])
    if layout.dp > 1 or shard_single_rank:
        fully_shard_model(model, model.blocks, mesh["dp"])


class FirstStage(nn.Module):
    """Embeddings and the first blocks of the GPT (``GPT.forward`` up to the cut)."""

    def __init__(self, gpt: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(blocks)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The remaining blocks, final norm and LM head (``GPT.forward`` after the cut)."""

    def __init__(self, gpt: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def split_blocks(n_layer: int, stages: int) -> list[int]:
    """Blocks per stage: as even as possible, the extra blocks on the earlier stages. For this GPT it equals the
    strategy's FLOP-balanced split (both sides record ``blocks_per_stage``; the report warns if they differ)."""
    return [n_layer // stages + (1 if s < n_layer % stages else 0) for s in range(stages)]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run_manual(layout: Layout, windows: StepWindows, shard_single_rank: bool = False) -> None:
    """The hand-written training loop (no Lightning). ``shard_single_rank``: apply FSDP2 even over a 1-rank data
    mesh, as HybridStrategy does (the ``manual_fsdp1`` side)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader, DistributedSampler

    from recipes.gpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Same rank order as HybridStrategy's mesh: pipeline outermost, tensor-parallel innermost.
    mesh = init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(MODEL_SEED)
    model = GPT(CONFIG)
    steps = windows.total_steps
    data = make_dataset(steps)
    sampler = DistributedSampler(data, num_replicas=layout.dp, rank=dp_rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // layout.dp, sampler=sampler)

    if layout.pp > 1:
        stage, schedule, stage_module = manual_pipeline(model, layout, mesh, shard_single_rank)
        optimizer, scheduler = make_optimizer(list(stage_module.parameters()), steps)
        first, last = stage.is_first, stage.is_last
        windows.record.info["blocks_per_stage"] = split_blocks(CONFIG.n_layer, layout.pp)

        def existing() -> list[Any]:
            return [stage_module, optimizer, *pipeline_receive_buffers([stage])]

        batches = iter(loader)
        for step in range(steps):
            windows.begin(step, existing)  # before the fetch: the step's window is the whole iteration
            idx, targets = next(batches)
            losses: list[Tensor] = []
            if first:
                schedule.step(idx)
            elif last:
                schedule.step(target=targets, losses=losses, return_outputs=False)
            else:
                schedule.step()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            windows.end(step, torch.stack(losses).mean().item() if losses else None)
    else:
        manual_parallelize(model, layout, mesh, shard_single_rank)
        optimizer, scheduler = make_optimizer(list(model.parameters()), steps)
        batches = iter(loader)
        for step in range(steps):
            windows.begin(step, lambda: [model, optimizer])
            idx, targets = next(batches)
            loss = cross_entropy(model(idx), targets)
            loss.backward()
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            windows.end(step, loss.item())
    windows.record.rank = rank
    dist.barrier()
    dist.destroy_process_group()


def manual_pipeline(
    model: nn.Module, layout: Layout, mesh: Any, shard_single_rank: bool = False
) -> tuple[Any, Any, nn.Module]:
    """Cut the GPT at the block boundary, keep this rank's stage, wrap it in a PipelineStage and a 1F1B schedule
    (``shard_single_rank``: FSDP2 on the stage over the 1-rank data mesh first, as HybridStrategy does)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if layout.pp != 2:
        raise ValueError("the hand-written pipeline cuts the GPT into 2 stages")
    stage_index = mesh["pp"].get_local_rank()
    cut = split_blocks(CONFIG.n_layer, layout.pp)[0]
    blocks = list(model.blocks)
    stage_module = FirstStage(model, blocks[:cut]) if stage_index == 0 else LastStage(model, blocks[cut:])
    if shard_single_rank:
        fully_shard_model(stage_module, stage_module.blocks, mesh["dp"])
    stage = PipelineStage(stage_module, stage_index, layout.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    # scale_grads=True (default): gradients are divided by the microbatch count, i.e. the mean over microbatches.
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=cross_entropy)
    return stage, schedule, stage_module


# ========================================================================================= Lightning sides
def make_lightning_module(side: str, steps: int) -> Any:
    """The recipe's LightningModule (built eagerly: call after seeding); ModelParallelStrategy also needs a
    ``configure_model``."""
    from recipes.gpt import GPTLightning

    kwargs = dict(lr=LR, weight_decay=WEIGHT_DECAY, warmup_steps=LR_WARMUP, max_steps=steps)
    if side != "modelparallel":
        return GPTLightning(CONFIG, **kwargs)

    class ModelParallelGPT(GPTLightning):
        """The recipe's module plus the ``configure_model`` ModelParallelStrategy requires, in the docs' style."""

        def configure_model(self) -> None:
            if getattr(self, "_parallelized", False):
                return
            self._parallelized = True
            dp_mesh, tp_mesh = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
            if tp_mesh.size() > 1:
                tensor_parallelize_blocks(self.model.blocks, tp_mesh)
            if dp_mesh.size() > 1:
                fully_shard_model(self.model, self.model.blocks, dp_mesh)

    return ModelParallelGPT(CONFIG, **kwargs)


def _cpu_fsdp_strategy_class() -> type:
    """Lightning's FSDPStrategy, allowed on CPU. Two things stop it there, neither in FSDP1 itself (which trains on
    CPU/gloo when given ``device_id=torch.device("cpu")``): the accelerator connector refuses ``accelerator="cpu"``
    by an exact type check (``type(strategy) is FSDPStrategy``), which a subclass passes; and ``_setup_model`` passes
    ``device_id=root_device.index``, ``None`` on CPU, which FSDP1 rejects -- so FSDP1 is given the CPU device while
    the strategy wraps the model. Nothing else of the strategy changes."""
    import torch.distributed.fsdp as fsdp
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            original = fsdp.FullyShardedDataParallel

            class OnCPU(original):  # type: ignore[misc, valid-type]
                def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
                    super().__init__(*args, device_id=device_id if device_id is not None else torch.device("cpu"),
                                     **kwargs)

            fsdp.FullyShardedDataParallel = OnCPU  # Lightning imports it from here inside _setup_model
            try:
                return super()._setup_model(model)
            finally:
                fsdp.FullyShardedDataParallel = original

    return CPUFSDPStrategy


def make_strategy(side: str, layout: Layout) -> Any:
    if side == "hybrid":
        from lightning_hybrid import HybridStrategy

        options: dict[str, Any] = dict(dp=layout.dp, tp=layout.tp, pp=layout.pp)
        if layout.pp > 1:
            options.update(pp_schedule="1f1b", microbatches=MICROBATCHES)
        if "monitor" in inspect.signature(HybridStrategy.__init__).parameters:
            options["monitor"] = False  # the strategy alone, without its monitoring callback
        if layout.tp > 1 and "shard_vocab" in inspect.signature(HybridStrategy.__init__).parameters:
            options["shard_vocab"] = False  # the other sides' plan: embeddings and head whole over tp
        return HybridStrategy(**options)
    if side == "modelparallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=layout.dp, tensor_parallel_size=layout.tp)
    if layout.tp > 1 or layout.pp > 1:
        raise ValueError(f"side {side!r} is data-parallel only")
    if side == "fsdp":
        from recipes.gpt import Block

        return _cpu_fsdp_strategy_class()(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    if side == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    raise ValueError(f"unknown side {side!r}")


def run_lightning(side: str, layout: Layout, windows: StepWindows) -> None:
    """One rank of a Lightning side: ``Trainer.fit`` with the side's strategy and a callback feeding ``windows``."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    steps = windows.total_steps

    class StepProbe(pl.Callback):
        """Ends step ``i`` and opens the window of step ``i + 1`` in ``on_train_batch_end``: a step runs from one
        ``on_train_batch_end`` to the next, so Lightning's work between batches (LR scheduler, the per-batch
        sigterm broadcast, fetching) is timed, counted and tracked like the manual loop's."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            windows.end(batch_idx, float(loss) if isinstance(loss, Tensor) else None)

            def existing() -> list[Any]:
                stages = []
                pipeline = getattr(trainer.strategy, "pipeline", None)
                if pipeline is not None:
                    for schedule, _ in pipeline._schedules.values():  # (schedule, its stage buffers)
                        stages += getattr(schedule, "_stages", None) or [schedule._stage]
                return [trainer.strategy.model, pl_module, *trainer.optimizers, *pipeline_receive_buffers(stages)]

            windows.begin(batch_idx + 1, existing)

    torch.manual_seed(MODEL_SEED)
    module = make_lightning_module(side, steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=layout.world, strategy=make_strategy(side, layout), precision="32-true",
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[StepProbe()],
    )
    # Per data-parallel rank; Lightning's DistributedSampler (shuffle, seed 0) deals the sequences out.
    trainer.fit(module, DataLoader(make_dataset(steps), batch_size=GLOBAL_BATCH // layout.dp))
    windows.record.rank = trainer.global_rank
    strategy = trainer.strategy
    if side == "hybrid":
        windows.record.info["tp_plan_applied"] = dict(strategy.tp_plan_applied)
        if strategy.pipeline is not None:
            windows.record.info["blocks_per_stage"] = list(strategy.pipeline.split.blocks_per_stage)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo crashes at interpreter exit otherwise


def run_worker(side: str, layout: Layout, timed_steps: int, out: Path, profile: bool = False) -> None:
    """One rank of a launch: run the side, write ``rank<N>.json`` (and ``rank<N>.pstats`` when profiling)."""
    warnings.simplefilter("ignore")  # Lightning's advice about workers and logging on tiny runs
    import logging

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    record = RankRecord(rank=int(os.environ.get("RANK", 0)))
    windows = StepWindows(timed_steps, record, out / f"rank{record.rank}.pstats" if profile else None)
    if side in ("manual", "manual_fsdp1"):
        run_manual(layout, windows, shard_single_rank=side == "manual_fsdp1")
    else:
        run_lightning(side, layout, windows)
    (out / f"rank{record.rank}.json").write_text(json.dumps(asdict(record)))


# ================================================================================================ launcher
@dataclass
class Launch:
    """One side on one layout in one round: the per-rank records and what follows from them."""

    side: str
    layout: str
    round: int
    ranks: list[dict[str, Any]]
    wall_s: float

    def _timed_medians(self, key: str) -> list[float]:
        """Per rank: the median over the timed steps of the time between consecutive step ends."""
        medians = []
        for record in self.ranks:
            ends = record[key]
            count_step = len(ends) - 2
            medians.append(statistics.median(ends[i] - ends[i - 1] for i in range(WARMUP_STEPS, count_step)))
        return medians

    def step_seconds(self) -> float:
        """Wall time per step: the slowest rank's median."""
        return max(self._timed_medians("step_ends"))

    def cpu_seconds(self) -> float:
        """CPU time per step (all threads of the process), summed over ranks."""
        return sum(self._timed_medians("step_cpu_ends"))

    def loss(self, step: int) -> float:
        """Mean over the ranks that report one (dp ranks: their shard's loss; pp: the last stage)."""
        values = [r["losses"][step] for r in self.ranks if r["losses"][step] is not None]
        return sum(values) / len(values)

    def per_type(self, key: str) -> dict[str, int]:
        """Max over ranks of each collective type's value (``comm_bytes``, ``comm_calls``, ``local_...``)."""
        result: dict[str, int] = {}
        for record in self.ranks:
            for kind, value in record[key].items():
                result[kind] = max(result.get(kind, 0), value)
        return {kind: value for kind, value in result.items() if value}

    def peak_bytes(self) -> int:
        return max(r["peak_bytes"] for r in self.ranks)


def launch(
    side: str, layout: Layout, timed_steps: int, round_index: int, profile_dir: Optional[Path] = None,
    timeout_s: float = 300.0,
) -> Launch:
    """Start ``layout.world`` ranks of this script with torch's launcher (Lightning detects its environment and
    launches nothing itself; the manual loop reads the same variables), every side identically."""
    with tempfile.TemporaryDirectory(prefix="compare-bench-") as folder:
        out = Path(folder)
        env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread per rank: 2 ranks on 2 cores
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env.pop("PL_GLOBAL_SEED", None)  # Lightning's sampler seed stays 0, as the manual loop assumes
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={layout.world}",
            str(Path(__file__).resolve()), "--worker", side, layout.name, "--steps", str(timed_steps),
            "--out", str(out),
            *(["--profile", str(profile_dir)] if profile_dir else []),
        ]
        start = time.perf_counter()
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
        wall = time.perf_counter() - start
        files = [out / f"rank{rank}.json" for rank in range(layout.world)]
        if done.returncode != 0 or not all(f.exists() for f in files):
            raise RuntimeError(f"{side} on {layout.name} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n"
                               f"{done.stderr[-6000:]}")
        if profile_dir is not None:  # keep each rank's profile of the timed steps
            for rank in range(layout.world):
                kept = profile_dir / f"{side}-{layout.name}-round{round_index + 1}-rank{rank}.pstats"
                (out / f"rank{rank}.pstats").replace(kept)
        return Launch(side, layout.name, round_index, [json.loads(f.read_text()) for f in files], wall)


def run_rounds(
    pairs: list[Pair], rounds: int, timed_steps: int, profile_dir: Optional[Path] = None
) -> dict[str, list[tuple[Launch, Launch]]]:
    """Each round launches every side each layout needs once -- grouped by layout, the HybridStrategy launch in
    the middle of its group and shared by that layout's pairs -- and the next round runs the same list backwards
    (``... B1 A B2 ...``, then ``... B2 A B1 ...``). Returns each pair's ``(A, B)`` launches, one per round."""
    groups: dict[str, list[str]] = {}
    for pair in pairs:
        sides = groups.setdefault(pair.layout, [])
        if pair.b not in sides:
            sides.append(pair.b)
    order: list[tuple[str, str]] = []
    for layout_name, others in groups.items():
        middle = len(others) // 2
        order += [(side, layout_name) for side in (*others[:middle], "hybrid", *others[middle:])]
    results: dict[str, list[tuple[Launch, Launch]]] = {pair.name: [] for pair in pairs}
    for round_index in range(rounds):
        launched: dict[tuple[str, str], Launch] = {}
        for side, layout_name in (order if round_index % 2 == 0 else order[::-1]):
            result = launch(side, LAYOUTS[layout_name], timed_steps, round_index, profile_dir)
            launched[(side, layout_name)] = result
            print(f"  round {round_index + 1}/{rounds} {layout_name:7s} {side:13s}"
                  f" step {result.step_seconds() * 1e3:5.0f} ms, CPU {result.cpu_seconds() * 1e3:5.0f} ms"
                  f"  (launch {result.wall_s:3.0f} s)", file=sys.stderr, flush=True)
        for pair in pairs:
            results[pair.name].append((launched[(pair.a, pair.layout)], launched[(pair.b, pair.layout)]))
    return results


# =================================================================================================== table
def _size(value: Optional[int]) -> str:
    if value is None or value == 0:
        return "0"
    if value < 1024:
        return f"{value} B"
    if value < MiB:
        return f"{value / 1024:.1f} KiB"
    return f"{value / MiB:.3f} MiB"


_COMM_ORDER = ("all_gather", "reduce_scatter", "all_reduce", "send", "recv", "broadcast", "all_to_all", "barrier")


def comm_cell(a: dict[str, int], b: dict[str, int], minimum: dict[str, int], calls_a: dict[str, int],
              calls_b: dict[str, int]) -> str:
    """One line per collective type: ``bytes A (calls) / bytes B (calls) / minimum bytes``."""
    kinds = set(a) | set(b) | set(minimum) | set(calls_a) | set(calls_b)

    def side(bytes_: dict[str, int], calls: dict[str, int], kind: str) -> str:
        count = calls.get(kind, 0)
        return _size(bytes_.get(kind)) + (f" ({count}×)" if count else "")

    ordered = sorted(kinds, key=lambda k: _COMM_ORDER.index(k) if k in _COMM_ORDER else 99)
    return "<br>".join(f"{kind}: {side(a, calls_a, kind)} / {side(b, calls_b, kind)} / {_size(minimum.get(kind))}"
                       for kind in ordered) or "none"


@dataclass
class PairResult:
    """One row of the table: a pair's figures aggregated over rounds (see the module docstring)."""

    pair: Pair
    step_a: float
    step_b: float
    ratio: float
    ratio_range: tuple[float, float]
    best_a: float
    best_b: float
    cpu_a: float
    cpu_b: float
    cpu_ratio: float
    cpu_ratio_range: tuple[float, float]
    peak_a: int
    peak_b: int
    comm_a: dict[str, int]
    comm_b: dict[str, int]
    calls_a: dict[str, int]
    calls_b: dict[str, int]
    local_a: dict[str, int]
    local_b: dict[str, int]
    minimum: dict[str, int]
    losses: dict[str, tuple[float, float]]
    info: dict[str, Any]


def summarize(pair: Pair, rounds: list[tuple[Launch, Launch]]) -> PairResult:
    """Times over all rounds; memory, communication and losses from the first (they do not vary between rounds)."""
    a, b = [x for x, _ in rounds], [y for _, y in rounds]
    ratios = [x.step_seconds() / y.step_seconds() for x, y in rounds]
    cpu_ratios = [x.cpu_seconds() / y.cpu_seconds() for x, y in rounds]
    last_step = len(a[0].ranks[0]["losses"]) - 1
    info = {side: runs[0].ranks[0]["info"] for side, runs in ((pair.a, a), (pair.b, b))}
    return PairResult(
        pair=pair,
        step_a=statistics.median(l.step_seconds() for l in a),
        step_b=statistics.median(l.step_seconds() for l in b),
        ratio=statistics.median(ratios), ratio_range=(min(ratios), max(ratios)),
        best_a=min(l.step_seconds() for l in a), best_b=min(l.step_seconds() for l in b),
        cpu_a=statistics.median(l.cpu_seconds() for l in a), cpu_b=statistics.median(l.cpu_seconds() for l in b),
        cpu_ratio=statistics.median(cpu_ratios), cpu_ratio_range=(min(cpu_ratios), max(cpu_ratios)),
        peak_a=a[0].peak_bytes(), peak_b=b[0].peak_bytes(),
        comm_a=a[0].per_type("comm_bytes"), comm_b=b[0].per_type("comm_bytes"),
        calls_a=a[0].per_type("comm_calls"), calls_b=b[0].per_type("comm_calls"),
        local_a=a[0].per_type("local_comm_bytes"), local_b=b[0].per_type("local_comm_bytes"),
        minimum=minimum_comm(LAYOUTS[pair.layout], pair.b),
        losses={side: (runs[0].loss(0), runs[0].loss(last_step)) for side, runs in ((pair.a, a), (pair.b, b))},
        info=info,
    )


HEADER = ("| pair (A = hybrid vs B) | layout | step time A / B ms | ratio A/B (range over rounds) |"
          " best round A / B ms | ratio | CPU time per step A / B ms | ratio (range) | peak memory A / B MiB | ratio |"
          " communication per step per rank, A / B / minimum | loss step 1, A / B | loss last step, A / B |")


def format_table(results: list[PairResult]) -> str:
    """The Markdown table printed to stdout (and copied into BENCHMARKS.md)."""
    lines = [HEADER, "|" + " --- |" * (HEADER.count("|") - 1)]
    for r in results:
        layout = LAYOUTS[r.pair.layout]
        note = f" ({layout.world} ranks on {os.cpu_count()} cores: oversubscribed)" if layout.oversubscribed else ""
        (a1, an), (b1, bn) = r.losses[r.pair.a], r.losses[r.pair.b]
        lines.append(
            f"| {r.pair.b} | {layout.name}{note} | {r.step_a * 1e3:.0f} / {r.step_b * 1e3:.0f} |"
            f" {r.ratio:.3f} ({r.ratio_range[0]:.3f}–{r.ratio_range[1]:.3f}) |"
            f" {r.best_a * 1e3:.0f} / {r.best_b * 1e3:.0f} | {r.best_a / r.best_b:.3f} |"
            f" {r.cpu_a * 1e3:.0f} / {r.cpu_b * 1e3:.0f} |"
            f" {r.cpu_ratio:.3f} ({r.cpu_ratio_range[0]:.3f}–{r.cpu_ratio_range[1]:.3f}) |"
            f" {r.peak_a / MiB:.2f} / {r.peak_b / MiB:.2f} | {r.peak_a / r.peak_b:.3f} |"
            f" {comm_cell(r.comm_a, r.comm_b, r.minimum, r.calls_a, r.calls_b)} |"
            f" {a1:.5f} / {b1:.5f} | {an:.5f} / {bn:.5f} |"
        )
    return "\n".join(lines)


def format_notes(results: list[PairResult]) -> str:
    """What the table leaves out: collectives on 1-rank groups, the pipeline cuts, losses that disagree."""
    lines = []
    for r in results:
        for step, label in ((0, "step 1"), (1, "the last step")):
            a, b = r.losses[r.pair.a][step], r.losses[r.pair.b][step]
            if abs(a - b) > 1e-3 * abs(b):
                lines.append(f"- {r.pair.name}: WARNING: the losses of {label} differ ({a:.6f} vs {b:.6f}):"
                             " the two sides do not compute the same thing")
        if r.local_a or r.local_b:
            def listed(sizes: dict[str, int]) -> str:
                return ", ".join(f"{kind} {_size(value)}" for kind, value in sizes.items()) or "none"

            lines.append(f"- {r.pair.name}: collectives on 1-rank groups (no data moved): A {listed(r.local_a)};"
                         f" B {listed(r.local_b)}")
        splits = {side: r.info.get(side, {}).get("blocks_per_stage") for side in (r.pair.a, r.pair.b)}
        if all(splits.values()):
            same = splits[r.pair.a] == splits[r.pair.b]
            lines.append(f"- {r.pair.name}: blocks per stage {splits[r.pair.a]} (A), {splits[r.pair.b]} (B)"
                         + ("" if same else " -- WARNING: the two sides cut the model differently"))
    return "\n".join(lines)


def format_python_calls(profile_dir: Path, timed_steps: int) -> str:
    """Python function calls per timed step, per side, layout and rank (first round): deterministic, unlike time on
    a shared machine, and a direct measure of framework overhead in Python."""
    import pstats

    lines = ["| side | layout | Python function calls per step, by rank |", "| --- | --- | --- |"]
    for layout_name in LAYOUTS:
        for side in SIDES:
            files = sorted(profile_dir.glob(f"{side}-{layout_name}-round1-rank*.pstats"))
            if files:
                calls = [pstats.Stats(str(f)).total_calls / timed_steps for f in files]  # type: ignore[attr-defined]
                lines.append(f"| {side} | {layout_name} | {' / '.join(f'{c:,.0f}' for c in calls)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", help=f"comma-separated pair names (see --list); default: {','.join(DEFAULT_PAIRS)}")
    parser.add_argument("--quick", action="store_true", help=f"one round, {QUICK_TIMED_STEPS} timed steps")
    parser.add_argument("--rounds", type=int, help=f"alternating rounds (default {ROUNDS}; --quick: 1)")
    parser.add_argument("--steps", type=int, help=f"timed steps per launch (default {TIMED_STEPS})")
    parser.add_argument("--list", action="store_true", help="print the pair names and exit")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the tensor-parallel plan HybridStrategy applied")
    parser.add_argument("--json", type=Path, help="also write every launch's raw numbers here")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="cProfile each rank's timed steps into DIR and print Python function calls per step"
                             " (the profiler slows Python-heavy sides more: read the step times of such a run as"
                             " distorted)")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "LAYOUT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    timed_steps = args.steps or (QUICK_TIMED_STEPS if args.quick else TIMED_STEPS)
    if args.worker:
        side, layout_name = args.worker
        run_worker(side, LAYOUTS[layout_name], timed_steps, args.out, profile=args.profile is not None)
        return
    if args.list:
        for name, pair in PAIRS.items():
            layout = LAYOUTS[pair.layout]
            print(f"{name:24s} {SIDES[pair.a]} vs {SIDES[pair.b]}, {layout.name} ({layout.world} ranks"
                  + (", oversubscribed" if layout.oversubscribed else "") + ")"
                  + ("" if name in DEFAULT_PAIRS else "  [not in the default set]"))
        return
    names = args.pairs.split(",") if args.pairs else DEFAULT_PAIRS
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"unknown pairs {unknown}; choose from {', '.join(PAIRS)}")
    rounds = args.rounds or (1 if args.quick else ROUNDS)
    if timed_steps < 5:
        parser.error("at least 5 timed steps")
    pairs = [PAIRS[n] for n in names]
    counts = parameter_counts()
    command = "python benchmarks/compare.py " + " ".join(sys.argv[1:])
    revision = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO_ROOT, capture_output=True,
                              text=True).stdout.strip()
    print(f"lightning_hybrid at {revision or 'unknown revision'}; "
          f"GPT {asdict(CONFIG)}: {counts['total']:,} parameters ({counts['blocks']:,} in blocks); fp32, AdamW; global"
          f" batch {GLOBAL_BATCH} x {CONFIG.block_size} tokens; {WARMUP_STEPS} warm-up + {timed_steps} timed steps;"
          f" {rounds} round(s); pp: 1F1B, {MICROBATCHES} microbatches; torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    launches = run_rounds(pairs, rounds, timed_steps, args.profile)
    results = [summarize(pair, launches[pair.name]) for pair in pairs]
    print(f"\nCommand: {command.strip()}   ({time.perf_counter() - start:.0f} s)\n")
    print(format_table(results))
    notes = format_notes(results)
    if notes:
        print("\n" + notes)
    if args.verbose:
        for r in results:
            plan = r.info.get("hybrid", {}).get("tp_plan_applied")
            if plan:
                print(f"- {r.pair.name}: HybridStrategy tp_plan_applied = {plan}")
    if args.profile:
        print("\n" + format_python_calls(args.profile, timed_steps))
    if args.json:
        args.json.write_text(json.dumps({name: [[asdict(a), asdict(b)] for a, b in rounds]
                                         for name, rounds in launches.items()}, indent=1))


if __name__ == "__main__":
    main()
