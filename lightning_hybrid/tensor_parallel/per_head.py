"""Parameters that hold one value (or one table column) per attention head or per channel, sharded with them.

Some attention layers learn something per head next to their projections: GPT-OSS's attention sinks (a logit per
head, ``sinks: (heads,)``), Swin's relative position table (``(positions, heads)``), T5's relative attention bias
(an embedding of ``heads`` features). A state-space mixer holds its scan's parameters per channel of its inner
dimension (Mamba's depthwise ``conv1d``, ``A_log``, ``D``, ``dt_proj``: "heads" of one feature each). When the
projections are sharded by heads (channels), each rank computes its heads only, so such a parameter must be too:
:func:`per_head_parameters` finds them by shape — exactly one dimension equal to a head (channel) count the pair
group splits — and :func:`shard_per_head` shards that dimension (``Shard(dim)`` on the tensor mesh) and runs the
module that reads it on its local slice, as :mod:`.experts` does for stacked experts. That is the module holding it
when the forward calls that module, else the pair group's owner (Mamba reads ``conv1d.weight`` and
``dt_proj.weight`` in the mixer's forward without calling them). A depthwise convolution called as a module also
computes with its per-rank channel count as ``groups``. Whether the module really reads the parameter per head
is the plan check's to say; the same layout without them is tried next.

Example::

    per_head_parameters(block, owner="attention", heads={4}, tp=2, skip=set(trace.linears), called={...})
    # [("attention.relative_position_bias", "relative_position_bias_table", 1)]
    shard_per_head(block.get_submodule("attention.relative_position_bias"), {"relative_position_bias_table": 1}, mesh)
    shard_per_head(block.get_submodule("mixer"), {"A_log": 0, "conv1d.weight": 0, "dt_proj.weight": 0}, mesh)
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Collection, Iterable, Iterator

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_hybrid.tensor_parallel.dataflow import BlockTrace
from lightning_hybrid.tensor_parallel.layers import forward_with, local_class

#: ``(holder module path, parameter name, dimension)`` of a per-head parameter.
PerHead = tuple[str, str, int]


def head_counts(trace: BlockTrace) -> set[int]:
    """The head counts the block's forward reshapes its linear layers' outputs into."""
    return {cut.factors[-2] for cut in trace.cuts if len(cut.factors) > 1}


def channel_counts(trace: BlockTrace, linears: Iterable[str]) -> set[int]:
    """Output widths (of each piece) of ``linears`` whose features the forward never reshapes into heads: channels,
    each its own head of one feature (a state-space mixer's inner dimension)."""
    counts: set[int] = set()
    for name in linears:
        cuts = [cut for cut in trace.cuts if cut.linear == name]
        if not any(len(cut.factors) > 1 for cut in cuts):
            counts |= set(next((cut.pieces for cut in cuts if cut.pieces), ())) or {trace.linears[name].out_features}
    return counts


def holds_tables_per_head(module: nn.Module, heads: Collection[int]) -> bool:
    """Whether each of ``module``'s own matrix parameters has exactly one dimension of a head (channel) count (a
    table per head, not an unknown matrix the planner must refuse)."""
    own = [p for p in module.parameters(recurse=False) if p.dim() >= 2]
    return bool(own) and all(sum(size in heads for size in p.shape) == 1 for p in own)


def per_head_parameters(block: nn.Module, owner: str, heads: Collection[int], tp: int, skip: Collection[str],
                        called: Collection[str]) -> list[PerHead]:
    """Parameters under ``owner`` (modules not in ``skip``: the group's linear layers, experts, the user's entries)
    with exactly one dimension whose size is one of ``heads`` that ``tp`` divides, each named relative to the module
    whose forward reads it: its holder if that is in ``called`` (modules the block's forward calls), else
    ``owner``."""
    counts = {count for count in heads if count % tp == 0 and count > 1}
    found = []
    for path, module in _under(block, owner):
        if path in skip:
            continue
        site = path if path in called else owner
        prefix = path[len(site):].lstrip(".")
        for name, parameter in module.named_parameters(recurse=False):
            dims = [dim for dim, size in enumerate(parameter.shape) if size in counts]
            if len(dims) == 1:
                found.append((site, f"{prefix}.{name}" if prefix else name, dims[0]))
    return found


def is_under(path: str, owner: str) -> bool:
    """Whether module ``path`` is ``owner`` or inside it (``""``: the block, which holds everything)."""
    return not owner or path == owner or path.startswith(owner + ".")


def _under(block: nn.Module, owner: str) -> Iterable[tuple[str, nn.Module]]:
    return ((path, module) for path, module in block.named_modules() if is_under(path, owner))


def shard_per_head(module: nn.Module, dims: dict[str, int], mesh: DeviceMesh) -> None:
    """Shard the parameters ``dims`` names (relative to ``module``) along their head dimension; ``module``'s forward
    then reads this rank's heads (gradients flow to the shards)."""
    for name, dim in dims.items():
        holder_path, _, leaf = name.rpartition(".")
        holder = module.get_submodule(holder_path)
        setattr(holder, leaf, nn.Parameter(distribute_tensor(getattr(holder, leaf).detach(), mesh, [Shard(dim)])))
    module.__class__ = local_class(type(module), "PerHead", _local_forward)
    module.tp_per_head = tuple(dims)


def _local_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    local = {name: self.get_parameter(name).to_local() for name in self.tp_per_head}
    with _depthwise_groups_per_rank(self, local):
        return forward_with(self, local, args, kwargs)


@contextmanager
def _depthwise_groups_per_rank(module: nn.Module, local: dict[str, Tensor]) -> Iterator[None]:
    """A depthwise convolution (one group per channel) whose weight is sharded computes with this rank's channel
    count as its ``groups`` (and channel counts) while ``module`` runs."""
    changed = []
    for name, tensor in local.items():
        holder = module.get_submodule(name.rpartition(".")[0])
        if isinstance(holder, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and name.endswith("weight") \
                and holder.groups == holder.in_channels == holder.out_channels != tensor.shape[0]:
            changed.append((holder, holder.groups))
            holder.groups = holder.in_channels = holder.out_channels = tensor.shape[0]
    try:
        yield
    finally:
        for holder, channels in changed:
            holder.groups = holder.in_channels = holder.out_channels = channels
