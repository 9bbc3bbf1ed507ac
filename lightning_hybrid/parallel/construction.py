"""The true values of tensors a model computed while it was built on the meta device: rotary tables, masks,
position ids, a norm's ``torch.ones`` — recorded during construction, recomputed one tensor at a time later.

Building a model under ``torch.device("meta")`` runs every ``__init__`` but keeps no values, and ``to_empty``
then leaves garbage. While the LightningModule's ``configure_model`` runs, or the model is built under
``trainer.init_module(empty_init=True)`` (the strategy's ``tensor_init_context``), :func:`recording_construction`
records every aten operator that produces or writes a meta tensor (a dispatch mode: it sees ``torch.arange``,
``1 / theta ** x``, ``triu_``, in-place writes through views). :func:`recorded_values` then gives, for each
parameter or buffer, a function recomputing its value on the CPU by replaying only the operators its storage
depends on, so no rank ever builds the whole model, and only tensors of the rank's own shards are ever computed.

Why record the construction instead of re-running a module's ``__init__`` or asking each module to recompute?
It needs nothing from the model: no constructor arguments (which are not kept), no per-model recompute code,
and it is exact — the same operators on the same inputs as an eager build. A tensor whose recipe draws random
numbers or reads uninitialized memory (``torch.empty``: ``nn.Linear``'s weight before ``reset_parameters``) is
left to the per-module initializers of :mod:`lightning_hybrid.parallel.initialization`, as are tensors built
outside the recording (in the LightningModule's ``__init__``).

Example::

    with recording_construction():
        with torch.device("meta"):
            model = build()
    values = recorded_values(model)       # {"rotary.inv_freq": <recompute>, "norm.weight": <recompute>, ...}
    values["rotary.inv_freq"]()           # the CPU tensor an eager build computes
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_hybrid._compat import TorchDispatchMode, tree_flatten, tree_map, written_tensors


@dataclass
class _Op:
    func: Any
    args: tuple
    kwargs: dict
    outputs: list[Tensor]
    writes: set[StorageWeakRef]
    reads: set[StorageWeakRef]


class _Recorder(TorchDispatchMode):
    """Logs every operator that involves a meta tensor (the log keeps those tensors, which cost no memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[_Op] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, Tensor)]
        if any(t.is_meta for t in inputs + outputs):
            written = outputs + written_tensors(func, args, kwargs)
            self.log.append(_Op(func, args, kwargs, outputs, {_storage(t) for t in written},
                                {_storage(t) for t in inputs}))
        return result


#: Recordings that saw meta tensors, oldest first, until recorded_values() reads them. All are kept, not the
#: latest: a model built under ``trainer.init_module(empty_init=True)`` is followed by Lightning's call of
#: ``configure_model`` (a second recording, empty unless it builds more). Ops are matched to tensors by storage
#: identity, so a stale recording of another model adds nothing to this one's recipes.
_recordings: list[_Recorder] = []


@contextlib.contextmanager
def recording_construction() -> Iterator[None]:
    """Record what the model built inside computes on the meta device (see the module docstring).

    Example::

        with recording_construction(), torch.device("meta"):
            model = build()
    """
    recorder = _Recorder()
    try:
        with recorder:
            yield
    finally:
        if recorder.log:  # an empty one (an eager build, a configure_model that returns early) is not kept
            _recordings.append(recorder)


def recorded_values(module: nn.Module) -> dict[str, Callable[[], Tensor]]:
    """``{name: recompute}`` for each meta-device parameter or buffer of ``module`` (names relative to it) whose
    value the recordings of :func:`recording_construction` can recompute exactly; consumes them."""
    log = [op for recorder in _recordings for op in recorder.log]
    _recordings.clear()
    writers: dict[StorageWeakRef, list[int]] = {}
    for index, op in enumerate(log):
        for storage in op.writes:
            writers.setdefault(storage, []).append(index)
    values: dict[str, Callable[[], Tensor]] = {}
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if tensor.is_meta:
            ops = _recipe(log, writers, _storage(tensor))
            if ops is not None:
                values[name] = lambda ops=ops, like=tensor: _replay(ops, like)
    return values


def _recipe(log: list[_Op], writers: dict[StorageWeakRef, list[int]], storage: StorageWeakRef) -> Optional[list[_Op]]:
    """The logged operators ``storage``'s content depends on, in order; ``None`` if that content is random,
    uninitialized memory or was made outside the recording."""
    needed: set[int] = set()
    pending = [(storage, len(log))]  # (storage, the index before which its writes matter)
    while pending:
        current, before = pending.pop()
        for index in writers.get(current, ()):
            if index < before and index not in needed:
                needed.add(index)
                pending.extend((read, index) for read in log[index].reads)
    ops = [log[index] for index in sorted(needed)]
    if not ops or any(_not_reproducible(op.func) for op in ops):
        return None
    made: set[StorageWeakRef] = set()
    for op in ops:  # every meta tensor an operator reads must come from an earlier one
        if not {_storage(t) for t in tree_flatten((op.args, op.kwargs))[0] if isinstance(t, Tensor) and t.is_meta} <= made:
            return None
        made |= op.writes
    return ops


def _not_reproducible(func: Any) -> bool:
    return torch.Tag.nondeterministic_seeded in func.tags or func.__name__.split(".")[0] in (
        "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "resize_")


@torch.no_grad()
def _replay(ops: list[_Op], like: Tensor) -> Tensor:
    """Run ``ops`` again on the CPU and return the values ``like`` (a meta tensor) would have held."""
    real: dict[int, Tensor] = {}
    by_storage: dict[StorageWeakRef, Tensor] = {}

    def to_real(value: Any) -> Any:
        if isinstance(value, Tensor) and value.is_meta:
            return real[id(value)] if id(value) in real else _view_of(by_storage[_storage(value)], value)
        return torch.device("cpu") if isinstance(value, torch.device) and value.type == "meta" else value

    for op in ops:
        result = op.func(*tree_map(to_real, op.args), **tree_map(to_real, op.kwargs))
        for meta, value in zip(op.outputs, [t for t in tree_flatten(result)[0] if isinstance(t, Tensor)]):
            real[id(meta)] = value
            by_storage[_storage(meta)] = value
    return _view_of(by_storage[_storage(like)], like).clone()


def _view_of(base: Tensor, like: Tensor) -> Tensor:
    """``like``'s elements in ``base``'s storage (a parameter wraps its data in a new tensor object)."""
    return base.as_strided(like.shape, like.stride(), like.storage_offset())


def _storage(tensor: Tensor) -> StorageWeakRef:
    return StorageWeakRef(tensor.untyped_storage())
