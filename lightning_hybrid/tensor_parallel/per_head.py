"""Parameters that hold one value (or one table column) per attention head, sharded with the heads.

Some attention layers learn something per head next to their projections: GPT-OSS's attention sinks (a logit per
head, ``sinks: (heads,)``), Swin's relative position table (``(positions, heads)``), T5's relative attention bias
(an embedding of ``heads`` features). When the projections are sharded by heads, each rank computes its heads only,
so such a parameter must be too: :func:`per_head_parameters` finds them by shape — exactly one dimension equal to a
head count the pair group splits — and :func:`shard_per_head` shards that dimension (``Shard(dim)`` on the tensor
mesh) and runs the module holding it on its local slice, as :mod:`.experts` does for stacked experts. Whether the
module really reads the parameter per head is the plan check's to say; the same layout without them is tried next.

Example::

    per_head_parameters(block, owner="attention", heads={4}, tp=2, skip=set(trace.linears))
    # [("attention.relative_position_bias", "relative_position_bias_table", 1)]
    shard_per_head(block.get_submodule("attention.relative_position_bias"), {"relative_position_bias_table": 1}, mesh)
"""

from __future__ import annotations

from typing import Any, Collection, Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_hybrid.tensor_parallel.dataflow import BlockTrace
from lightning_hybrid.tensor_parallel.layers import forward_with, local_class

#: ``(holder module path, parameter name, dimension)`` of a per-head parameter.
PerHead = tuple[str, str, int]


def head_counts(trace: BlockTrace) -> set[int]:
    """The head counts the block's forward reshapes its linear layers' outputs into."""
    return {cut.factors[-2] for cut in trace.cuts if len(cut.factors) > 1}


def holds_tables_per_head(module: nn.Module, heads: Collection[int]) -> bool:
    """Whether each of ``module``'s own matrix parameters has a dimension of a head count (a table per head, not
    an unknown matrix the planner must refuse)."""
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    return bool(own) and all(any(size in heads for size in p.shape) for p in own)


def per_head_parameters(block: nn.Module, owner: str, heads: Collection[int], tp: int,
                        skip: Collection[str]) -> list[PerHead]:
    """Parameters under ``owner`` (modules not in ``skip``: the group's linear layers, experts, the user's entries)
    with exactly one dimension whose size is one of ``heads`` that ``tp`` divides."""
    counts = {count for count in heads if count % tp == 0 and count > 1}
    found = []
    for path, module in _under(block, owner):
        if path in skip or isinstance(module, nn.Linear):
            continue
        for name, parameter in module.named_parameters(recurse=False):
            dims = [dim for dim, size in enumerate(parameter.shape) if size in counts]
            if len(dims) == 1:
                found.append((path, name, dims[0]))
    return found


def _under(block: nn.Module, owner: str) -> Iterable[tuple[str, nn.Module]]:
    for path, module in block.named_modules():
        if not owner or path == owner or path.startswith(owner + "."):
            yield path, module


def shard_per_head(module: nn.Module, dims: dict[str, int], mesh: DeviceMesh) -> None:
    """Shard ``module``'s parameters ``dims`` names along their head dimension; its forward then reads this rank's
    heads (gradients flow to the shards)."""
    for name, dim in dims.items():
        setattr(module, name, nn.Parameter(distribute_tensor(getattr(module, name).detach(), mesh, [Shard(dim)])))
    module.__class__ = local_class(type(module), "PerHead", _local_forward)
    module.tp_per_head = tuple(dims)


def _local_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    return forward_with(self, {name: self._parameters[name].to_local() for name in self.tp_per_head}, args, kwargs)
