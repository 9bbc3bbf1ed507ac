"""The norm of every gradient of a parallel model, and clipping by it: over every device mesh and pipeline stage.

Tensor-parallel parameters are DTensors on the data × tensor mesh while the rest live on the data mesh only, and
``torch.nn.utils.clip_grad_norm_`` refuses to combine norms from different meshes (torch issue 180346), so
:func:`total_grad_norm` computes one norm per mesh and combines them, then over the pipeline's stages. The norm stays
on the device from the per-mesh norms through the pipeline's all-reduce (on the strategy's ``device``) to the
scaling: clipping never waits for the device. The precision plugins clip with it
(:mod:`lightning_hybrid.glue.precision`), the monitor logs it.

Example::

    norm = total_grad_norm(module.parameters(), pipeline_group=pp_mesh.get_group(), device=torch.device("cuda", 0))
    clip_grad_norm_(module.parameters(), 1.0, pipeline_group=pp_mesh.get_group(), device=torch.device("cuda", 0))
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import MappingProxyType
from typing import Container, Iterable, Mapping, Optional

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def total_grad_norm(
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, pipeline_group: Optional[dist.ProcessGroup] = None,
    counted_elsewhere: Container[int] = (), device: Optional[torch.device] = None,
    spread: Mapping[int, dist.ProcessGroup] = MappingProxyType({}),
) -> torch.Tensor:
    """The ``norm_type`` norm of all gradients of the model, over every mesh (and pipeline stage): a scalar tensor
    on the gradients' device, on ``device`` when it is combined over ``pipeline_group``. Nothing here reads a value
    back to the host (``float(norm)`` does: call it only where the number is needed, e.g. logging).

    Works when parameters are spread over several device meshes (and plain tensors): the per-mesh norms are
    computed by DTensor, which reduces over each mesh, and combined here. With pipeline stages, each rank holds
    other parameters, so the norms of all ranks of ``pipeline_group`` are combined too, on ``device``: pass the
    device the strategy computes on, the one its collectives need (NCCL refuses a CPU tensor), which a rank
    holding no gradient (a frozen stage) or holding them in CPU memory (offload) cannot tell from its gradients.
    Every rank of the mesh must call it (it communicates). A parameter held by several stages (a tied weight)
    counts once: the ranks that do not count it pass its ``id`` in ``counted_elsewhere``. ``spread``: ``id`` of a
    parameter → the group of ranks holding the others of its set (experts spread whole over the ep ranks), over
    which the norms of such parameters add up.

    Example::

        norm = total_grad_norm(module.parameters(), pipeline_group=pp_mesh.get_group(), device=torch.device("cuda", 0))
    """
    with_grads = [p for p in parameters if p.grad is not None and id(p) not in counted_elsewhere]
    here = with_grads[0].grad.device if with_grads else device or torch.device("cpu")
    norms = []
    for (_, spread_over), group in _by_mesh(with_grads, spread).items():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=norm_type)
        norm = (norm.full_tensor() if isinstance(norm, DTensor) else norm).float().to(here)
        norms.append(norm if spread_over is None else _combine_over_ranks(norm, norm_type, spread_over))
    total = torch.linalg.vector_norm(torch.stack(norms), ord=norm_type) if norms else torch.zeros((), device=here)
    if pipeline_group is not None:  # a no-op move on the compute device; offloaded (CPU) gradients' norm goes there
        total = _combine_over_ranks(total.to(device or here), norm_type, pipeline_group)
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    pipeline_group: Optional[dist.ProcessGroup] = None,
    counted_elsewhere: Container[int] = (),
    device: Optional[torch.device] = None,
    spread: Mapping[int, dist.ProcessGroup] = MappingProxyType({}),
) -> torch.Tensor:
    """Clip gradients in place to a total ``norm_type`` norm of ``max_norm``; returns the total norm
    (:func:`total_grad_norm`). The scaling runs where the gradients are: no host synchronization.

    Example::

        clip_grad_norm_(module.parameters(), 1.0, pipeline_group=pp_group, device=strategy.root_device)
    """
    parameters = list(parameters)
    total = total_grad_norm(parameters, norm_type, pipeline_group, counted_elsewhere, device, spread)
    for group in _by_mesh([p for p in parameters if p.grad is not None], spread).values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total.to(group[0].grad.device))
    return total


def _by_mesh(parameters: list[torch.Tensor],
             spread: Mapping[int, dist.ProcessGroup]) -> dict[tuple[object, object], list[torch.Tensor]]:
    """Parameters by their gradients' mesh, and by the group of ranks holding other such parameters whose norms
    add to theirs (``spread``: experts that expert parallelism spread whole over ranks)."""
    by_mesh: dict[tuple[object, object], list[torch.Tensor]] = defaultdict(list)
    for parameter in parameters:
        grad = parameter.grad
        key = (grad.device_mesh if isinstance(grad, DTensor) else None, spread.get(id(parameter)))
        by_mesh[key].append(parameter)
    return by_mesh


def _combine_over_ranks(local: torch.Tensor, norm_type: float, group: dist.ProcessGroup) -> torch.Tensor:
    """Every stage's norm combined; ``local`` stays on its device (the collective's), so the host never waits."""
    if math.isinf(norm_type):
        combined = local.clone()
        dist.all_reduce(combined, op=dist.ReduceOp.MAX, group=group)
        return combined
    powered = local.double() ** norm_type  # double: the sum must not round differently per stage count
    dist.all_reduce(powered, group=group)
    return (powered ** (1.0 / norm_type)).float()
