"""Initialize a meta-device model after it is sharded: every rank fills only the shards it keeps, and the result
equals initializing the whole model on one device with the same seed.

How: deterministic per-module initialization. Each module that holds parameters or buffers is initialized by its
own ``reset_parameters()`` (torch's convention, which Lightning's own meta-device support also relies on) under a
random seed derived from the run's seed and the module's name in the LightningModule, on full-size temporary
tensors; each rank then copies out the slices its DTensor shards hold and drops the temporaries. So:

* the values do not depend on the layout, the rank, the pipeline stage or the order modules are visited in —
  dp, tp and pp runs, and a single device calling :func:`init_weights`, produce the same numbers;
* no rank ever holds the whole model: beyond its own shards, a rank holds the full tensors of one module at a
  time, and only for modules of its own pipeline stages;
* nothing is communicated (each rank computes the same full tensor and keeps its part).

Why not a seed checkpoint (initialize once on one host, save, load sharded)? It needs one host that can hold the
whole model and an extra offline step; per-module seeds need neither. The price: a meta-device model's values
are not the draws an eager ``__init__`` would have made after ``torch.manual_seed(seed)`` (same distributions,
different draws, because eager construction draws from one stream in construction order). Models built eagerly
in ``__init__`` are not re-initialized: they keep their own values.

A module that holds parameters or buffers but has no ``reset_parameters()`` cannot be initialized from the meta
device (its values, e.g. ``torch.ones`` of a norm scale, existed only in the constructor that ran on meta); the
strategy stops with the modules' names instead of training on uninitialized memory.

Example::

    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    init_weights(model, seed=42)     # what every HybridStrategy layout gives a meta-device GPT after seed 42
"""

from __future__ import annotations

import zlib
from typing import Iterator, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate


def module_seed(seed: int, module_name: str) -> int:
    """The random seed module ``module_name`` is initialized with: a function of the run's seed and the name only,
    so no other module's size or position shifts it."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % 2**63


def init_weights(root: nn.Module, seed: int) -> None:
    """Initialize the parameters and buffers of every module under ``root`` that holds some, each by its own
    ``reset_parameters()`` under :func:`module_seed`. Works on plain tensors and on sharded DTensors (FSDP2,
    tensor parallel) alike; names are taken relative to ``root``.

    Raises:
        ValueError: if a module holding parameters or buffers has no ``reset_parameters()``.
    """
    holders = [(name, module) for name, module in root.named_modules() if _holds_tensors(module)]
    uninitializable = sorted({type(m).__name__ for _, m in holders if not callable(getattr(m, "reset_parameters", None))})
    if uninitializable:
        raise ValueError(
            f"The model was created on the meta device, but {', '.join(uninitializable)} hold(s) parameters or"
            " buffers and define(s) no reset_parameters(), so their initial values cannot be recreated after"
            " sharding. Give each of these classes a reset_parameters() that initializes its own parameters and"
            " buffers (as torch.nn.Linear does), or build the model eagerly in the LightningModule's __init__."
        )
    for name, module in holders:
        _init_module(module, module_seed(seed, name))


def materialize_meta_module(root: nn.Module, device: Union[str, torch.device], seed: int) -> bool:
    """Allocate ``root``'s meta-device parameters and buffers (each rank's shards only) on ``device`` and
    initialize them with :func:`init_weights`. Returns ``False`` (and does nothing) for a model without meta
    tensors."""
    if not any(t.is_meta for t in _tensors(root)):
        return False
    root.to_empty(device=device)
    init_weights(root, seed)
    return True


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in _own_tensors(module))


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The module's own (not its children's) parameters and buffers, by attribute name."""
    yield from module.named_parameters(recurse=False)
    yield from module.named_buffers(recurse=False)


@torch.no_grad()
def _init_module(module: nn.Module, seed: int) -> None:
    """Run ``module.reset_parameters()`` on full-size stand-ins of its own tensors, then keep each rank's part."""
    originals = dict(_own_tensors(module))
    for key, original in originals.items():
        full = torch.empty(original.shape, dtype=original.dtype, device=_local(original).device)
        # setattr replaces a registered parameter or buffer in place (same name, same kind)
        setattr(module, key, nn.Parameter(full, original.requires_grad) if isinstance(original, nn.Parameter) else full)
    devices = [d.index for d in {_local(t).device for t in originals.values()} if d.type == "cuda"]
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            module.reset_parameters()  # type: ignore[operator]
        initialized = {key: getattr(module, key) for key in originals}
    finally:
        for key, original in originals.items():
            setattr(module, key, original)
    for key, original in originals.items():
        _local(original).copy_(_keep_local_part(initialized[key], original))


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _keep_local_part(full: Tensor, like: Tensor) -> Tensor:
    """The part of ``full`` that ``like`` holds on this rank (all of it for a plain tensor). Every rank holds the
    same ``full``, so going from replicated to ``like``'s placements only slices locally."""
    if not isinstance(like, DTensor):
        return full
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()
