"""Expert parallelism applied to a model's blocks: each block structure's expert layers found on its recorded call,
split over the ``ep`` mesh in every block of this rank's, and the split checked against the whole layer.

:func:`apply_expert_parallel` returns :class:`AppliedExperts`: every split layer's :class:`ExpertGroup` (its
exchange figures, read by the monitor), the modules FSDP2 must shard over the expert data mesh as units of their
own (each rank holds other experts than its data-parallel neighbours in the dense mesh), and what stayed whole.

Example::

    applied = apply_expert_parallel(blocks, record.block_calls, mesh["ep"], owned=range(len(blocks)))
    applied.describe()    # "8 layers of 8 experts over ep=4 (2 per rank: rank 0 holds 0-1, ...)"
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_hybrid.expert_parallel.check import compare_split, layer_gradients
from lightning_hybrid.expert_parallel.exchange import ExpertGroup
from lightning_hybrid.expert_parallel.find import FoundExperts, find_expert_layers
from lightning_hybrid.expert_parallel.lists import split_list
from lightning_hybrid.expert_parallel.stacked import expert_count, split_stack
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.record import BlockCall, block_call


@dataclass
class AppliedExperts:
    """The expert layers split (module name → group), FSDP2's expert units, and the layers kept whole with why."""

    groups: dict[str, ExpertGroup] = field(default_factory=dict)
    units: list[list[nn.Module]] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    largest_difference: float = 0.0
    checked: bool = False
    #: ``id`` of a parameter of experts spread whole (a list) → the ep group its gradient norm adds up over; set
    #: once FSDP2 has made the parameters the optimizer sees.
    spread_norms: dict[int, Any] = field(default_factory=dict)

    def describe(self, ep: int) -> str:
        """Which experts each ep rank holds, e.g. ``"2 expert layers of 4 experts over ep=2: ep rank 0 holds
        experts 0-1, ep rank 1 holds experts 2-3"``."""
        if not self.groups:
            return f"no mixture-of-experts layer found to split over ep={ep}"
        parts = []
        for count in sorted({group.count for group in self.groups.values()}):
            layers, local = sum(g.count == count for g in self.groups.values()), count // ep
            held = ", ".join(f"ep rank {r} holds experts {r * local}-{(r + 1) * local - 1}" for r in range(min(ep, 8)))
            parts.append(f"{layers} expert layers of {count} experts over ep={ep}: {held}{', ...' if ep > 8 else ''}")
        return "; ".join(parts)


class ExpertSplitRefused(ValueError):
    """A layer whose experts cannot be spread over the ep ranks (the count not divisible, or the check failed)."""


def apply_expert_parallel(root: nn.Module, blocks: BlockList, block_calls: Mapping[int, BlockCall],
                          mesh: DeviceMesh, owned: Sequence[int], verify: bool = True) -> AppliedExperts:
    """Split the expert layers of the blocks ``owned`` over ``mesh`` (1-D, the ep ranks of this rank's stage)."""
    applied = AppliedExperts()
    names = {id(m): name for name, m in root.named_modules()}
    for indices in block_structures(blocks):
        targets = [i for i in indices if i in owned]
        if not targets:
            continue
        args, kwargs = block_call(block_calls, indices[0])
        found = find_expert_layers(blocks[targets[0]], args, kwargs)
        applied.kept.update({f"{blocks.name(targets[0])}.{path}": why for path, why in found.kept.items()})
        on_meta = any(p.is_meta for p in blocks[targets[0]].parameters())
        for position, index in enumerate(targets):
            check = verify and position == 0 and not on_meta  # no values to compare (the pipeline's check has)
            _split_block(blocks[index], found, mesh, applied, names, check, _tolerance(blocks[index]))
    return applied


def _split_block(block: nn.Module, found: FoundExperts, mesh: DeviceMesh, applied: AppliedExperts,
                 names: dict[int, str], check: bool, tolerance: float) -> None:
    for path, call in found.stacks.items():
        module = block.get_submodule(path)
        group = ExpertGroup(mesh, _divisible(names[id(module)], expert_count(module), mesh.size()))
        whole = layer_gradients(module, call.args, call.kwargs) if check else None
        split_stack(module, group, call.roles)
        if whole is not None:
            owned = slice(group.owned.start, group.owned.stop)
            _checked(names[id(module)], compare_split(module, call.args, call.kwargs, whole, lambda _: owned, group),
                     tolerance, applied)
        applied.groups[names[id(module)]] = group
        applied.units.append([module])
    for path, call in found.lists.items():
        experts, host = block.get_submodule(path), block.get_submodule(call.host)
        group = ExpertGroup(mesh, _divisible(names[id(experts)], len(experts), mesh.size()))
        whole = layer_gradients(host, call.args, call.kwargs) if check else None
        split_list(host, list(experts), group, call.output_tails)
        if whole is not None:
            prefix = f"{path[len(call.host) + 1:] if call.host else path}."
            _checked(names[id(experts)], compare_split(host, call.args, call.kwargs, whole,
                                                       lambda name: slice(None) if name.startswith(prefix) else None,
                                                       group), tolerance, applied)
        applied.groups[names[id(experts)]] = group
        applied.units.append([experts[i] for i in group.owned])


def _tolerance(block: nn.Module) -> float:
    # Sums over the ranks' tokens round in another order than one device's; a wrong split is off by O(1).
    dtype = next((p.dtype for p in block.parameters() if p.is_floating_point()), torch.float32)
    return 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2


def _divisible(name: str, count: int, ep: int) -> int:
    if count % ep:
        valid = [size for size in range(1, count + 1) if count % size == 0]
        raise ExpertSplitRefused(
            f"HybridStrategy(ep={ep}): '{name}' holds {count} experts, which {ep} ranks cannot share equally."
            f" Pass an ep that divides {count} (and the data-parallel degree): {valid}.")
    return count


def _checked(name: str, difference: float, tolerance: float, applied: AppliedExperts) -> None:
    applied.largest_difference, applied.checked = max(applied.largest_difference, difference), True
    if not difference <= tolerance:
        raise ExpertSplitRefused(
            f"HybridStrategy(ep=...): '{name}' split over the ep ranks computes another result than whole on the"
            f" first batch (largest relative difference {difference:.3g} > {tolerance:g}): its forward does more"
            " with the experts than weight and sum their outputs per token. Pass ep=1 to keep its experts on every"
            " rank.")
