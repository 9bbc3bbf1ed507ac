"""The collectives of context parallelism, differentiable, and what they moved.

The ``N`` ranks of a :class:`ContextGroup` read the same samples; rank ``r`` holds positions ``[r·S/N, (r+1)·S/N)``
of each sequence inside the blocks.

* :func:`split_sequence` takes this rank's part of a tensor every rank holds whole (a block's input);
  :func:`gather_sequence` puts the parts back together (a block's output), so everything outside the blocks — the
  embedding, the head, the loss and its normalisation — runs whole and equal on every rank of the group.
* :func:`sequence_to_heads` / :func:`heads_to_sequence` (DeepSpeed-Ulysses' exchange) turn this rank's positions of
  every head into every position of ``heads / N`` heads and back, one all-to-all each, around the attention call.

The gradients are scaled so that their **mean** over the group is the whole sequence's gradient, which is what the
FSDP2 data mesh (``dp × cp`` ranks) computes: the gather's backward hands each rank its part's gradient times ``N``
(every rank computed the same loss from the same gathered tensor), the split's backward gathers the parts and
divides by ``N``. So a parameter inside the blocks gets ``N`` × its part's gradient on each rank, one outside gets the
whole gradient on each; both average to the single-device gradient, with no other reduction to change.

Example::

    group = ContextGroup(mesh["cp"].get_group(), rank=mesh["cp"].get_local_rank(), size=2)
    local = split_sequence(hidden, dim=1, group=group)            # (B, S/2, H)
    q = sequence_to_heads(q_local, seq_dim=2, head_dim=1, group=group)   # (B, h/2, S, d)
    out = heads_to_sequence(attention(q, k, v), seq_dim=2, head_dim=1, group=group)
    hidden = gather_sequence(block_output, dim=1, group=group)    # (B, S, H)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid._compat import all_to_all_autograd


@dataclass
class ContextGroup:
    """The ranks one sequence is split over: the process group, this rank's place in it, its size, the bytes this
    rank sent to the others (forward exchanges; read by the benchmark), and whether the blocks split at all (the
    setup check runs the step with them whole too)."""

    group: Any
    rank: int
    size: int
    bytes_sent: dict[str, int] = field(default_factory=lambda: {"all_to_all": 0, "all_gather": 0})
    enabled: bool = True
    warned: set[str] = field(default_factory=set)  # what the blocks warned about once

    def count(self, kind: str, tensor: Tensor) -> None:
        """Note what one collective sent to the other ranks: ``(N - 1) / N`` of an all-to-all's input, the whole
        part of an all-gather to each of ``N - 1`` ranks."""
        size = tensor.numel() * tensor.element_size()
        self.bytes_sent[kind] += size * (self.size - 1) // self.size if kind == "all_to_all" else size * (self.size - 1)


@contextlib.contextmanager
def running_whole(group: ContextGroup) -> Iterator[None]:
    """Within it, the group's blocks run whole (every rank of the group the same call, as without cp)."""
    group.enabled = False
    try:
        yield
    finally:
        group.enabled = True


def part(tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
    """This rank's positions of ``tensor`` along ``dim`` (a view); an error naming the fix if they do not divide."""
    length = tensor.shape[dim]
    if length % group.size:
        raise ValueError(f"HybridStrategy(cp={group.size}) splits each sequence into {group.size} equal parts, but"
                         f" a block got a sequence of {length} positions. Pad the sequences to a multiple of"
                         f" {group.size} (collate with padding and an attention mask), or use a cp that divides it.")
    return positions(tensor, dim, group.rank, group.size)


def positions(tensor: Tensor, dim: int, index: int, parts: int) -> Tensor:
    """Part ``index`` of ``parts`` equal parts of ``tensor`` along ``dim`` (a view)."""
    chunk = tensor.shape[dim] // parts
    return tensor.narrow(dim, index * chunk, chunk)


def _all_gather(tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
    parts = [torch.empty_like(tensor) for _ in range(group.size)]
    dist.all_gather(parts, tensor.contiguous(), group=group.group)
    return torch.cat(parts, dim=dim)


class _Split(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        # A copy: a view would keep the whole tensor alive as long as the part lives (the block saves its input).
        return part(tensor, dim, group).clone(memory_format=torch.contiguous_format)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group) / ctx.group.size, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        group.count("all_gather", tensor)
        return _all_gather(tensor, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return part(grad, ctx.dim, ctx.group) * ctx.group.size, None, None


def split_sequence(tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
    """This rank's part of ``tensor`` (equal on every rank of the group) along ``dim``; see the module docstring
    for its gradient."""
    if not (tensor.requires_grad or tensor.is_floating_point()):
        return part(tensor, dim, group)  # integer positions, boolean masks: no gradient to route
    return _Split.apply(tensor, dim, group)


def gather_sequence(tensor: Tensor, dim: int, group: ContextGroup) -> Tensor:
    """Every rank's part of ``tensor`` along ``dim``, in rank order; see the module docstring for its gradient."""
    return _Gather.apply(tensor, dim, group)


def sequence_to_heads(tensor: Tensor, seq_dim: int, head_dim: int, group: ContextGroup) -> Tensor:
    """``(…, h, …, S/N, …)`` on each rank → ``(…, h/N, …, S, …)``: rank ``r`` gets heads ``[r·h/N, (r+1)·h/N)``
    at every position (one all-to-all; ``h`` must divide by ``N``)."""
    seq_dim, head_dim = seq_dim % tensor.dim(), head_dim % tensor.dim()
    heads = tensor.shape[head_dim]
    moved = tensor.movedim(head_dim, 0).contiguous()  # (h, …): head chunk j goes to rank j
    seq_at = seq_dim + 1 if seq_dim < head_dim else seq_dim
    received = _exchange(moved, heads // group.size, group)  # (h, …): rows of chunk j came from rank j
    received = received.unflatten(0, (group.size, heads // group.size)).movedim(0, seq_at)
    return received.flatten(seq_at, seq_at + 1).movedim(0, head_dim)


def heads_to_sequence(tensor: Tensor, seq_dim: int, head_dim: int, group: ContextGroup) -> Tensor:
    """The inverse of :func:`sequence_to_heads`: ``(…, h/N, …, S, …)`` → ``(…, h, …, S/N, …)``."""
    seq_dim, head_dim = seq_dim % tensor.dim(), head_dim % tensor.dim()
    heads = tensor.shape[head_dim]
    moved = tensor.movedim(head_dim, 0)  # (h/N, …, S, …)
    seq_at = seq_dim + 1 if seq_dim < head_dim else seq_dim
    chunks = moved.unflatten(seq_at, (group.size, -1)).movedim(seq_at, 0)  # (N, h/N, …, S/N, …)
    received = _exchange(chunks.flatten(0, 1).contiguous(), heads, group)
    return received.movedim(0, head_dim)


def _exchange(rows: Tensor, per_rank: int, group: ContextGroup) -> Tensor:
    group.count("all_to_all", rows)
    splits = [per_rank] * group.size
    return all_to_all_autograd(rows, splits, splits, group.group)
