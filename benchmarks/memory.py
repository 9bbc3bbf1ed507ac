"""Per-rank memory of HybridStrategy layouts: model states (parameters + gradients + AdamW state) and peak
activations of one training step, each printed next to what theory says it should be.

Model: ``recipes/gpt.py``'s GPT with :data:`CONFIG` (4 blocks, width 128, 4 heads, vocabulary 64, sequence 64:
817,920 parameters), fp32 (``precision="32-true"``), AdamW, a global batch of :data:`GLOBAL_BATCH` sequences of
random tokens, :data:`STEPS` training steps. One launch per layout, one process per rank (gloo, CPU, started by
``benchmarks/harness.py``); every rank writes its numbers to JSON and the parent prints the table.

Model states (measured on step 2, in ``on_before_optimizer_step``)
    Lightning's automatic optimization runs ``optimizer.step(closure)``; the closure does forward, zero_grad and
    backward, then ``on_before_optimizer_step`` fires, then AdamW updates. On step 1 AdamW has no state yet (it is
    created lazily by the first update); on step 2, at that hook, the parameters, this step's gradients and the
    moments created by step 1 all exist at once: the peak of model-state memory, and the point measured here.
    Measured: the bytes of the distinct storages behind every parameter's local tensor (``DTensor.to_local()``:
    FSDP2's sharded parameter, a tensor-parallel shard), its ``.grad`` and every tensor of ``optimizer.state``.
    Counting storages, not ``numel``, includes what the tensors really occupy: FSDP2 pads dim 0 of each shard to
    ``ceil(rows / dp)`` and keeps a rank's gradients as views into one reduce-scatter buffer per FSDP unit.
    Ideal: ``16 B × P_stage / (dp × tp)`` -- 4 B parameter + 4 B gradient + 8 B for AdamW's two moments per
    parameter, with ``P_stage`` the parameters of the pipeline stage(s) this rank runs (the whole model when
    pp = 1). AdamW's ``step`` counter (one fp32 scalar per parameter tensor) is measured and counted, not in the
    ideal. What cannot shard over tp: the position embedding and the final norm (the token embedding and
    the LM head are sharded over the vocabulary unless ``shard_vocab=False``, the ``*-whole-vocab`` layouts), and
    inside a block the LayerNorms, the fused qkv bias and the row-parallel layers' biases; they are only sharded
    over dp.

Activations (measured on step 2, forward + backward)
    ``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode) follows every storage an operation
    creates, by weak reference, until it is freed, and files it by when it was created: ACT (forward, and
    activation-checkpointing recompute during backward), TEMP (backward: gradients of activations and
    parameters), OPT, PARAM, ... It works on CPU and sees through DTensor to the local tensors. Reported: the
    peak of the ACT bytes alive at once. :class:`ActivationTracker` adapts it in four ways, each explained there:
    recompute is recognized by grad mode (not module hooks), module-wise bookkeeping is off (pipelines call a
    stage once per microbatch), the optimizer-step hook is off (Lightning runs forward *inside*
    ``optimizer.step``), and FSDP2's gathered parameters are filed as parameters. The step's batch (token ids and
    targets) is input data and not counted; the pipeline's receive buffers are (see below). Reported beside it
    ("gathered params"): the peak of what FSDP2 allocates to gather parameters for compute (gathered
    parameters and all-gather buffers) -- neither model state nor activation, and where ZeRO-2 and ZeRO-3 differ.

Analytic activations (fp32, E = 4 bytes; b = sequences per microbatch on this rank = global batch / dp / m, with
m = 1 microbatch without pipelining; T, C, H, V = sequence, width, heads, vocabulary; x = bTC·E, one
residual-stream tensor; tp = tensor-parallel degree, r = 1 if tp > 1 else 0)
    What autograd saves per block, checked op by op with ``saved_tensors_hooks`` (the CPU SDPA kernel is
    ``_scaled_dot_product_flash_attention_for_cpu``; its output is laid out so the reshape before attn.c_proj is a
    view)::

        ln_1: input x (bTC), mean + rstd (2bT)      c_attn: ln_1 output (bTC)
        SDPA: q, k, v = views of the qkv output (3bTC/tp), output (bTC/tp), logsumexp (bHT/tp)
        attn.c_proj: SDPA output (same storage)     ln_2: input x1 = x + attn(...) (bTC), mean + rstd (2bT)
        c_fc: ln_2 output (bTC)                     GELU: c_fc output (4bTC/tp)     mlp.c_proj: GELU output (4bTC/tp)

        S = E·bT·[(4 + 12/tp)·C + 4 + H/tp]                                  (16 bTC + 4bT + bHT for tp = 1)

    Tensor parallelism shards the qkv, attention and MLP intermediates; LayerNorm inputs/outputs and the
    residual stream stay whole on every tp rank. Outside the blocks: position ids (T int64, first stage);
    ln_f input and output (2x) + stats (2bT·E) and the log-softmax output of the loss (bTV·E) on the last stage.
    What a block keeps from its forward to its backward (``kept``), and its fullest moments (``fwd``, ``bwd``):

        no checkpointing   kept = S
        "every", N         kept = x (its input); during its backward the recompute rebuilds S (and stops there:
                           torch.utils.checkpoint's early stop, so mlp.c_proj is not re-run); during its forward
                           at most max(3 + 8/tp, 4 + 4/tp + r)·x (input, x1, ln_2 output, MLP intermediates)
        "selective"        kept = x + cached outputs of c_attn, SDPA, attn.c_proj, c_fc, mlp.c_proj and the r
                           all-reduces: x·[1 + (3 + 1 + 4)/tp + 2 + 2r] + bHT·E/tp; backward: S + (1 + r)·x (the
                           cached mlp.c_proj output and its all-reduce are never consumed, recompute stops
                           before them); forward: kept + (2 + 4/tp)·x

    Per rank, with k microbatches in flight (1 without pipelining; 1F1B: min(m, pp − s) on stage s; GPipe: m)::

        held     = Σ_blocks kept_i + position ids + ln_f/loss terms + stage output (x, pipeline, non-last stage)
        forward  = max( k·held + transient,                        transient: logits bTV·E on the last stage
                        (k−1)·held + Σ_{i<j} kept_i + fwd_j )        (alive while the loss runs), else the MLP
        backward = (k−1)·held + max_j [Σ_{i<j} kept_i + bwd_j + stage output]     output during the last add
        peak     = buffers + max(forward, backward)                j over checkpointed blocks

    Pipelining: a non-last stage keeps its output x per microbatch until that microbatch's backward;
    ``torch.distributed.pipelining`` allocates receive buffers once per microbatch and keeps them (``buffers``:
    m·x for activations on stages s > 0, m·x for gradients on stages s < pp − 1); the first block's input on
    s > 0 is that buffer (not counted twice). Backward frees, so without checkpointing the peak is the end of a
    forward. The transient terms and the selective leftover were found by listing the storages alive at the
    measured peak and are explained above; everything else follows from the saved tensors.

Usage::

    python benchmarks/memory.py                          # every layout, the Markdown table
    python benchmarks/memory.py --quick                  # five layouts
    python benchmarks/memory.py --layouts dp2-z3,tp2,pp2 --json results.json
    python benchmarks/memory.py --list                   # layout names
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import launch_ranks, markdown_table, save_rank_result  # noqa: E402
from recipes.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, block_size=64, n_layer=4, n_head=4, n_embd=128)
GLOBAL_BATCH = 16  # sequences per optimizer step over all data-parallel ranks
STEPS = 2
MEASURE_STEP = 1  # 0-based: the second step (AdamW state exists, pipeline shape inference is over)
FP32 = 4
MiB = 2**20


# ============================================================================================= layouts
@dataclass(frozen=True)
class Layout:
    """One row group of the table: a launch of ``world`` processes.

    ``strategy`` holds ``HybridStrategy`` keyword arguments; ``None`` means plain Lightning on one process
    (no strategy, no FSDP). ``plain_checkpointing`` checkpoints every block of the plain run with this script's
    own :func:`checkpoint_blocks` (needs no strategy support).
    """

    name: str
    world: int
    strategy: Optional[dict[str, Any]] = None
    plain_checkpointing: bool = False

    @property
    def degrees(self) -> dict[str, int]:
        s = self.strategy or {}
        tp, pp = s.get("tp", 1), s.get("pp", 1)
        return {"dp": self.world // (tp * pp), "tp": tp, "pp": pp}

    @property
    def checkpointing(self) -> Union[None, str, int]:
        if self.plain_checkpointing:
            return "every"
        return (self.strategy or {}).get("activation_checkpointing")


LAYOUTS = [
    Layout("single", 1),
    Layout("single-ac", 1, plain_checkpointing=True),
    Layout("dp1", 1, {"dp": 1}),
    Layout("dp2-z3", 2, {"dp": 2, "zero": 3}),
    Layout("dp2-z2", 2, {"dp": 2, "zero": 2}),
    Layout("dp4", 4, {"dp": 4}),
    Layout("tp2", 2, {"tp": 2}),
    Layout("dp2-tp2", 4, {"dp": 2, "tp": 2}),
    Layout("pp2", 2, {"pp": 2, "pp_schedule": "1f1b"}),
    Layout("pp2-gpipe-m4", 2, {"pp": 2, "pp_schedule": "gpipe", "microbatches": 4}),
    Layout("tp2-pp2", 4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b"}),
    # Before vocabulary sharding: the token embedding and head whole on every tp rank.
    Layout("tp2-whole-vocab", 2, {"tp": 2, "shard_vocab": False}),
    Layout("tp2-pp2-whole-vocab", 4, {"tp": 2, "pp": 2, "pp_schedule": "1f1b", "shard_vocab": False}),
    Layout("dp1-ac", 1, {"dp": 1, "activation_checkpointing": "every"}),
    Layout("dp1-ac2", 1, {"dp": 1, "activation_checkpointing": 2}),
    Layout("dp1-sac", 1, {"dp": 1, "activation_checkpointing": "selective"}),
    Layout("dp2-z3-ac", 2, {"dp": 2, "zero": 3, "activation_checkpointing": "every"}),
    Layout("tp2-ac", 2, {"tp": 2, "activation_checkpointing": "every"}),
    Layout("tp2-sac", 2, {"tp": 2, "activation_checkpointing": "selective"}),
    Layout("pp2-ac", 2, {"pp": 2, "pp_schedule": "1f1b", "activation_checkpointing": "every"}),
]
QUICK = ["single", "single-ac", "dp2-z3", "tp2", "pp2"]
BY_NAME = {layout.name: layout for layout in LAYOUTS}


def strategy_supports(option: str) -> bool:
    from lightning_hybrid import HybridStrategy

    return option in inspect.signature(HybridStrategy.__init__).parameters


# ====================================================================================== measurement
class EngineOnly:
    """Stands in for MemTracker's ``ModTracker``: only "is autograd's engine running?" is kept (see
    :class:`ActivationTracker`)."""

    parents = {"Global"}

    @property
    def is_bw(self) -> bool:
        return torch._C._current_graph_task_id() != -1

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: nn.Module) -> None:
        return None

    def __enter__(self) -> "EngineOnly":
        return self

    def __exit__(self, *args: Any) -> None:
        pass


class ActivationTracker(MemTracker):
    """``MemTracker`` reduced to what a training step inside Lightning needs: the peak of activation bytes.

    Differences from ``MemTracker`` and why:

    * Recompute under activation checkpointing counts as activation memory. MemTracker recognizes it by a module
      forward hook firing during backward, which misses operations between child modules (the residual adds of a
      block whose ``forward`` is re-run directly, as ``torch.utils.checkpoint`` does). Here: an operation during
      backward with grad mode *on* is recompute (the engine runs backward functions with grad mode off; the
      checkpoint recompute turns it on).
    * No module-wise statistics: MemTracker refuses a root module called twice per iteration, which a pipeline
      stage is (once per microbatch), and its module hooks are not needed for the number reported here.
    * No optimizer hook: MemTracker files everything between the optimizer's pre- and post-step hooks as optimizer
      state, but Lightning runs forward and backward inside ``optimizer.step(closure)``.
    * What FSDP2 allocates or writes while it gathers parameters (all-gather buffers, the gathered parameters; with
      one data-parallel rank a plain copy) is parameter memory, not activations: FSDP2's ``unshard`` and
      ``wait_for_unshard`` are wrapped while tracking, everything they touch is filed as a parameter, and no
      activation peak is recorded inside them. The peak of those bytes is kept too (``peak_gathered``): it is
      what ZeRO-3 and ZeRO-2 differ in.

    Usage::

        tracker = ActivationTracker()
        tracker.track_external(module, optimizer)                 # existing storages: not activations
        tracker.track_as(ACT, pipeline_receive_buffers)          # existing storages that are
        with tracker:
            loss = module(batch); loss.backward()
        tracker.peak_act, tracker.peak_in_backward, tracker.peak_gathered
    """

    ACT, OTHER, PARAM = _MemRefType.ACT, _MemRefType.OTH, _MemRefType.PARAM

    def __init__(self) -> None:
        super().__init__()
        self._mod_tracker = EngineOnly()  # type: ignore[assignment]
        self.peak_act = 0
        self.peak_in_backward = False
        #: Peak of parameter bytes above those at entry: FSDP2's gathered parameters and all-gather buffers.
        self.peak_gathered = 0
        self._params_at_entry = 0
        self._gathering = 0  # > 0 inside FSDP2's unshard / wait_for_unshard
        self._unpatch: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "ActivationTracker":
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for name in ("unshard", "wait_for_unshard"):
            original = getattr(FSDPParamGroup, name)
            self._unpatch.append((FSDPParamGroup, name, original))
            setattr(FSDPParamGroup, name, self._gathering_parameters(original))
        self._params_at_entry, self.peak_gathered = self.current(self.PARAM), 0
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        super().__exit__(*args)
        for owner, name, original in reversed(self._unpatch):
            setattr(owner, name, original)
        self._unpatch.clear()

    def _gathering_parameters(self, method: Any) -> Any:
        @functools.wraps(method)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._gathering += 1
            try:
                return method(*args, **kwargs)
            finally:
                self._gathering -= 1
                self._record_peak()

        return wrapper

    def track_as(self, reftype: _MemRefType, tensors: Iterable[Any]) -> None:
        """File the storages of already existing ``tensors`` (any nesting) under ``reftype``."""
        for value in tree_flatten(list(tensors))[0]:
            if isinstance(value, Tensor) and value.device.type != "meta":
                self._update_and_maybe_create_winfos(value, reftype)
        self._record_peak()

    def current(self, reftype: _MemRefType) -> int:
        """Bytes of ``reftype`` alive now (meta tensors, e.g. a pipeline's shape-only stand-ins, hold no memory)."""
        return sum(snap.get(reftype, 0) for device, snap in self._curr_mem_snap.items() if device.type != "meta")

    def current_act(self) -> int:
        return self.current(self.ACT)

    def _record_peak(self) -> None:
        self.peak_gathered = max(self.peak_gathered, self.current(self.PARAM) - self._params_at_entry)
        if self._gathering:
            return  # mid-way through FSDP's gathering, buffers are not filed as parameters yet
        act = self.current_act()
        if act > self.peak_act:
            self.peak_act = act
            self.peak_in_backward = self._mod_tracker.is_bw

    def _register_global_optimizer_hook(self) -> None:
        pass

    def _update_peak_stats(self, peak_state: Any) -> None:
        pass  # the activation peak is recorded after FSDP buffers are refiled (below)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self._in_ac = self._mod_tracker.is_bw and torch.is_grad_enabled()
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if result is NotImplemented:
            return result
        if self._gathering:
            for value in tree_flatten((result, args, kwargs))[0]:
                if isinstance(value, Tensor):
                    self._update_and_maybe_create_winfos(value, self.PARAM)
        self._record_peak()
        return result


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def model_state_bytes(module: nn.Module, optimizers: Iterable[torch.optim.Optimizer]) -> dict[str, int]:
    """Bytes this process holds for parameters, gradients and optimizer state, by distinct storage.

    Returns ``params``, ``grads``, ``optimizer_moments`` (every optimizer-state tensor with more than one element:
    AdamW's ``exp_avg`` and ``exp_avg_sq``), ``optimizer_scalars`` (one-element state: AdamW's ``step``),
    ``params_owned`` (elements of the local parameter tensors, padding excluded) and ``param_tensors``.
    """
    seen: set[int] = set()

    def storage_bytes(tensor: Optional[Tensor]) -> int:
        if tensor is None:
            return 0
        local = _local(tensor)
        if local.device.type == "meta":
            return 0
        storage = local.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()

    parameters = [p for p in module.parameters()]
    result = {
        "params": sum(storage_bytes(p) for p in parameters),
        "grads": sum(storage_bytes(p.grad) for p in parameters),
        "optimizer_moments": 0,
        "optimizer_scalars": 0,
        "params_owned": sum(_local(p).numel() for p in parameters),
        "param_tensors": len(parameters),
    }
    for optimizer in optimizers:
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    key = "optimizer_moments" if value.numel() > 1 else "optimizer_scalars"
                    result[key] += storage_bytes(value)
    result["total"] = result["params"] + result["grads"] + result["optimizer_moments"] + result["optimizer_scalars"]
    return result


def global_parameter_count(module: nn.Module) -> int:
    """Elements of the parameters this process runs, counted unsharded (a DTensor's global size): the whole model,
    or with pp > 1 this rank's stages."""
    return sum(p.numel() for p in module.parameters())


def tensor_replicated_count(module: nn.Module) -> int:
    """Local parameter elements that are not sharded over the tensor-parallel mesh dimension ``"tp"``."""
    count = 0
    for p in module.parameters():
        names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
        if "tp" not in names or p.placements[names.index("tp")].is_replicate():
            count += _local(p).numel()
    return count


def checkpoint_blocks(blocks: nn.ModuleList, every: int = 1) -> list[int]:
    """Activation checkpointing for the plain (strategy-free) layouts and the unit test, with the strategy's own
    per-block checkpointing. Returns the indices of the checkpointed blocks."""
    from lightning_hybrid.options.recompute import CheckpointPlan
    from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing

    plan = CheckpointPlan(every=every)
    apply_activation_checkpointing(enumerate(blocks), plan)
    return [i for i in range(len(blocks)) if plan.covers(i)]


# ========================================================================================= analytic
@dataclass
class StageShape:
    """What the analytic activation size depends on, for one rank.

    ``blocks``: global indices of the blocks this rank runs; ``checkpointed``: those checkpointed;
    ``selective``: per-op (selective) checkpointing; ``batch``: sequences per microbatch on this rank;
    ``in_flight``: microbatches whose activations coexist at the forward peak; ``microbatches``: m (receive
    buffers); ``first``/``last``: stage holds the embeddings / the head and loss; ``pp``.
    """

    blocks: list[int]
    checkpointed: list[int] = field(default_factory=list)
    selective: bool = False
    batch: int = 1
    tp: int = 1
    in_flight: int = 1
    microbatches: int = 1
    first: bool = True
    last: bool = True


def analytic_activation_bytes(config: GPTConfig, shape: StageShape) -> dict[str, int]:
    """Peak activation bytes of one training step on one rank (formula in the module docstring).

    Returns the peak (``total``) and its parts: ``per_microbatch`` (held at the end of one microbatch's forward),
    ``forward_peak``, ``backward_peak`` (0 without checkpointing: backward only frees) and ``buffers`` (pipeline
    receive buffers).
    """
    b, T, C, H, V, tp = shape.batch, config.block_size, config.n_embd, config.n_head, config.vocab_size, shape.tp
    bT = b * T
    x = bT * C * FP32  # one residual-stream tensor, bTC
    reduced = 1 if tp > 1 else 0  # row-parallel outputs are all-reduced (a new bTC tensor each) when tp > 1
    # S_block: everything autograd saves in a block, its input included.
    full = bT * ((4 + 12 / tp) * C + 4 + H / tp) * FP32
    # Selective checkpointing keeps the input and caches the outputs of qkv, attention (output + logsumexp),
    # attn.c_proj, c_fc, mlp.c_proj and of the all-reduces after the two row-parallel layers.
    selective = x + bT * (3 * C / tp + C / tp + H / tp + C + 4 * C / tp + C) * FP32 + 2 * reduced * x
    checkpointed = set(shape.checkpointed)

    def input_is_buffer(i: int) -> float:
        # On stages after the first, the first block's input is the receive buffer, counted in `buffers`.
        return x if (i == shape.blocks[0] and not shape.first) else 0

    def kept(i: int) -> float:
        """What block i keeps from its forward until its backward."""
        own = (selective if shape.selective else x) if i in checkpointed else full
        return own - input_is_buffer(i)

    def inside_forward(i: int) -> float:
        """Checkpointed block i at its forward's fullest: its input (or selective cache), the residual x1, the ln_2
        output and the MLP's intermediate(s) -- at the GELU, or at mlp.c_proj and its all-reduce."""
        if shape.selective:
            own = selective + (2 + 4 / tp) * x
        else:
            own = max(3 + 8 / tp, 4 + 4 / tp + reduced) * x
        return own - input_is_buffer(i)

    def recompute(i: int) -> float:
        """Checkpointed block i during its backward: all it saves (S_block) exists again. Selective: the cached
        output of the last matmul (mlp.c_proj, and its all-reduce) stays too -- the recompute stops as soon as
        backward has every saved tensor (torch.utils.checkpoint's early stop), i.e. before mlp.c_proj would
        consume that cache entry."""
        return full + (1 + reduced) * x * shape.selective - input_is_buffer(i)

    position_ids = T * 8 if shape.first else 0
    head = (2 * x + 2 * bT * FP32 + bT * V * FP32) if shape.last else 0  # ln_f in/out + stats, log-softmax output
    stage_output = x if not shape.last else 0  # kept by the pipeline for the microbatch's backward
    # Alive only for a moment at the end of a forward: the logits while the loss is computed (last stage), else the
    # MLP output while the stage's last residual add runs.
    transient = bT * V * FP32 if shape.last else x
    held = sum(kept(i) for i in shape.blocks) + position_ids + head + stage_output
    older = (shape.in_flight - 1) * held  # the other microbatches in flight
    forward_peak = shape.in_flight * held + transient
    backward_peak = 0.0
    for j in sorted(checkpointed & set(shape.blocks)):
        earlier = sum(kept(i) for i in shape.blocks if i < j) + position_ids
        forward_peak = max(forward_peak, older + earlier + inside_forward(j))
        backward_peak = max(backward_peak, older + earlier + recompute(j) + stage_output)
    buffers = shape.microbatches * x * ((not shape.first) + (not shape.last))
    return {
        "total": int(buffers + max(forward_peak, backward_peak)),
        "per_microbatch": int(held),
        "forward_peak": int(forward_peak),
        "backward_peak": int(backward_peak),
        "buffers": int(buffers),
    }


def checkpointed_blocks(mode: Union[None, str, int], blocks: Iterable[int]) -> tuple[list[int], bool]:
    """Blocks checkpointed under ``HybridStrategy(activation_checkpointing=mode)`` (the N-th, 2N-th, ... block of
    the whole model for an integer N) and whether it is selective."""
    if mode is None:
        return [], False
    every = 1 if mode in ("every", "selective") else int(mode)
    return [i for i in blocks if (i + 1) % every == 0], mode == "selective"


# ==================================================================================== one rank's run
def _pipeline_buffers(strategy: Any) -> list[Tensor]:
    """The receive buffers ``torch.distributed.pipelining`` keeps per stage and microbatch (private attributes:
    benchmark-only)."""
    pipeline = getattr(strategy, "pipeline", None)
    if pipeline is None:
        return []
    buffers = []
    for schedule, _ in pipeline._schedules.values():  # (torch schedule, its stage buffers)
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        for stage in stages:
            for infos in (*stage.args_recv_info.values(), *stage.grad_recv_info.values()):
                buffers += [info.buffer for info in infos if getattr(info, "buffer", None) is not None]
    return buffers


def make_probe(on_result: Any) -> Any:
    """A Lightning callback that measures step :data:`MEASURE_STEP` and hands a dict to ``on_result``."""
    import lightning.pytorch as pl

    class MemoryProbe(pl.Callback):
        def __init__(self) -> None:
            self.tracker: Optional[ActivationTracker] = None
            self.batch_idx = -1

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
            self.batch_idx = batch_idx
            if batch_idx != MEASURE_STEP:
                return
            tracker = ActivationTracker()
            tracker.track_external(pl_module, *trainer.optimizers)
            tracker.track_as(ActivationTracker.OTHER, [batch])  # input data, not activations
            tracker.track_as(ActivationTracker.ACT, _pipeline_buffers(trainer.strategy))
            self.buffers = tracker.current_act()
            self.tracker = tracker.__enter__()

        def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
            if self.batch_idx != MEASURE_STEP or self.tracker is None:
                return
            # Forward and backward are over; the optimizer has not stepped. Parameters, this step's gradients and
            # the AdamW moments of step 1 exist together here (the model-state peak; see the module docstring).
            self.tracker.__exit__(None, None, None)
            on_result({
                "activation_peak": self.tracker.peak_act,
                "activation_peak_in_backward": self.tracker.peak_in_backward,
                "gathered_peak": self.tracker.peak_gathered,
                "pipeline_buffers": self.buffers,
                "model_states": model_state_bytes(pl_module, trainer.optimizers),
                "stage_params": global_parameter_count(pl_module),
                "tp_replicated_params": tensor_replicated_count(pl_module),
            })
            self.tracker = None

    return MemoryProbe()


def fit_and_measure(layout: Layout) -> dict[str, Any]:
    """Train :data:`STEPS` steps of the GPT under ``layout`` in this process (one rank of it) and return this rank's
    measurements, its stage shape and the analytic activation size. A plain layout (``strategy=None``) runs in
    the calling process without starting a process group (what the unit test uses)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice about workers, logging intervals, ... on tiny runs
        return _fit_and_measure(layout)


def _fit_and_measure(layout: Layout) -> dict[str, Any]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from recipes.gpt import GPTLightning

    torch.manual_seed(0)  # the same model and tokens on every rank
    module = GPTLightning(CONFIG, warmup_steps=1, max_steps=STEPS)
    plain_checkpointed = checkpoint_blocks(module.model.blocks) if layout.plain_checkpointing else []
    if layout.strategy is None:
        strategy: Any = "auto"
    else:
        from lightning_hybrid import HybridStrategy

        strategy = HybridStrategy(**layout.strategy)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * STEPS, CONFIG.block_size + 1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    results: list[dict[str, Any]] = []
    trainer = pl.Trainer(
        accelerator="cpu", devices=layout.world, strategy=strategy, precision="32-true", max_steps=STEPS,
        logger=False, enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False,
        limit_val_batches=0, num_sanity_val_steps=0, callbacks=[make_probe(results.append)],
    )
    # Per data-parallel rank; Lightning's distributed sampler deals the dataset out over the dp ranks.
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // layout.degrees["dp"]))
    (result,) = results
    result.update(_shape_of_rank(layout, trainer, plain_checkpointed))
    result["rank"] = trainer.global_rank
    return result


def run_rank(layout: Layout, out: Path) -> None:
    """One rank of a launch: measure, save this rank's result, close the process group."""
    import torch.distributed as dist

    save_rank_result(out, fit_and_measure(layout))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo crashes at interpreter exit otherwise


def _shape_of_rank(layout: Layout, trainer: Any, plain_checkpointed: list[int]) -> dict[str, Any]:
    """This rank's stage, blocks and microbatching, and the analytic activation size for them."""
    degrees = layout.degrees
    strategy = trainer.strategy
    pipeline = getattr(strategy, "pipeline", None)
    blocks = list(range(CONFIG.n_layer))
    in_flight, microbatches, first, last, stage = 1, 1, True, True, 0
    if pipeline is not None:
        (stage,) = pipeline.stage_ids  # one stage per rank in the layouts here (1F1B, GPipe)
        blocks = list(pipeline.split.block_range(stage))
        schedule = strategy.pp_schedule
        microbatches = schedule.microbatches
        first, last = stage == 0, stage == schedule.num_stages - 1
        in_flight = microbatches if schedule.name == "gpipe" else min(microbatches, degrees["pp"] - stage)
    mode = layout.checkpointing
    checkpointed, selective = checkpointed_blocks(mode, blocks)
    if layout.plain_checkpointing:
        checkpointed = plain_checkpointed
    actual = _actually_checkpointed(trainer.lightning_module, blocks, plain_checkpointed)
    shape = StageShape(
        blocks=blocks, checkpointed=checkpointed, selective=selective,
        batch=GLOBAL_BATCH // degrees["dp"] // microbatches, tp=degrees["tp"], in_flight=in_flight,
        microbatches=microbatches, first=first, last=last,
    )
    return {
        "stage": stage, "shape": asdict(shape), "checkpointed_in_model": actual,
        "analytic": analytic_activation_bytes(CONFIG, shape),
    }


def _actually_checkpointed(module: Any, blocks: list[int], plain: list[int]) -> list[int]:
    """Blocks whose class the strategy swapped for a checkpointed one (cross-check of the analytic's choice)."""
    if plain:
        return plain
    found = []
    for i in blocks:
        with contextlib.suppress(AttributeError):
            block = module.model.blocks[i]
            if "Checkpointed" in type(block).__name__:
                found.append(i)
    return found


def launch(layout: Layout) -> list[dict[str, Any]]:
    """Every rank's results of one launch of ``layout``, by rank."""
    return launch_ranks(Path(__file__), ["--worker", layout.name], world=layout.world).ranks


# =============================================================================================== table
def ideal_model_state_bytes(stage_params: int, dp: int, tp: int) -> float:
    """16 B per parameter (fp32 parameter, gradient, two AdamW moments), sharded over dp × tp."""
    return 16 * stage_params / (dp * tp)


def table_rows(layout: Layout, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    degrees = layout.degrees
    for r in results:
        states = r["model_states"]
        ideal = ideal_model_state_bytes(r["stage_params"], degrees["dp"], degrees["tp"])
        analytic = r["analytic"]["total"]
        rows.append({
            "layout": layout.name, "rank": r["rank"], "stage": r["stage"] if degrees["pp"] > 1 else "-",
            "stage_params": r["stage_params"], "params_owned": states["params_owned"],
            "states_mib": states["total"] / MiB, "ideal_mib": ideal / MiB, "states_ratio": states["total"] / ideal,
            "act_mib": r["activation_peak"] / MiB, "analytic_mib": analytic / MiB,
            "act_ratio": r["activation_peak"] / analytic if analytic else float("nan"),
            "act_phase": "bwd" if r["activation_peak_in_backward"] else "fwd",
            "gathered_mib": r["gathered_peak"] / MiB,
            "tp_replicated": r["tp_replicated_params"] if degrees["tp"] > 1 else 0,
            "padding_bytes": states["params"] - FP32 * states["params_owned"],
            "beyond_16B_owned": states["total"] - 16 * states["params_owned"],
            "raw": r,
        })
        if sorted(r["shape"]["checkpointed"]) != sorted(r["checkpointed_in_model"]):
            print(f"  note: {layout.name} rank {r['rank']}: the analytic assumes blocks {r['shape']['checkpointed']}"
                  f" checkpointed, the model has {r['checkpointed_in_model']}", file=sys.stderr)
    return rows


HEADER = ["layout", "rank", "stage", "params (stage)", "params owned", "model states MiB", "ideal MiB", "ratio",
          "beyond 16 B × owned", "activations MiB", "analytic MiB", "ratio", "peak in", "gathered params MiB"]


def format_table(rows: list[dict[str, Any]], skipped: dict[str, str]) -> str:
    cells = [[row["layout"], row["rank"], row["stage"], f"{row['stage_params']:,}", f"{row['params_owned']:,}",
              f"{row['states_mib']:.3f}", f"{row['ideal_mib']:.3f}", f"{row['states_ratio']:.3f}",
              f"{row['beyond_16B_owned']:,} B", f"{row['act_mib']:.2f}", f"{row['analytic_mib']:.2f}",
              f"{row['act_ratio']:.3f}", row["act_phase"], f"{row['gathered_mib']:.2f}"] for row in rows]
    cells += [[name, *["-"] * (len(HEADER) - 2), f"skipped: {reason}"] for name, reason in skipped.items()]
    return markdown_table(HEADER, cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", help="comma-separated layout names (see --list); default: all")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--list", action="store_true", help="print the layout names and exit")
    parser.add_argument("--json", type=Path, help="also write every rank's raw numbers here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # a rank of a launch (benchmarks/harness.py)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(BY_NAME[args.worker], args.out)
        return
    if args.list:
        for layout in LAYOUTS:
            print(f"{layout.name:14s} world={layout.world} {layout.strategy or 'plain Lightning'}"
                  + (" + checkpoint every block" if layout.plain_checkpointing else ""))
        return
    names = args.layouts.split(",") if args.layouts else QUICK if args.quick else [l.name for l in LAYOUTS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown layouts {unknown}; choose from {', '.join(BY_NAME)}")
    from recipes.gpt import GPT

    total = sum(p.numel() for p in GPT(CONFIG).parameters())
    print(f"GPT {asdict(CONFIG)}: {total:,} parameters; fp32, AdamW; global batch {GLOBAL_BATCH} x {CONFIG.block_size}"
          f" tokens; measured on step {MEASURE_STEP + 1} of {STEPS}", flush=True)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in names:
        layout = BY_NAME[name]
        if layout.checkpointing is not None and layout.strategy is not None and not strategy_supports(
                "activation_checkpointing"):
            skipped[name] = "HybridStrategy has no activation_checkpointing option yet"
            continue
        start = time.perf_counter()
        layout_rows = table_rows(layout, launch(layout))
        rows += layout_rows
        print(f"  {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    print(format_table(rows, skipped))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
