"""Experts held as a list of modules (``nn.ModuleList`` of ``nn.Linear`` MLPs, one object per expert) that the
model's own code calls one by one on the rows its router chose for each, spread over an expert-parallel group.

The loop choosing the rows, weighting and summing the results is the model's; which experts it calls in a step is
its business (every one, or only those some token chose). So the exchange cannot happen inside the loop: each rank
would call it a different number of times. :func:`split_list` makes the module running that loop (the *host*) run
its forward twice instead:

1. **recording**: every expert call returns zeros and notes its input rows (the router, weighting and summing run
   as written; what they compute is discarded);
2. **exchange**: every expert's rows go to the rank holding it (one all-to-all), each rank runs its own experts
   on all rows they received, the results come back (one all-to-all);
3. **replaying**: the host's forward again, with the random state of the first pass: each expert call returns its
   results. Its output is the layer's; gradients reach the rows through the exchange and the first pass, the
   routing weights through the second.

Other ranks' experts keep no parameters here (their entries leave this rank's state dict; each rank's checkpoint
holds its experts, under their unmodified names). A forward whose expert inputs in the second pass differ from the
first's (an expert's output feeding another's input) is refused by the setup check.

Example::

    split_list(block.moe, experts=list(block.moe.experts), group=ExpertGroup(mesh["ep"], count=8),
               output_widths=[(32,)] * 8)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_hybrid.expert_parallel.exchange import ExpertGroup, return_rows, send_rows
from lightning_hybrid.expert_parallel.modules import base_forward, keeps_own_class

#: What an expert call does inside the host's passes: ``(expert index, input rows) → output rows``.
Route = Callable[[int, Tensor], Tensor]


def split_list(host: nn.Module, experts: Sequence[nn.Module], group: ExpertGroup,
               output_tails: Sequence[tuple[int, ...]]) -> None:
    """Keep this rank's ``experts`` (drop the others' parameters) and make ``host`` run its forward in two passes
    around one exchange. ``output_tails``: each expert's output shape after the rows dimension."""
    for index, expert in enumerate(experts):
        if index not in group.owned:
            for inner in expert.modules():
                for key in inner._parameters:
                    inner._parameters[key] = None
        expert.ep_index, expert.ep_route = index, None
        keeps_own_class(expert, "Routed", _routed_forward)
    host.ep_group, host.ep_experts, host.ep_tails = group, tuple(experts), tuple(output_tails)
    keeps_own_class(host, "ExpertHost", _two_pass_forward)


def _routed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    route: Optional[Route] = self.ep_route
    if route is None:
        return base_forward(self, *args, **kwargs)
    if len(args) != 1 or kwargs or not isinstance(args[0], Tensor):
        raise RuntimeError(f"HybridStrategy(ep=...): expert {type(self).__name__} #{self.ep_index} is called with"
                           " other arguments than one tensor of rows; its layer cannot be split over ranks (ep=1).")
    return route(self.ep_index, args[0])


def _two_pass_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    experts: tuple[nn.Module, ...] = self.ep_experts
    random_state = _random_state()
    recorded: list[list[Tensor]] = [[] for _ in experts]

    def record(index: int, rows: Tensor) -> Tensor:
        recorded[index].append(rows)
        return rows.new_zeros(rows.shape[0], *self.ep_tails[index])

    with _routed(experts, record):
        base_forward(self, *args, **kwargs)
    results = _exchange(recorded, experts, self.ep_group, counted=self.training)
    _restore_random_state(random_state)

    def replay(index: int, rows: Tensor) -> Tensor:
        if not results[index] or results[index][0].shape[0] != rows.shape[0]:
            raise RuntimeError(f"HybridStrategy(ep=...): {type(self).__name__}'s forward called expert #{index}"
                               " with other rows the second time; its layer cannot be split over ranks (ep=1).")
        return results[index].pop(0)

    with _routed(experts, replay):
        return base_forward(self, *args, **kwargs)


def _exchange(recorded: list[list[Tensor]], experts: Sequence[nn.Module], group: ExpertGroup,
              counted: bool) -> list[list[Tensor]]:
    """Each expert's recorded rows through the rank holding it; the results split as the calls were (``counted``:
    in the group's figures)."""
    template = next(rows for calls in recorded for rows in calls)
    per_expert = [torch.cat(calls) if calls else template.new_zeros(0, *template.shape[1:]) for calls in recorded]
    counts = torch.tensor([rows.shape[0] for rows in per_expert], dtype=torch.long, device=template.device)
    if counted:
        group.stats.add_routed(torch.repeat_interleave(torch.arange(len(experts), device=counts.device), counts),
                               len(experts))
    per_rank = counts.view(group.size, group.local).sum(1).tolist()
    received, received_per_rank = send_rows(torch.cat(per_expert), per_rank, group, counted)
    from_each = group.counts_from_each(counts).view(group.size, group.local)  # sender × local expert
    pieces = list(received.split(from_each.reshape(-1).tolist()))
    outputs = [experts[expert](torch.cat(pieces[local::group.local]))
               for local, expert in enumerate(group.owned)]
    by_sender = [output.split(from_each[:, local].tolist()) for local, output in enumerate(outputs)]
    results = torch.cat([by_sender[local][sender] for sender in range(group.size) for local in range(group.local)])
    back = return_rows(results, per_rank, received_per_rank, group, counted).split(counts.tolist())
    return [list(rows.split([call.shape[0] for call in calls])) for rows, calls in zip(back, recorded)]


class _routed:
    """Every expert's calls go to ``route`` inside the ``with`` body."""

    def __init__(self, experts: Sequence[nn.Module], route: Route) -> None:
        self.experts, self.route = experts, route

    def __enter__(self) -> None:
        for expert in self.experts:
            expert.ep_route = self.route

    def __exit__(self, *exc: Any) -> None:
        for expert in self.experts:
            expert.ep_route = None


def _random_state() -> tuple[Tensor, Optional[list[Tensor]]]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def _restore_random_state(state: tuple[Tensor, Optional[list[Tensor]]]) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])
