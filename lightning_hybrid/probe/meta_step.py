"""The setup probe's step on a meta-device model: what meta kernels cannot answer, answered for the record.

A model built on the meta device (``init="meta"``, ``weights=`` fine-tuning) is probed on meta tensors: shapes,
calls and phases are all the record needs. Two things a real device answers stop such a step:

* a Python value read from a tensor (``.item()``, ``bool(t)``): Hugging Face's mask code asks whether the batch
  holds packed sequences (``(mask[:, -1] == 0).all()``) whenever no cache is used. On meta there is no value: it
  reads as 0 (``False``) — the branch of a batch of plain, unpacked sequences, which is the one the step's data
  flow and shapes follow; a pipeline built from it is verified when the model has values
  (:mod:`lightning_hybrid.pipeline.verify`);
* ``torch._grouped_mm`` (Mixtral-style experts): its meta kernel accepts only 16-bit inputs, where the CPU kernel
  also takes float32; it runs on 16-bit copies of the inputs and gives the output in their dtype.

Example::

    with meta_step():
        module.training_step(meta_batch, 0)
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hybrid._compat import TorchDispatchMode, tree_flatten, tree_map

_aten = torch.ops.aten


class meta_step(TorchDispatchMode):  # noqa: N801 - used as a context manager, like torch's modes
    """Within it, meta tensors answer value reads with 0 and run ``_grouped_mm`` on any float dtype."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors or not all(t.is_meta for t in tensors):
            return func(*args, **kwargs)
        if func is _aten._local_scalar_dense.default:
            return False if args[0].dtype == torch.bool else 0
        if func is _aten._grouped_mm.default and any(t.dtype == torch.float32 for t in tensors):
            dtype = tensors[0].dtype
            half = tree_map(lambda v: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                            else v, (args, kwargs))
            return func(*half[0], **half[1]).to(dtype)
        return func(*args, **kwargs)
