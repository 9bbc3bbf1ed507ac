"""``HybridStrategy(tp="auto", pp="auto")``: choose the layout at setup with :mod:`lightning_hybrid.planning`'s cost
model, applied to the live module, its first batch and the hardware the job runs on.

Read from the run, not from names:

* the model's sizes: parameter counts per block and outside the blocks (:meth:`ModelShape.measure`);
* heads, key/value heads and sequence length: from the attention the first block computes on the first batch
  (``scaled_dot_product_attention``'s query and key, or a softmax over sequence × sequence scores);
* which tensor-parallel degrees the blocks allow: the tensor-parallel planner's own checks for each candidate
  degree — by structure (:func:`~lightning_hybrid.tensor_parallel.plan_block`) and, with ``verify_tp_plan``, the
  numeric plan check the strategy runs at setup, on a temporary mesh of that degree (a block that derives its head
  size from the input width, as nanoGPT's does, passes the first and fails the second);
* the hardware (:func:`detect_cluster`): a GPU by its name from :data:`~lightning_hybrid.planning.GPU_PRESETS`
  (memory from the device); a CPU by a short probe (matmul FLOP/s per process with every process busy, all-reduce
  latency and bandwidth over the job; no overlap of communication with compute). ``HybridStrategy(cluster=Cluster(...))`` replaces the detection.

Every layout the user's fixed options leave open is estimated with the DataLoader's batch per data-parallel rank
(so the global batch grows with dp, as anywhere in Lightning) and the feasible one with the most tokens per second
wins (:func:`choose_layout`).

Example::

    Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))   # logs the choice
    HybridStrategy(tp=2, pp="auto", cluster=Cluster.preset("h100-sxm", nodes=4))            # given hardware
"""

from __future__ import annotations

import copy
import math
import os
import re
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.fabric.utilities.throughput import get_available_flops
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from lightning_hybrid.dataflow import trace_block
from lightning_hybrid.parallelize import block_tp_overrides, plan_tensor_parallel
from lightning_hybrid.mesh import Degree
from lightning_hybrid.planning import (
    GIB,
    GPU_PRESETS,
    PLANNED_SCHEDULES,
    Cluster,
    Estimate,
    Layout,
    ModelShape,
    divisors,
    estimate,
)
from lightning_hybrid.tensor_parallel import PlanEntry, plan_block

AUTO = "auto"


# ------------------------------------------------------------------------------------------------ the request
@dataclass(frozen=True)
class LayoutRequest:
    """What ``HybridStrategy`` was given: degrees (``"auto"`` where the planner chooses) and the options the layouts
    are estimated with. ``activation_checkpointing`` is the planner's ``None`` or ``"every"``."""

    dp: Degree = AUTO
    tp: Degree = AUTO
    pp: Degree = AUTO
    dp_replicate: int = 1
    zero: int = 3
    activation_checkpointing: Optional[str] = None
    pp_schedule: str = "1f1b"
    microbatches: Optional[int] = None
    virtual_stages: Optional[int] = None

    def __post_init__(self) -> None:
        if self.pp == AUTO and self.pp_schedule not in PLANNED_SCHEDULES:
            raise ValueError(
                f"HybridStrategy(pp='auto', pp_schedule={self.pp_schedule!r}): the planner models the schedules"
                f" {', '.join(PLANNED_SCHEDULES)}. Choose one of them, or pass pp=N for {self.pp_schedule!r}."
            )

    def layouts(self, world: int, accumulation: int = 1) -> list[Layout]:
        """Every layout of ``world`` devices with the fixed degrees; ``accumulation`` is the Trainer's
        ``accumulate_grad_batches`` (the planner's microbatches when pp = 1)."""
        layouts = []
        for tp in _options(self.tp, world):
            for pp in _options(self.pp, world):
                rest, remainder = divmod(world, tp * pp * self.dp_replicate)
                dp = rest if self.dp == AUTO else self.dp
                if remainder or dp * tp * pp * self.dp_replicate != world:
                    continue
                pipeline = dict(pp_schedule=self.pp_schedule, microbatches=self.microbatches,
                                virtual_stages=self.virtual_stages) if pp > 1 else dict(
                                    microbatches=accumulation if accumulation > 1 else None)
                layouts.append(Layout(dp=dp, tp=tp, pp=pp, dp_replicate=self.dp_replicate, zero=self.zero,
                                      activation_checkpointing=self.activation_checkpointing, **pipeline))
        return layouts


def _options(degree: Degree, world: int) -> list[int]:
    return divisors(world) if degree == AUTO else [int(degree)]


# ------------------------------------------------------------------------------------------------- choosing
@dataclass(frozen=True)
class Obstacles:
    """Why the module cannot take some layouts, beyond the cost model's own reasons."""

    tensor_parallel: Mapping[int, str] = field(default_factory=dict)  # tp degree → why the blocks refuse it
    pipeline: Optional[str] = None  # why the module cannot be pipelined at all

    def reasons(self, layout: Layout) -> tuple[str, ...]:
        reasons = [self.tensor_parallel[layout.tp]] if layout.tp in self.tensor_parallel else []
        return (*reasons, *([self.pipeline] if self.pipeline and layout.pp > 1 else []))


def choose_layout(model: ModelShape, cluster: Cluster, request: LayoutRequest, per_rank_batch: int, precision: str,
                  accumulation: int = 1, obstacles: Obstacles = Obstacles()) -> list[Estimate]:
    """Estimates of every layout ``request`` leaves open, ranked: feasible ones by tokens per second (most first;
    ties: less memory), then the infeasible ones, nearest to fitting first. ``per_rank_batch`` is the DataLoader's
    batch (sequences per data-parallel rank and step). Raises ``ValueError`` saying what would fit when nothing
    does."""
    estimates = []
    for layout in request.layouts(cluster.gpus, accumulation):
        global_batch = per_rank_batch * layout.dp * layout.dp_replicate * layout.accumulation_steps
        result = estimate(model, cluster, layout, global_batch, precision)
        estimates.append(replace(result, reasons=(*result.reasons, *obstacles.reasons(layout))))
    feasible = sorted((e for e in estimates if e.feasible), key=lambda e: (-e.tokens_per_second, e.memory.total))
    infeasible = sorted((e for e in estimates if not e.feasible),
                        key=lambda e: (len(e.reasons) - e.out_of_memory, e.memory.total))
    if not feasible:
        raise ValueError(_nothing_fits(model, cluster, request, per_rank_batch, precision, accumulation, obstacles,
                                       infeasible))
    return feasible + infeasible


def _nothing_fits(model: ModelShape, cluster: Cluster, request: LayoutRequest, per_rank_batch: int, precision: str,
                  accumulation: int, obstacles: Obstacles, ranked: list[Estimate]) -> str:
    nearest = ranked[0] if ranked else None
    message = (f"HybridStrategy(tp={request.tp!r}, pp={request.pp!r}) found no layout of {cluster.gpus} devices that"
               f" can train this model with {per_rank_batch} sequences of {model.seq_len} tokens per data-parallel"
               " rank.")
    if nearest is not None:
        message += f" The nearest, {nearest.layout}: {'; '.join(nearest.reasons)}."
    if request.activation_checkpointing is None:
        checkpointed = replace(request, activation_checkpointing="every")
        try:
            best = choose_layout(model, cluster, checkpointed, per_rank_batch, precision, accumulation, obstacles)[0]
        except ValueError:
            pass
        else:
            return message + (f" With HybridStrategy(activation_checkpointing='every') {best.layout} fits"
                              f" ({_size(best.memory.total)} per device).")
    return message + " Lower the DataLoader's batch size or add devices."


def describe_choice(ranked: Sequence[Estimate], cluster: Cluster, hardware: str) -> str:
    """One log line: the chosen layout, its predicted memory and throughput, the runner-up, and the hardware."""
    chosen = ranked[0]
    memory = chosen.memory
    where = "" if memory.stage == "only" else f" ({memory.stage} pipeline stage)"
    text = (f"chose {chosen.layout} for {cluster.gpus} devices: predicted {_size(memory.total)} per device{where} of"
            f" {_size(cluster.usable_memory)} usable (model states {_size(memory.model_states)}, gathered parameters"
            f" {_size(memory.gathered_parameters)}, activations {_size(memory.activations)}, logits"
            f" {_size(memory.logits)}), {chosen.tokens_per_second:,.0f} tokens/s")
    runner_up = next((e for e in ranked[1:] if e.feasible), None)
    if runner_up is not None:
        text += f"; next {runner_up.layout} at {runner_up.tokens_per_second:,.0f} tokens/s"
    ruled_out = [e for e in ranked if not e.feasible]
    if ruled_out:
        text += f"; {len(ruled_out)} ruled out (e.g. {ruled_out[0].layout}: {ruled_out[0].reasons[0]})"
    return text + f". Hardware: {hardware}."


def _size(size_bytes: float) -> str:
    return f"{size_bytes / GIB:.2f} GiB" if size_bytes >= GIB / 10 else f"{size_bytes / 2**20:.2f} MiB"


# ------------------------------------------------------------------------------------------ the live model
@dataclass(frozen=True)
class Attention:
    """What the first block's attention revealed: heads, query length, and whether scores were materialized. (Key/value
    heads are read from the projections' widths: many models repeat them to the query's count before attending.)"""

    heads: int
    seq_len: int
    flash: bool


class _AttentionWatch(TorchFunctionMode):
    """Records the first attention computed: ``scaled_dot_product_attention`` (heads = query elements / (tokens ·
    head size)) or a softmax over a square last pair of dimensions
    (materialized scores: heads = elements / (tokens · s)). Counting elements, not reading a dimension, fits every
    layout of the heads ((b, a, s, d), (b·a, s, d), ...)."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens
        self.found: Optional[Attention] = None

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if self.found is None:
            self.found = _attention_of(func, args, kwargs, self.tokens)
        return func(*args, **kwargs)


_SOFTMAX = (torch.softmax, F.softmax, Tensor.softmax)


def _attention_of(func: Any, args: tuple, kwargs: dict, tokens: int) -> Optional[Attention]:
    if not tokens:
        return None
    if func is F.scaled_dot_product_attention:
        query = kwargs.get("query", args[0] if args else None)
        if isinstance(query, Tensor) and query.dim() >= 3:
            heads = query.numel() // (tokens * query.shape[-1])
            if heads >= 1:
                return Attention(heads, query.shape[-2], flash=True)
    elif func in _SOFTMAX and args and isinstance(args[0], Tensor):
        scores = args[0]
        if scores.dim() >= 3 and scores.shape[-1] == scores.shape[-2]:
            seq_len = scores.shape[-1]
            heads = scores.numel() // (tokens * seq_len)
            if heads >= 1 and heads * tokens * seq_len == scores.numel():
                return Attention(heads, seq_len, flash=False)
    return None


def measure_model(module: nn.Module, blocks_path: str, block_call: tuple[tuple, dict]) -> tuple[ModelShape, int]:
    """The module's :class:`ModelShape` with heads and sequence length from one forward of its first block on the
    captured inputs, and the tokens that call carried (sequences × length of the batch)."""
    blocks = module.get_submodule(blocks_path)
    hidden = ModelShape.measure(module, seq_len=1, heads=1, blocks=blocks_path).hidden  # sizes but heads and length
    tokens = _tokens_in(block_call, hidden)
    watch = _AttentionWatch(tokens)
    args, kwargs = copy.deepcopy(block_call)  # the block may update state it is handed (e.g. a key/value cache)
    with torch.no_grad(), watch:
        blocks[0](*args, **kwargs)
    if watch.found is None:
        raise ValueError(
            f"HybridStrategy(tp='auto'/pp='auto') found no attention in {type(blocks[0]).__name__} (no"
            " scaled_dot_product_attention and no softmax over sequence × sequence scores) to read the number of"
            " heads and the sequence length from, which the memory model needs. Pass tp=N and pp=N yourself."
        )
    attention = watch.found
    shape = ModelShape.measure(module, seq_len=attention.seq_len, heads=attention.heads,
                               flash_attention=attention.flash, blocks=blocks_path)
    return shape, tokens


def _tokens_in(block_call: tuple[tuple, dict], hidden: int) -> int:
    """Tokens in the block's hidden-state input: its first floating tensor whose last dimension is ``hidden``."""
    for value in tree_flatten(block_call)[0]:
        if isinstance(value, Tensor) and value.is_floating_point() and value.dim() >= 2 and value.shape[-1] == hidden:
            return value.numel() // hidden
    return 0


def tensor_parallel_obstacles(root: nn.Module, blocks_path: str, block_call: tuple[tuple, dict],
                              degrees: Sequence[int], tp_plan: Mapping[str, PlanEntry],
                              check_on: Optional[str] = None) -> dict[int, str]:
    """``{tp: why not}`` for the degrees the tensor-parallel planner refuses for the first block: by structure
    (heads, widths); with ``check_on`` (a device type; every process must call) also by the numeric plan check the
    strategy runs at setup, each degree on a temporary mesh of its size."""
    blocks = root.get_submodule(blocks_path)
    overrides = block_tp_overrides(root, tp_plan, blocks_path, len(blocks))
    args, kwargs = block_call
    trace = trace_block(blocks[0], args, kwargs)
    obstacles = {}
    for tp in degrees:
        if tp == 1:
            continue
        try:
            plan_block(blocks[0], trace, tp, overrides)
            if check_on is not None:
                mesh = init_device_mesh(check_on, (dist.get_world_size() // tp, tp), mesh_dim_names=("rest", "tp"))
                plan_tensor_parallel(root, blocks_path, blocks, block_call, mesh["tp"], tp_plan=tp_plan, verify=True)
        except (ValueError, RuntimeError) as error:
            obstacles[tp] = f"tensor parallelism: {error}"
    return obstacles


# ------------------------------------------------------------------------------------------------- hardware
def detect_cluster(device: torch.device, nodes: int, devices_per_node: int, precision: str) -> tuple[Cluster, str]:
    """The job's hardware as a :class:`Cluster`, and where its numbers come from. Every process must call it
    (the CPU probe all-reduces over the default process group)."""
    if device.type == "cuda":
        return _gpu_cluster(device, nodes, devices_per_node, precision)
    return _probed_cpu_cluster(nodes, devices_per_node)


def _gpu_cluster(device: torch.device, nodes: int, devices_per_node: int, precision: str) -> tuple[Cluster, str]:
    name = torch.cuda.get_device_name(device)
    memory = float(torch.cuda.get_device_properties(device).total_memory)
    preset = _preset_for(name, memory)
    if preset is not None:
        cluster = Cluster.preset(preset, nodes=nodes, gpus_per_node=devices_per_node, precision=precision,
                                 memory_bytes=memory)
        return cluster, f"{name}, preset {preset!r} (peak, links), {memory / GIB:.1f} GiB from the device"
    dtype = torch.float32 if precision == "32-true" else torch.bfloat16
    peak = get_available_flops(device, dtype)
    if peak is None:
        raise ValueError(
            f"HybridStrategy(tp='auto'/pp='auto') does not know the peak FLOP/s of {name!r}. Describe it:"
            " HybridStrategy(..., cluster=Cluster(nodes=..., gpus_per_node=..., memory_bytes=..., peak_flops=...,"
            " intra_node_bandwidth=..., inter_node_bandwidth=...)) from lightning_hybrid.planning."
        )
    # Links unknown: assume PCIe Gen4 within a node and 100 Gb/s between nodes (the L4 preset's numbers).
    links = GPU_PRESETS["l4"]
    cluster = Cluster(nodes=nodes, gpus_per_node=devices_per_node, memory_bytes=memory, peak_flops=peak,
                      intra_node_bandwidth=links.intra_node_gbps * 1e9, inter_node_bandwidth=links.inter_node_gbps * 1e9)
    return cluster, f"{name}, peak {peak / 1e12:.0f} TFLOP/s from Lightning's table, links assumed PCIe/100 Gb/s"


def _preset_for(name: str, memory: float) -> Optional[str]:
    lowered = name.lower()
    if "h200" in lowered:
        return "h200"
    if "h100" in lowered:
        return "h100-sxm"
    if "a100" in lowered:
        return "a100-80gb" if memory > 50 * GIB else "a100-40gb"
    if re.search(r"\bl4\b", lowered):
        return "l4"
    return None


def _probed_cpu_cluster(nodes: int, devices_per_node: int) -> tuple[Cluster, str]:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices_per_node
    if dist.is_initialized():
        dist.barrier()  # every process probes at once: the rate each gets while all of them compute
    flops = matmul_flops()
    latency, bandwidth = all_reduce_link()
    # gloo reduces on the cores that compute: nothing hides behind compute
    cluster = Cluster(nodes=nodes, gpus_per_node=devices_per_node, memory_bytes=memory, peak_flops=flops,
                      intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, efficiency=1.0, latency=latency,
                      overlap_communication=False)
    links = "no links (one process)" if math.isinf(bandwidth) else (
        f"all-reduce {latency * 1e6:.0f} µs + {bandwidth / 1e9:.2f} GB/s")
    return cluster, (f"CPU probe: matmul {flops / 1e9:.0f} GFLOP/s per process, {links}, {memory / GIB:.1f} GiB of"
                     " RAM per process")


def matmul_flops(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of one fp32 ``size``² matmul on this process's CPU threads (median of ``repeats``)."""
    a, b = torch.ones(size, size), torch.ones(size, size)  # not random: the user's random streams stay untouched
    a @ b
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds)


def all_reduce_link(size_bytes: int = 4 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """(latency s, bus bandwidth bytes/s) of all-reduces over the default process group, the α and β of the
    planner: α = a 1 KiB all-reduce's time, bandwidth = 2·(n−1)/n × bytes / (time − α) at ``size_bytes``; each the
    slowest rank's median. (0, infinite) with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0, math.inf
    world = dist.get_world_size()
    latency = _slowest_median_all_reduce(256, repeats)
    seconds = _slowest_median_all_reduce(size_bytes // 4, repeats)
    return latency, 2 * (world - 1) / world * size_bytes / max(seconds - latency, 1e-9)


def _slowest_median_all_reduce(elements: int, repeats: int) -> float:
    buffer = torch.zeros(elements)
    dist.all_reduce(buffer)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)
