"""Count what one training step does on this rank: model FLOPs and bytes moved by each kind of collective.

:class:`StepCounter` is a ``TorchDispatchMode``: it sees every aten operation
the rank runs, including DTensor operations (at their global shapes, before DTensor turns them into local ones)
and the ``c10d`` / functional collectives that FSDP2, tensor parallelism and the pipeline's send/receive issue.

* **Model FLOPs** follow the usual definition (PaLM's MFU): the FLOPs the model needs, not the ones the hardware
  ran. Only forward operations are counted, with torch's own FLOP formulas
  (:data:`torch.utils.flop_counter.flop_registry`), and the total is tripled for forward + backward. Operations run
  by autograd's engine (backward, and the recomputation of activation checkpointing) are not counted; neither are
  meta-device operations (the pipeline's parameter-free stand-ins for other stages). Summed over all ranks, every
  operation of the model is counted once whatever the layout: a DTensor operation is computed jointly by the
  ranks of its mesh, so each counts ``1 / mesh size`` of it; an operation on a parameter that every
  tensor-parallel rank holds whole (an LM head left unsharded) is repeated by each of the ``tensor_parallel``
  ranks, so each counts ``1 / tensor_parallel``. Operations on activations alone (attention on this rank's heads)
  count fully — an attention that tensor parallelism left replicated would be counted once per tensor-parallel
  rank.
* **Communication** is counted in bytes of the full tensor each collective works on (the gathered output of an
  all-gather, the input of a reduce-scatter, the tensor of an all-reduce, broadcast, send or receive).

Example::

    with StepCounter(module, tensor_parallel=2) as counter:
        loss = model(batch).sum()
        loss.backward()
    counter.model_flops          # 3 × forward FLOPs of this rank's share
    counter.comm_bytes           # {"all_gather": ..., "reduce_scatter": ..., ...}
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.flop_counter import flop_registry

from lightning_hybrid._compat import TorchDispatchMode, in_autograd_engine, tree_flatten

#: aten collective → collective type, for the c10d ops (process-group API) and the functional ones (DTensor).
COLLECTIVE_TYPES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "allgather_": "all_gather",
    "_allgather_base_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "send": "send",
    "recv_": "recv",
    "recv_any_source_": "recv",
    "alltoall_": "all_to_all",
    "alltoall_base_": "all_to_all",
    "all_to_all_single": "all_to_all",
}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional"}


class StepCounter(TorchDispatchMode):
    """Counts model FLOPs and collective bytes of the operations run while it is active (see the module doc)."""

    def __init__(self, module: Optional[nn.Module] = None, tensor_parallel: int = 1) -> None:
        super().__init__()
        self.forward_flops = 0.0
        self.comm_bytes: dict[str, int] = defaultdict(int)
        self.comm_calls: dict[str, int] = defaultdict(int)
        self._module = module
        self._tensor_parallel = tensor_parallel
        # Storages of whole (not tensor-parallel) parameters while their module runs: FSDP2 gathers parameters into
        # new storage for each forward and frees it after, so they are noted in forward pre-hooks and dropped after.
        self._replicated_storages: set[int] = set()
        self._hooks: list[Any] = []

    def __enter__(self) -> "StepCounter":
        if self._module is not None and self._tensor_parallel > 1:
            for module in self._module.modules():
                # Checked when the module runs: outside forward, FSDP2 shows even whole parameters as DTensors.
                if any(True for _ in module.parameters(recurse=False)):
                    self._hooks.append(module.register_forward_pre_hook(self._note_replicated))
                    self._hooks.append(module.register_forward_hook(self._forget_replicated, always_call=True))
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        super().__exit__(*args)

    def _note_replicated(self, module: nn.Module, args: Any) -> None:
        for parameter in module.parameters(recurse=False):
            if not isinstance(parameter, DTensor) and parameter.device.type != "meta":
                self._replicated_storages.add(parameter.untyped_storage().data_ptr())

    def _forget_replicated(self, module: nn.Module, args: Any, output: Any) -> None:
        for parameter in module.parameters(recurse=False):
            if not isinstance(parameter, DTensor) and parameter.device.type != "meta":
                self._replicated_storages.discard(parameter.untyped_storage().data_ptr())

    @property
    def model_flops(self) -> float:
        """Forward + backward model FLOPs of this rank's share: 3 × forward (backward costs twice the forward)."""
        return 3.0 * self.forward_flops

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        packet = func.overloadpacket
        if func.namespace in _COLLECTIVE_NAMESPACES:
            kind = COLLECTIVE_TYPES.get(packet.__name__)
            if kind is not None:
                self.comm_bytes[kind] += _collective_bytes(args, kwargs, out)
                self.comm_calls[kind] += 1
        elif packet in flop_registry and _counts_as_model_forward(args, out):
            flops = flop_registry[packet](*args, **kwargs, out_val=out)
            self.forward_flops += flops / self._ranks_sharing(args)
        return out

    def _ranks_sharing(self, args: tuple) -> int:
        """How many ranks compute this operation together (see the module doc)."""
        tensors = [value for value in tree_flatten(args)[0] if isinstance(value, torch.Tensor)]
        for tensor in tensors:
            if isinstance(tensor, DTensor):
                return tensor.device_mesh.size()
        if any(tensor.untyped_storage().data_ptr() in self._replicated_storages for tensor in tensors):
            return self._tensor_parallel
        return 1


def _counts_as_model_forward(args: tuple, out: Any) -> bool:
    if in_autograd_engine():  # backward, or a checkpoint's recomputation
        return False
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return bool(tensors) and tensors[0].device.type != "meta"


def _collective_bytes(args: tuple, kwargs: dict, out: Any) -> int:
    """Bytes of the largest tensor argument (a list counts as one), or of the result: the full tensor the collective
    works on, whichever side of it the operation's signature puts first."""
    candidates = list(args) + list(kwargs.values()) + [out]
    largest = 0
    for candidate in candidates:
        tensors = [t for t in tree_flatten(candidate)[0] if isinstance(t, torch.Tensor)]
        largest = max(largest, sum(t.numel() * t.element_size() for t in tensors))
    return largest
