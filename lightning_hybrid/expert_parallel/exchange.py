"""The all-to-all exchange of expert parallelism, and what it moved.

A layer's ``E`` experts are spread over the ``N`` ranks of its :class:`ExpertGroup`, ``E / N`` consecutive experts
each. :func:`send_rows` sends rows (one per token and chosen expert, sorted by expert, so grouped by the rank holding
it) to their ranks and returns the rows received, grouped by sender; :func:`return_rows` sends the results back the
same way. Both are differentiable (the backward sends gradients back the way the rows came), and a rank's rows for
its own experts stay out of the collective (they cross no link). Every rank of the group must call them in the same
order, with counts that may differ (and be zero) per rank.

:class:`ExchangeStats` keeps what one layer moved since it was last read: tokens routed to each expert (this rank's
tokens, by the model's own router), rows and bytes sent, seconds in the exchange; the monitor reads and resets them.

Example::

    group = ExpertGroup(mesh["ep"], count=8)                   # 4 ranks: experts 0-1 on rank 0, 2-3 on rank 1, ...
    received, counts = send_rows(rows, per_rank=[3, 0, 5, 2], group=group)
    back = return_rows(results, per_rank=[3, 0, 5, 2], received_per_rank=counts, group=group)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid._compat import all_to_all_autograd


@dataclass
class ExchangeStats:
    """What one expert layer moved on this rank since :meth:`take` last read it."""

    tokens_per_expert: Optional[Tensor] = None
    #: Rows sent to other ranks (forward), bytes sent to them (forward and backward), seconds in forward exchanges.
    rows_sent: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0

    def add_routed(self, experts: Tensor, count: int) -> None:
        routed = torch.bincount(experts.detach().reshape(-1), minlength=count)
        self.tokens_per_expert = routed if self.tokens_per_expert is None else self.tokens_per_expert + routed

    def take(self) -> "ExchangeStats":
        """These figures, and zero from now on."""
        taken = ExchangeStats(self.tokens_per_expert, self.rows_sent, self.bytes_sent, self.seconds)
        self.tokens_per_expert, self.rows_sent, self.bytes_sent, self.seconds = None, 0, 0, 0.0
        return taken


@dataclass
class ExpertGroup:
    """The ranks (``mesh``, 1-D) one layer's ``count`` experts are spread over, ``count / size`` each."""

    mesh: DeviceMesh
    count: int
    stats: ExchangeStats = field(default_factory=ExchangeStats)

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    @property
    def local(self) -> int:
        """Experts per rank."""
        return self.count // self.size

    @property
    def owned(self) -> range:
        """The global indices of this rank's experts."""
        return range(self.rank * self.local, (self.rank + 1) * self.local)

    def counts_from_each(self, per_rank: Tensor) -> Tensor:
        """Every rank's ``per_rank`` counts for this rank (an integer tensor of ``size × k`` entries, ``k`` for each
        rank), received from each rank in order."""
        received = torch.empty_like(per_rank)
        dist.all_to_all_single(received, per_rank.contiguous(), group=self.mesh.get_group())
        return received


def send_rows(rows: Tensor, per_rank: list[int], group: ExpertGroup, counted: bool = True) -> tuple[Tensor, list[int]]:
    """``rows`` (grouped by destination, ``per_rank[r]`` for rank ``r``) sent; returns the rows received (grouped by
    sender) and how many came from each rank. ``counted``: added to the group's figures (training, not
    validation)."""
    start = time.perf_counter()
    received_counts = group.counts_from_each(torch.tensor(per_rank, dtype=torch.long, device=rows.device)).tolist()
    received = _all_to_all(rows, received_counts, per_rank, group)
    if counted:
        _count(group, rows, per_rank, start)
    return received, received_counts


def return_rows(results: Tensor, per_rank: list[int], received_per_rank: list[int], group: ExpertGroup,
                counted: bool = True) -> Tensor:
    """The results for the rows :func:`send_rows` received sent back; returns this rank's rows' results, in the
    order its rows were sent."""
    start = time.perf_counter()
    back = _all_to_all(results, per_rank, received_per_rank, group)
    if counted:
        _count(group, results, received_per_rank, start)
    return back


def _all_to_all(rows: Tensor, received_per_rank: list[int], per_rank: list[int], group: ExpertGroup) -> Tensor:
    """The all-to-all with this rank's own segment kept out of the collective (copied in place: it crosses no
    link), so the collective moves only what other ranks need."""
    me = group.rank
    start, stop = sum(per_rank[:me]), sum(per_rank[:me + 1])
    others = torch.cat([rows[:start], rows[stop:]])
    sent, received = list(per_rank), list(received_per_rank)
    sent[me] = received[me] = 0
    got = all_to_all_autograd(others, received, sent, group.mesh.get_group())
    at = sum(received_per_rank[:me])
    return torch.cat([got[:at], rows[start:stop], got[at:]])


def _count(group: ExpertGroup, sent: Tensor, per_rank: list[int], start: float) -> None:
    """Rows to other ranks only (a rank's rows for its own experts cross no link); the backward sends as many
    bytes back the same way, so the figures count them twice; the seconds are the forward's."""
    rows = sent.shape[0] - per_rank[group.rank]
    group.stats.rows_sent += rows
    group.stats.bytes_sent += 2 * rows * (sent[0].numel() if sent.shape[0] else 0) * sent.element_size()
    group.stats.seconds += time.perf_counter() - start
