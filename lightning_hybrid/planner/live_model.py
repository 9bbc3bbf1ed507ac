"""What the auto layout reads from the live run: the model's sizes with heads and sequence length from the
attention its first block computes on the first batch, and which tensor-parallel degrees its blocks refuse.

Read from the run, not from names:

* the model's sizes: parameter counts per block and outside the blocks (:meth:`ModelShape.measure`);
* heads, key/value heads and sequence length: from ``scaled_dot_product_attention``'s query, or a softmax over
  sequence × sequence scores — element counts, so any layout of the heads;
* which tensor-parallel degrees the blocks allow: the tensor-parallel planner's own checks for each candidate
  degree — by structure (:func:`~lightning_hybrid.tensor_parallel.block_plan.plan_block`) and, with ``verify_tp_plan``, the
  numeric plan check the strategy runs at setup (a block that derives its head size from the input width, as
  nanoGPT's does, passes the first and fails the second).

Example::

    shape, tokens = measure_model(module, "model.blocks", block_call)     # block_call: the first block's inputs
    tensor_parallel_obstacles(module, "model.blocks", block_call, [2, 4], tp_plan={})   # {4: "tensor parallelism: ..."}
"""

from __future__ import annotations

import contextlib
import copy
import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lightning_hybrid._compat import tree_flatten
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.tensor_parallel.dataflow import trace_block
from lightning_hybrid.tensor_parallel.apply import plan_tensor_parallel
from lightning_hybrid.tensor_parallel.block_plan import PairGroup, plan_block
from lightning_hybrid.tensor_parallel.overrides import PlanEntry, block_tp_overrides
from lightning_hybrid.planner.model import ModelShape


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
    _, blocks = find_block_list(module, blocks_path)
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
    strategy runs at setup, each degree on temporary process groups of its size (destroyed after the check). A
    degree at which a pair of layers could only be sharded with its activations gathered is ruled out too: the
    cost model divides a block's compute by tp, which does not hold for what then runs whole on every rank."""
    _, blocks = find_block_list(root, blocks_path)
    overrides = block_tp_overrides(root, tp_plan, [blocks.name(i) for i in range(len(blocks))])
    args, kwargs = block_call
    trace = trace_block(blocks[0], args, kwargs)
    obstacles = {}
    for tp in degrees:
        if tp == 1:
            continue
        try:
            _, candidates = plan_block(blocks[0], trace, tp, overrides)
            gathered = [options[0] for options in candidates if all(_gathered_pair(group) for group in options)]
            if check_on is not None and not gathered:
                with _temporary_tensor_mesh(check_on, tp) as mesh:
                    plan = plan_tensor_parallel(root, blocks_path, blocks, block_call, mesh, tp_plan=tp_plan,
                                                verify=True)
                gathered = [group for group in plan.groups if _gathered_pair(group)]
        except (ValueError, RuntimeError) as error:
            obstacles[tp] = f"tensor parallelism: {error}"
            continue
        if gathered:
            obstacles[tp] = (f"tensor parallelism: at tp={tp} no rank can compute a share of the heads between"
                             f" {gathered[0].layers}; only their weights would be sharded")
    return obstacles


def _gathered_pair(group: Any) -> bool:
    return isinstance(group, PairGroup) and group.gathered and bool(group.rows)


_temporary_meshes = itertools.count()


@contextlib.contextmanager
def _temporary_tensor_mesh(device_type: str, tp: int) -> Iterator[DeviceMesh]:
    """A 1-D mesh of ``tp`` consecutive ranks (every process calls); its process group is destroyed on exit, so
    checking several degrees leaves no communicators behind. Each gets a dimension name of its own: DTensor caches
    sharding decisions by mesh equality (ranks and names), and a later mesh equal to a destroyed one would be
    handed the destroyed group."""
    group, _ = dist.new_subgroups(group_size=tp)
    try:
        yield DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"tp_check_{next(_temporary_meshes)}",))
    finally:
        dist.destroy_process_group(group)
