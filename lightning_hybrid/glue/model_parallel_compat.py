"""LightningModules written for Lightning's ``ModelParallelStrategy`` run unchanged under ``HybridStrategy``.

Lightning's contract: the module's ``configure_model`` reads ``self.device_mesh``, a 2-D mesh named
``("data_parallel", "tensor_parallel")``, and applies tensor parallelism and FSDP2 itself. ``HybridStrategy`` tells
such a module from one it should parallelize by what the module reads:

1. When processes start, ``self.device_mesh`` is that 2-D mesh (:func:`~lightning_hybrid.mesh.lightning_view`),
   watched (:func:`watch_reads`). With ``tp``/``pp="auto"`` it is built with Lightning's meaning of ``"auto"``
   (:func:`mesh_degrees`), because no layout can be chosen before the model exists.
2. At the strategy's setup, after the module's ``setup`` and ``configure_model`` hooks:
   a module that read the mesh, or that applied FSDP2 / DTensor parallelism some other way, parallelizes itself
   (:func:`parallelizes_itself`): the strategy applies nothing but materialization and precision, needs no block
   list, keeps the degrees the module saw, and the module keeps Lightning's mesh.
   Any other module is parallelized by the strategy (with ``"auto"``, the layout is chosen now and the mesh built
   again) and from then on sees the full mesh with this package's names ``pp, dp_replicate, dp_shard, tp``.

The watched mesh is an ordinary ``DeviceMesh`` whose class is swapped for a subclass that notes attribute reads
until setup: slicing it, asking its size or names, or passing it to torch all count as reading it; storing it or
``isinstance`` checks do not.

Example::

    class Model(LightningModule):          # written for ModelParallelStrategy
        def configure_model(self):
            parallelize_module(self.model, self.device_mesh["tensor_parallel"], plan)
            fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

    Trainer(devices=4, strategy=HybridStrategy(dp="auto", tp="auto"))   # ≡ ModelParallelStrategy(): tp=4, dp=1
"""

from __future__ import annotations

import math
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_info, rank_zero_warn
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from lightning_hybrid.mesh import ParallelDims
from lightning_hybrid.options.hybrid_options import AUTO, Degree, HybridOptions
from lightning_hybrid.parallel.parallelize import apply_materialization

_READ = "_hybrid_strategy_mesh_read"


def mesh_degrees(options: HybridOptions, world_size: int, devices_per_node: int) -> dict[str, Degree]:
    """The degrees of the mesh built when processes start. Fixed ones as given; with ``tp``/``pp="auto"``, Lightning's
    meaning: ``pp`` 1 (what fixed ``dp`` and ``tp`` leave, if both are), ``tp`` what a fixed ``dp`` leaves, else one
    node's devices (ModelParallelStrategy's default: tensor parallelism within a node, data parallelism across
    nodes). ``dp="auto"`` takes the rest."""
    if not options.chooses_layout:  # ep is checked against the layout chosen at setup with tp/pp="auto"
        return {**options.degrees, "ep": options.ep, "cp": options.cp}
    if options.pp != AUTO:
        pp = int(options.pp)
    elif AUTO not in (options.dp, options.tp):  # both fixed: the pipeline is what they leave, not Lightning's 1
        pp = world_size // (int(options.dp) * int(options.tp) * options.dp_replicate)
    else:
        pp = 1
    rest = world_size // (pp * options.dp_replicate)
    if options.tp != AUTO:
        tp = int(options.tp)
    elif options.dp != AUTO:
        tp = rest // int(options.dp)
    else:
        tp = math.gcd(devices_per_node, rest)
    return {"dp": options.dp, "tp": tp, "pp": pp, "dp_replicate": options.dp_replicate}


def keep_given_degrees(options: HybridOptions, dims: ParallelDims | None) -> HybridOptions:
    """For a module that parallelizes itself: ``options`` with ``"auto"`` resolved to the degrees of the mesh it was
    given (Lightning's meaning; no layout is chosen)."""
    if not options.chooses_layout or dims is None:
        return options
    return options.with_degrees(int(dims.dp), dims.tp, dims.pp, dims.dp_replicate)


class _WatchedMesh(DeviceMesh):
    """A ``DeviceMesh`` that notes that it was used (see :func:`watch_reads`)."""

    def __getattribute__(self, name: str) -> Any:
        # Any use reads an attribute (slicing reads the dimension names). Dunder names are not counted:
        # ``isinstance`` against other classes reads ``__class__``, as nn.Module does for every attribute set.
        if not name.startswith("__"):
            object.__getattribute__(self, "__dict__")[_READ] = True
        return super().__getattribute__(name)


def watch_reads(mesh: DeviceMesh) -> DeviceMesh:
    """``mesh`` itself, noting from now on whether anything uses it, until :func:`stop_watching`."""
    mesh.__class__ = _WatchedMesh
    return mesh


def stop_watching(mesh: DeviceMesh | None) -> bool:
    """Make a watched ``mesh`` an ordinary ``DeviceMesh`` again; returns whether it was used meanwhile."""
    if type(mesh) is not _WatchedMesh:
        return False
    mesh.__class__ = DeviceMesh  # assigning __class__ does not go through __getattribute__
    return bool(mesh.__dict__.pop(_READ, False))


def parallelizes_itself(module: nn.Module, read_mesh: bool, data_parallel_size: int) -> bool:
    """Whether ``module`` applies its own parallelism: it read ``self.device_mesh`` before the strategy's setup
    (Lightning's contract), or FSDP2 / DTensor parallelism is already applied."""
    if already_parallel(module):
        return True
    if read_mesh:
        rank_zero_info("HybridStrategy: the LightningModule read self.device_mesh before setup, so it applies its"
                       " own parallelism (Lightning's ModelParallelStrategy contract); the strategy applies none.")
        if data_parallel_size > 1:
            rank_zero_warn(f"The LightningModule read self.device_mesh but applied neither FSDP2 nor tensor"
                           f" parallelism: each of the {data_parallel_size} data-parallel ranks trains its own"
                           f" copy, gradients unsynchronized (as under ModelParallelStrategy). Apply fully_shard over"
                           f" self.device_mesh['data_parallel'], or do not read the mesh and let HybridStrategy"
                           f" parallelize the model.")
    return read_mesh


def already_parallel(module: nn.Module) -> bool:
    """True if the module applied FSDP2 or tensor parallelism itself (Lightning's ModelParallel style)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def accept_user_parallelism(module: nn.Module, options: HybridOptions, device: torch.device) -> None:
    """For a module that parallelizes itself (see :mod:`lightning_hybrid.glue.model_parallel_compat`): apply nothing but
    materialization, and refuse the options only :func:`parallelize` can apply."""
    if options.cp != 1:
        # The context-parallel plan is checked on the unmodified blocks and wraps them; a module that shards
        # itself has already replaced them.
        raise ValueError(
            f"HybridStrategy(cp={options.cp!r}) splits the blocks of a model the strategy parallelizes, but the"
            " LightningModule parallelizes itself (its configure_model/setup read self.device_mesh, or applied"
            " FSDP2/tensor parallelism). Use cp=1 with it, or leave parallelism to HybridStrategy."
        )
    if options.pp != 1:
        # The split traces and cuts the unmodified model; FSDP2 roots and DTensors applied over the whole model
        # cannot be taken apart into stages afterwards.
        raise ValueError(
            f"HybridStrategy(pp={options.pp!r}) splits a model the strategy parallelizes, but the LightningModule"
            " parallelizes itself (its configure_model/setup read self.device_mesh, or applied FSDP2/tensor"
            " parallelism). Use pp=1 with it, or leave parallelism to HybridStrategy: do not read"
            " self.device_mesh nor call fully_shard/parallelize_module there."
        )
    if (options.offload or options.checkpointing is not None or options.compile_arguments is not None
            or options.loss_parallel):
        raise ValueError(
            "HybridStrategy(offload=, activation_checkpointing=, compile=, loss_parallel=) are applied while the"
            " strategy shards the model, but the LightningModule parallelizes itself (its configure_model/setup"
            " read self.device_mesh, or applied FSDP2/tensor parallelism). Either let the strategy parallelize"
            " (build the model in configure_model without reading the mesh or calling"
            " fully_shard/parallelize_module) or pass offload_policy=CPUOffloadPolicy() to your fully_shard calls,"
            " checkpoint (and compile) your blocks there, and compute your loss inside torch's loss_parallel()."
        )
    rank_zero_info("HybridStrategy: the LightningModule parallelizes itself; applying nothing more.")
    apply_materialization(module, device)
