"""Every private torch and Lightning name the package relies on, each with the reason no public API serves.

No module outside this package imports an underscore name of torch or Lightning or reads an underscore attribute
of an object it does not own; when a public API appears, the change is made here. Those of torch's pipelining live
in :mod:`lightning_hybrid._compat.pipelining`. Heavy imports (Lightning) wait inside the functions that need them,
so importing this module costs torch alone.

The strategy also uses, as a subclass, protected members of Lightning's ``ModelParallelStrategy`` that Lightning's
own strategies use the same way: ``_precision_plugin`` (the storage behind the ``precision_plugin`` property it
overrides) and the two reached through :func:`setup_process_group` and :func:`call_through_module` below. The
model summary callbacks (:mod:`lightning_hybrid.glue.model_summary`) override ``ModelSummary._summary``, the factory in
which Lightning's own callback chooses the summary it prints (its DeepSpeed variant is picked there): no public hook
sets what the table counts.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# Pytrees: torch 2.13 has no public module for nested-container flattening (``torch.utils.pytree`` does not exist
# yet); DTensor, FSDP2 and the pipelining schedules use this one themselves.
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten  # noqa: F401

# The base class of dispatch-level modes (they see aten ops after autograd, DTensor ops at global shapes and the
# collectives): ``torch.overrides`` only has the function-level TorchFunctionMode, too early for FLOP counting.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401

# The only placement that deals the rows of a fused q|k|v projection so each rank holds whole heads of all three
# pieces while ``full_tensor()`` keeps the original row order (public ``Shard(0)`` gives rank 0 all of q).
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard  # noqa: F401

# Where a rank's local shard sits in the global tensor: DCP needs the offsets, DTensor's public API gives only
# the local tensor and the global shape.
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: F401


class _GlobalOnly:
    """What ``FlopCounterMode`` reads of its module tracker when only the total is wanted: no module hooks."""

    parents = {"Global"}

    def __enter__(self) -> "_GlobalOnly":
        return self

    def __exit__(self, *args: Any) -> None:
        return None


def total_flop_counter() -> Any:
    """A ``torch.utils.flop_counter.FlopCounterMode`` counting the total only. Its ``mod_tracker`` (private) is
    replaced: torch's ``ModuleTracker`` registers a multi-grad hook on every module input that requires grad, and
    fails on a leaf view taken under ``no_grad`` (Hugging Face Mamba's ``conv1d.weight.view(...)``: "Expected
    gradient function to be set"); the public constructor has no way to turn module tracking off."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    counter.mod_tracker = _GlobalOnly()
    return counter


def dtensor_around(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with ``like``'s mesh, placements and global shape around ``local`` itself. ``DTensor.from_local``
    would pass ``local`` through an autograd view, which need not keep the tensor subclass whose hooks DCP reads
    (the strided checkpoint pieces)."""
    return DTensor(local, like._spec, requires_grad=False)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """``mesh``'s dimensions as one named dimension of the root mesh. torch 2.13 has no public way to create a
    named flattened dimension; torchtitan uses the same call for its data-parallel mesh."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dimensions are ``meshes``' (each of the same root mesh). torch 2.13 deprecates slicing a
    flattened dimension out of the root mesh (``mesh["data_parallel", "tensor_parallel"]`` warns) and has no
    public way to combine flattened meshes; FSDP2 builds its data × tensor mesh with this same call."""
    return DeviceMesh._concatenate(meshes)


def all_to_all_autograd(rows: torch.Tensor, output_splits: list[int], input_splits: list[int], group: Any) -> torch.Tensor:
    """``rows`` dealt to the ranks of ``group`` (``input_splits`` rows to each) and theirs received
    (``output_splits`` from each), differentiable: the backward sends the gradients back the same way. torch 2.13
    deprecates the public ``torch.distributed.nn.functional.all_to_all_single`` in favour of this functional
    collective (the one torchtitan's expert-parallel dispatch uses), which has no public name yet."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    received = all_to_all_single_autograd(rows, output_splits, input_splits, group)
    return received.wait() if hasattr(received, "wait") else received


def in_autograd_engine() -> bool:
    """Whether the current operation runs inside autograd's engine (backward, or a checkpoint's recomputation).
    No public query exists; the graph task id is -1 outside the engine."""
    return torch._C._current_graph_task_id() != -1


def existing_ops(paths: Iterable[str]) -> set[Any]:
    """The op overloads named ``namespace.op.overload`` that this torch build registers (attention kernels and
    functional collectives exist only as private ``aten._*`` / ``_c10d_functional`` ops, and some only in some
    builds). Missing ones are skipped, so importing the package never fails on an op a build lacks."""
    found = set()
    for path in paths:
        namespace, op, overload = path.split(".")
        try:
            found.add(getattr(getattr(getattr(torch.ops, namespace), op), overload))
        except (AttributeError, RuntimeError):
            continue
    return found


def is_compiled(module: torch.nn.Module) -> bool:
    """Whether ``module`` itself was compiled: wrapped by ``torch.compile(module)`` or compiled in place by
    ``module.compile()``. torch has no public query: the wrapper's class lives in ``torch._dynamo`` and in-place
    compilation only sets the private ``_compiled_call_impl``."""
    from torch._dynamo.eval_frame import OptimizedModule  # loads Dynamo: only asked when compiling

    return isinstance(module, OptimizedModule) or getattr(module, "_compiled_call_impl", None) is not None


def let_compiled_backward_run_twice() -> None:
    """Let backward graphs compiled from now on in this process run more than once per forward. Zero-bubble
    pipeline schedules run a stage's backward twice (input gradients with ``retain_graph=True``, then weight
    gradients), which AOTAutograd's donated buffers (saved tensors reused as backward scratch space, a memory
    saving only) forbid; torch offers this switch only as the private ``torch._functorch.config`` flag."""
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False


# ---------------------------------------------------------------------------------------------- checkpoints
def lightning_metadata_path(folder: Path) -> Path:
    """The file of a distributed Lightning checkpoint folder that holds everything but the tensors (``meta.pt``):
    Lightning's format, named by a private constant."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    return folder / _METADATA_FILENAME


def read_dcp_in_one_process(folder: Path, keys: set[str]) -> dict[str, Any]:
    """The entries ``keys`` of a DCP checkpoint, as full tensors, read by this process alone without a process
    group. torch's public converter (``dcp_to_torch_save``) reads every entry, optimizer state included, into a
    file; the planner that loads a subset into an empty dict is private."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(folder), planner=_EmptyStateDictLoadPlanner(keys=keys),
                     no_dist=True)
    return state


# ---------------------------------------------------------------------------------------------- Lightning
def setup_process_group(strategy: Any) -> None:
    """``ModelParallelStrategy._setup_distributed()``: the process group and the cluster environment's ranks,
    without the 2-D mesh the public ``setup_environment()`` builds next (the hybrid strategy builds its own).

    Under torchrun the workers share the agent's store, which outlives a failed attempt with its gloo addresses:
    a restarted rank starting well before its peer read the dead peer's address and hung. The group is created
    first over keys of this attempt only (Lightning then finds it initialized and keeps it)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and not dist.is_initialized():
        agent_store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                    timeout=strategy._timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(strategy._get_process_group_backend(), rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]), timeout=strategy._timeout,
                                store=dist.PrefixStore(f"lightning_hybrid/attempt_{attempt}/", agent_store))
    strategy._setup_distributed()


def publish_device_mesh(strategy: Any, module: Any, mesh: DeviceMesh, module_mesh: DeviceMesh | None = None) -> None:
    """Make ``mesh`` the strategy's ``device_mesh`` and ``module_mesh`` (default: ``mesh``) the LightningModule's
    ``self.device_mesh``, as ``ModelParallelStrategy`` does: both properties read attributes that have no public
    setter."""
    strategy._device_mesh = mesh
    module._device_mesh = mesh if module_mesh is None else module_mesh


def call_through_module(strategy: Any, module: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Run ``module.<method>`` inside ``module.__call__`` (so FSDP2's root hooks fire) with Lightning's own
    forward redirection, which strategies hold privately."""
    return strategy._forward_redirection(module, module, method, *args, **kwargs)


def summary_depth(callback: Any) -> int:
    """The ``max_depth`` a Lightning ``ModelSummary`` callback was built with, which it keeps only as ``_max_depth``
    (the whole-model summary builds its table to the same depth)."""
    return callback._max_depth


def request_dataloaders(loop: Any) -> Any:
    """The dataloader(s) a Lightning loop is about to set up, requested as the loop requests them: its hook called
    once, under Lightning's capture of each ``DataLoader``'s arguments (its sampler injection re-instantiates the
    loader from them). Only the loop's private data source knows where they come from (the module, a DataModule, or
    the loaders passed to ``fit``), and the capture is a private function."""
    from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader

    return _request_dataloader(loop._data_source)


def hand_dataloaders_to_loop(loop: Any, loaders: Any) -> None:
    """Make the loop's next request of its dataloaders return ``loaders`` (what :func:`request_dataloaders` got)
    instead of calling the hook a second time; its requests after that (a reload) ask the loop's source as before.
    The loop requests them through its private data source, which has no public setter."""
    from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource

    original = loop._data_source

    class _HandedOnce(_DataLoaderSource):
        def dataloader(self) -> Any:
            loop._data_source = original
            return self.instance

    loop._data_source = _HandedOnce(loaders, original.name)


def process_like_loop(trainer: Any, stage: Any, loader: Any) -> Any:
    """``loader`` processed exactly as the trainer's loop of ``stage`` (a ``RunningStage``) processes it: Lightning's
    distributed sampler injected, the strategy's ``process_dataloader``, the worker checks and seeding. Lightning
    does this in a private function of its data connector."""
    from lightning.pytorch.trainer.connectors.data_connector import _process_dataloader

    return _process_dataloader(trainer, trainer.state.fn, stage, loader)


def start_iterator(loader: Any) -> Any:
    """A new iterator of the ``DataLoader`` ``loader``, not kept by it: ``DataLoader.__iter__`` keeps a persistent
    workers' iterator and resets it when iterated again, and only its private ``_get_iterator`` makes one."""
    return loader._get_iterator()


def hand_iterator_to_loader(loader: Any, iterator: Any, first: Any, still_first: Any) -> None:
    """Make the ``DataLoader`` ``loader``'s next iteration continue ``iterator`` (from :func:`start_iterator`),
    yielding ``first`` (already taken from it) first, if ``still_first()`` says so then; else it makes a new
    iterator as usual. A loader makes its iterators (persistent workers' too) in its private ``_get_iterator``,
    which an instance attribute overrides once; the iterator's class is swapped for one ``__next__``, so everything
    else Lightning reads of it (workers, counts) is the iterator's own."""
    def handed_once() -> Any:
        del loader._get_iterator  # the class's method again
        if not still_first():
            return loader._get_iterator()
        iterator.__class__ = _first_yielding(type(iterator))
        iterator._hybrid_first_batch = first
        return iterator

    loader._get_iterator = handed_once


_FIRST_YIELDING: dict[type, type] = {}


def _first_yielding(base: type) -> type:
    """A subclass of the iterator class ``base`` whose next ``__next__`` returns the stored first batch and turns
    the iterator back into a ``base``."""
    if base not in _FIRST_YIELDING:
        def __next__(self: Any) -> Any:
            first = self.__dict__.pop("_hybrid_first_batch")
            self.__class__ = base
            return first

        _FIRST_YIELDING[base] = type(f"FirstYielding{base.__name__}", (base,), {"__next__": __next__})
    return _FIRST_YIELDING[base]


def set_sampler_epoch(loader: Any, epoch: int) -> None:
    """Lightning's own helper that sets the epoch of a loader's sampler and batch sampler, wherever they hold one."""
    from lightning.fabric.utilities.data import _set_sampler_epoch

    _set_sampler_epoch(loader, epoch)


def optimizers_to_device(optimizers: Iterable[Any], device: torch.device) -> None:
    """Move optimizer state to ``device``: Lightning's helper, which every strategy calls after setup."""
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(optimizers, device)


def written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an aten operator writes (in-place and ``out=`` arguments). Private: an operator's schema
    (``OpOverload._schema``) is the only record of which arguments it mutates; meta-device initialization reads
    it to learn which tensors an initializer writes without running it on real memory."""
    written: list[torch.Tensor] = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        written.extend(v for v in values if isinstance(v, torch.Tensor))
    return written
