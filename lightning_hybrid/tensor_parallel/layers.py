"""Tensor-parallel layers torch's ``ParallelStyle``\\ s do not cover, computed on local shards.

* A **column** layer whose output rows are dealt in ``split_factor`` strided pieces (a fused q|k|v projection):
  DTensor's matmul rules do not keep strided placements, so the product is computed on the local shard. The
  weight is ``StridedShard`` on the tensor mesh (its ``full_tensor()`` is the original row order, so state dicts
  keep the unmodified module's layout); the bias is dealt the same way (its gradient needs no reduction), except
  under data-parallel sharding, where it stays whole and each rank picks its rows (:func:`replicate_fused_biases`).
* A linear layer stored **transposed** — weight ``(in, out)`` applied as ``x @ weight + bias``, as Hugging Face's
  ``Conv1D`` (GPT-2) does: column-parallel shards the weight's columns (``Shard(1)``, strided for a fused
  ``c_attn``), row-parallel its rows (``Shard(0)``) and all-reduces the partial products.

* A column layer whose pieces **cannot share one shard layout** — a fused q|k|v with fewer key/value heads than
  query heads (grouped-query attention), or fewer key/value heads than ranks: the weight stays whole on every
  rank (``Replicate``; FSDP2 still shards it over data-parallel ranks) and each rank computes the output rows it
  needs (its query heads and the key/value groups they attend to). Its gradient is declared ``Partial``: every
  rank's rows are summed over the tensor-parallel ranks, which is the full gradient.

In all of them, the input of a column layer is declared to have ``Partial`` gradients, so DTensor sums them over the
tensor-parallel ranks in backward; a row layer's output goes ``Partial`` → ``Replicate`` (one all-reduce), as in
torch's ``RowwiseParallel``. Each layer keeps its class (a subclass with this forward is swapped in), parameters
and names.

Example::

    shard_column(block.attn.c_attn, mesh, split_factor=3, transposed=True)   # GPT-2's fused q|k|v Conv1D
    shard_row(block.attn.c_proj, mesh, transposed=True)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from lightning_hybrid._compat import StridedShard


def shard_column(module: nn.Module, mesh: DeviceMesh, split_factor: int, transposed: bool,
                 reduce_input: bool = True) -> None:
    """Make ``module`` column-parallel on ``mesh``: each rank computes its output features (of every piece).
    ``reduce_input=False`` leaves the input's gradient this rank's part (summed where the input is produced)."""
    dim = 1 if transposed else 0
    placement = StridedShard(dim, split_factor=split_factor) if split_factor > 1 else Shard(dim)
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [placement]))
    if module.bias is not None:  # dealt like the weight's output rows: its gradient needs no reduction
        bias_placement = StridedShard(0, split_factor=split_factor) if split_factor > 1 else Shard(0)
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [bias_placement]))
    module.__class__ = local_class(type(module), "Column", _column_forward)
    module.tp_split_factor, module.tp_transposed, module.tp_reduce_input = split_factor, transposed, reduce_input


def select_rows(module: nn.Module, mesh: DeviceMesh, spans: tuple[tuple[int, int], ...], transposed: bool) -> None:
    """Make ``module`` compute only the output features ``spans`` on this rank, its weight kept whole."""
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Replicate()]))
    if module.bias is not None:
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [Replicate()]))
    module.__class__ = local_class(type(module), "Selected", _selected_forward)
    module.tp_spans, module.tp_transposed = spans, transposed


def shard_row(module: nn.Module, mesh: DeviceMesh, transposed: bool) -> None:
    """Make a transposed ``module`` row-parallel on ``mesh`` (standard ``nn.Linear`` rows use ``RowwiseParallel``)."""
    assert transposed, "nn.Linear rows are sharded with torch's RowwiseParallel"
    module.weight = nn.Parameter(distribute_tensor(module.weight.detach(), mesh, [Shard(0)]))
    if module.bias is not None:
        module.bias = nn.Parameter(distribute_tensor(module.bias.detach(), mesh, [Replicate()]))
    module.__class__ = local_class(type(module), "Row", _row_forward)


def sum_gradients(module: nn.Module, mesh: DeviceMesh) -> None:
    """Keep ``module``'s own parameters whole on every rank, their gradients (each rank's part) summed over
    ``mesh``: for a module computing where each rank back-propagates only its heads' share."""
    for name, parameter in list(module.named_parameters(recurse=False)):
        setattr(module, name, nn.Parameter(distribute_tensor(parameter.detach(), mesh, [Replicate()])))
    module.__class__ = local_class(type(module), "Summed", _summed_forward)


def _summed_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    local = {name: p.to_local(grad_placements=[Partial()]) for name, p in self._parameters.items() if p is not None}
    return forward_with(self, local, args, kwargs)


def forward_with(module: Any, parameters: dict[str, Tensor], args: tuple, kwargs: dict) -> Any:
    """The forward of ``module``'s own class (the one :func:`local_class` derived from) with the parameters
    ``parameters`` names (relative to ``module``: ``"A_log"``, ``"conv1d.weight"``) replaced by the given tensors
    (local shards), put back afterwards even if it raises (the plan check tries layouts that do)."""
    slots = {name: (module.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in parameters}
    held = {name: holder._parameters[leaf] for name, (holder, leaf) in slots.items()}
    try:
        for name, (holder, leaf) in slots.items():
            holder._parameters[leaf] = parameters[name]
        return super(type(module), module).forward(*args, **kwargs)
    finally:
        for name, (holder, leaf) in slots.items():
            holder._parameters[leaf] = held[name]


_LOCAL_CLASSES: dict[tuple[type, str], type] = {}


def local_class(cls: type, kind: str, forward: Callable[..., Any]) -> type:
    """The subclass of ``cls`` with ``forward`` (one per class and kind): swapped in as a module's ``__class__``, it
    keeps the module's parameters, names and ``isinstance`` while computing on local shards."""
    if (cls, kind) not in _LOCAL_CLASSES:
        _LOCAL_CLASSES[(cls, kind)] = type(f"{kind}Parallel{cls.__name__}", (cls,), {"forward": forward})
    return _LOCAL_CLASSES[(cls, kind)]


def _column_forward(self: Any, x: Tensor) -> Tensor:
    mesh = self.weight.device_mesh
    x_local = x if not self.tp_reduce_input else DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(
        grad_placements=[Partial()])
    weight, bias = self.weight.to_local(), _local_bias(self, mesh)
    if not self.tp_transposed:
        return F.linear(x_local, weight, bias)
    return _transposed_affine(x_local, weight, bias)


def _selected_forward(self: Any, x: Tensor) -> Tensor:
    mesh = self.weight.device_mesh
    x_local = DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])
    weight = _rows(self.weight.to_local(grad_placements=[Partial()]), self.tp_spans, dim=int(self.tp_transposed))
    bias = None if self.bias is None else _rows(self.bias.to_local(grad_placements=[Partial()]), self.tp_spans, 0)
    if not self.tp_transposed:
        return F.linear(x_local, weight, bias)
    return _transposed_affine(x_local, weight, bias)


def _rows(tensor: Tensor, spans: tuple[tuple[int, int], ...], dim: int) -> Tensor:
    return torch.cat([tensor.narrow(dim, start, stop - start) for start, stop in spans], dim=dim)


def _row_forward(self: Any, x: Tensor) -> Tensor:
    mesh = self.weight.device_mesh
    partial = _transposed_affine(x, self.weight.to_local(), None)
    out = DTensor.from_local(partial, mesh, [Partial()], run_check=False).redistribute(mesh, [Replicate()]).to_local()
    return out if self.bias is None else out + self.bias.to_local()


def replicate_fused_biases(root: nn.Module) -> None:
    """Keep each fused column layer's bias whole on every tensor-parallel rank (each picks its rows in forward, the
    gradient summed over the ranks: one small all-reduce per layer). For data-parallel sharding: torch 2.13's FSDP2
    cannot shard a 1-D tensor whose only dimension is already strided over tp (the nested strided placements
    gather the bias in the wrong order), where a 2-D weight is sharded along its other dimension instead."""
    for module in root.modules():
        bias = getattr(module, "bias", None)
        fused = getattr(module, "tp_split_factor", 1) > 1
        if fused and isinstance(bias, DTensor) and not bias.placements[0].is_replicate():
            whole = torch.empty(bias.shape, dtype=bias.dtype, device="meta") if bias.is_meta else bias.full_tensor()
            replicated = DTensor.from_local(whole.detach(), bias.device_mesh, [Replicate()], run_check=False)
            module.bias = nn.Parameter(replicated, requires_grad=bias.requires_grad)


def _local_bias(module: Any, mesh: DeviceMesh) -> Optional[Tensor]:
    if module.bias is None or not module.bias.placements[0].is_replicate():
        return None if module.bias is None else module.bias.to_local()
    rows = module.bias.to_local(grad_placements=[Partial()]).view(module.tp_split_factor, mesh.size(), -1)
    return rows[:, mesh.get_local_rank()].reshape(-1)


def _transposed_affine(x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
    """``x @ weight + bias`` over the last dimension, as Conv1D computes it (one ``addmm`` on 2-D views)."""
    flat = x.reshape(-1, x.shape[-1])
    out = torch.addmm(bias, flat, weight) if bias is not None else flat @ weight
    return out.view(*x.shape[:-1], weight.shape[-1])
