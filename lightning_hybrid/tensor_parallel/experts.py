"""Tensor parallelism for mixture-of-experts layers that hold their experts as stacked 3-D weights.

A Hugging Face ``MixtralExperts`` (and its kin) keeps every expert's projections in one parameter
(``gate_up_proj``: ``(experts, 2 × hidden, width)``, ``down_proj``: ``(experts, width, hidden)``) and routes
tokens inside its forward. Each expert is an MLP, so it shards like one, Megatron-style: every rank keeps *all*
experts but only its slice of each expert's hidden width (its chunk of the gate half and of the up half of
``gate_up_proj``, the matching columns of ``down_proj``). Routing, expert indexing and token bookkeeping then run
unchanged on every rank, each rank's output is a partial sum, and one all-reduce completes it. The router is an
ordinary linear layer whose output does not feed a row layer, so the planner keeps it whole.

Experts with biases (GPT-OSS: ``gate_up_proj_bias``, ``down_proj_bias``) shard the first projection's bias with
its hidden width; the last projection's bias is added to every rank's partial sum, so it is kept whole and added
by one rank only (:data:`ONCE`; the others add zeros), its gradient summed over the ranks. Interleaved gate|up
columns (``gate_up[..., ::2]``, ``[..., 1::2]``) need nothing special: each rank's contiguous chunk holds whole
gate/up pairs.

Which dimension of each weight is the hidden width (and whether it holds two fused halves) is not written
anywhere; :func:`expert_layouts` lists the layouts the shapes allow and the planner keeps the first whose sharded
block computes what the unsharded one does. :func:`shard_experts` applies one: parameters become DTensors
(``Shard``/``StridedShard`` on the tensor mesh, so state dicts keep the unmodified layout) and the module's own
forward runs on the local shards.

Example::

    layouts = expert_layouts(block.mlp.experts, stream_widths={32}, tp=2)
    layouts[1]      # (("gate_up_proj", 1, 2), ("down_proj", 2, 1)): (parameter, dimension, fused pieces)
    shard_experts(block.mlp.experts, mesh, layouts[1])
"""

from __future__ import annotations

import itertools
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_hybrid._compat import StridedShard, tree_map
from lightning_hybrid.tensor_parallel.layers import forward_with, local_class

#: ``(parameter name, dimension sharded, number of fused pieces along it)`` for each parameter of the module.
ExpertLayout = tuple[tuple[str, int, int], ...]
#: The "dimension" of a stacked bias kept whole and added by the first tp rank only (a bias after the last
#: projection, added to partial sums).
ONCE = -1
#: Fused pieces a hidden dimension may hold: one projection, or gate|up concatenated.
_PIECES = (1, 2)


_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def holds_expert_stack(module: nn.Module) -> bool:
    """Whether ``module`` keeps experts stacked in its own ≥3-D parameters (a convolution's kernel is not: a
    state-space mixer's depthwise ``Conv1d``)."""
    return not isinstance(module, _CONVOLUTIONS) and any(p.dim() >= 3 for p in module.parameters(recurse=False))


def expert_layouts(module: nn.Module, stream_widths: set[int], tp: int) -> list[ExpertLayout]:
    """Every way to shard each of ``module``'s own parameters along one non-expert dimension that ``tp`` (times
    its fused pieces) divides, dimensions of another size than the model width (``stream_widths``) first: an
    expert's hidden width may equal the model's (Qwen3-MoE's small configurations), which the check then tells."""
    per_parameter = []
    for name, parameter in module.named_parameters(recurse=False):
        options = [(name, dim, pieces) for dim in range(1, parameter.dim()) for pieces in _PIECES
                   if parameter.shape[dim] % (tp * pieces) == 0]
        options.sort(key=lambda option: parameter.shape[option[1]] in stream_widths)
        if parameter.dim() == 2:  # a stacked bias: (experts, features)
            options.append((name, ONCE, 1))
        if not options:
            return []
        per_parameter.append(options)
    return list(itertools.product(*per_parameter))


def shard_experts(module: nn.Module, mesh: DeviceMesh, layout: ExpertLayout) -> None:
    """Shard ``module``'s parameters as ``layout`` says; its forward then runs on the local shards."""
    for name, dim, pieces in layout:
        placement = Replicate() if dim == ONCE else StridedShard(dim, split_factor=pieces) if pieces > 1 else Shard(dim)
        local = getattr(module, name).detach()
        setattr(module, name, nn.Parameter(distribute_tensor(local, mesh, [placement])))
    module.__class__ = local_class(type(module), "Experts", _local_forward)
    module.tp_sharded = tuple(name for name, _, _ in layout)
    module.tp_once = tuple(name for name, dim, _ in layout if dim == ONCE)


def _local_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """The module's own forward on local shards: inputs' gradients are partial sums over the ranks (each rank
    back-propagates through its slice of every expert), the output's partial sums are all-reduced."""
    mesh = self._parameters[self.tp_sharded[0]].device_mesh

    def partial_gradient(value: Any) -> Any:
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            return value
        return DTensor.from_local(value, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])

    def summed(value: Any) -> Any:
        if not (isinstance(value, Tensor) and value.is_floating_point()):
            return value
        return DTensor.from_local(value, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()

    first = float(mesh.get_local_rank() == 0)
    local = {name: self._parameters[name].to_local(grad_placements=[Partial()]) * first if name in self.tp_once
             else self._parameters[name].to_local() for name in self.tp_sharded}
    return tree_map(summed, forward_with(self, local, *tree_map(partial_gradient, (args, kwargs))))
