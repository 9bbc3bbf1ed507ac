"""Initializers replayed on a rank's shards: the values of a full-size initialization without the full-size tensor.

:mod:`~lightning_hybrid.parallel.initialization` learns what an initializer writes by running it on meta-device
stand-ins. :class:`ReplayRecorder` rides on that run and also records *how* it writes: when every write is a random
fill (``normal_``, ``uniform_``) or an element-wise in-place operation with constant arguments (``zero_``,
``fill_``, ``mul_``, ``clamp_``, ``erfinv_``, …) of a whole tensor or of a range of its rows (``weight[padding_idx]
.zero_()``), the initializer can be replayed operation by operation on the rank's own part of each tensor:

* an element-wise operation runs on the rows of the range the rank holds;
* a random fill draws the whole range **in chunks of rows** (:func:`row_chunks`: at most :data:`CHUNK_ELEMENTS`
  elements, a multiple of 16), in order, from the same seeded generator, and the rank keeps the part of each chunk
  it holds. Drawing a tensor in consecutive chunks consumes the generator exactly as one draw: on the CPU, bit for
  bit (``uniform_`` draws element by element; ``normal_`` draws all its uniforms first and transforms them in
  blocks of 16, recomputing a ragged tail of 16, which a chunk of ≥ 16 elements reproduces). On a GPU the chunks'
  values differ from one whole draw's but are the same for every layout, since the chunks follow the full shape.

So a rank's temporaries are one chunk, not a full tensor (an embedding of 128k × 2048 fp32 is 1 GiB). Anything
else an initializer does — reading values, random draws into new tensors (``orthogonal_``), writing other
tensors, strided views — keeps the full-size path, which gives the same values.

Example::

    recorder = ReplayRecorder({StorageWeakRef(stand_in.untyped_storage()): original for ...})
    with recorder:
        initializer()                      # on meta stand-ins
    replay(recorder.writes, targets)       # under the same seed, on each original's local part
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_hybrid._compat import TorchDispatchMode, compute_local_shape_and_global_offset, written_tensors

#: Elements of one chunk of a random fill: a rank's largest temporary while initializing (16 MiB in fp32).
CHUNK_ELEMENTS = 2**22

_aten = torch.ops.aten
RANDOM_FILLS = {_aten.normal_.default, _aten.uniform_.default}
ELEMENTWISE = {_aten.zero_.default, _aten.fill_.Scalar, _aten.mul_.Tensor, _aten.mul_.Scalar, _aten.div_.Tensor,
               _aten.div_.Scalar, _aten.add_.Tensor, _aten.add_.Scalar, _aten.sub_.Tensor, _aten.sub_.Scalar,
               _aten.clamp_.default, _aten.erfinv_.default}


@dataclass(frozen=True)
class Write:
    """One recorded write: ``func(target rows [first, last), *args, **kwargs)``."""

    func: Any
    target: int  # id() of the original tensor
    first: int
    last: int
    args: tuple
    kwargs: dict


class ReplayRecorder(TorchDispatchMode):
    """Records an initializer's writes to meta stand-ins (``stand_ins``: storage → original) as :class:`Write`\\ s;
    ``writes`` is ``None`` once it does anything a replay could not reproduce (see the module docstring)."""

    def __init__(self, stand_ins: dict[StorageWeakRef, Tensor]) -> None:
        super().__init__()
        self._stand_ins = stand_ins
        self.writes: Optional[list[Write]] = []
        self.storages: set[StorageWeakRef] = set()  # of every tensor written, stand-in or not

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        self._record(func, args, kwargs)
        return func(*args, **kwargs)

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        written = written_tensors(func, args, kwargs)
        self.storages.update(StorageWeakRef(t.untyped_storage()) for t in written)
        if self.writes is None:  # already not replayable: only the storages are still wanted
            return
        if not written:  # reading or viewing is fine; a random draw into a new tensor is not
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.writes = None
            return
        target = self._stand_ins.get(StorageWeakRef(written[0].untyped_storage()))
        rows = _row_range(written[0], target)
        constants = all(not isinstance(a, Tensor) or (a.dim() == 0 and not a.is_meta) for a in args[1:])
        if (len(written) > 1 or written[0] is not args[0] or func not in RANDOM_FILLS | ELEMENTWISE or rows is None
                or not constants or kwargs.get("generator") is not None):
            self.writes = None
            return
        self.writes.append(Write(func, id(target), *rows, tuple(args[1:]), dict(kwargs)))


def _row_range(view: Tensor, original: Optional[Tensor]) -> Optional[tuple[int, int]]:
    """The rows ``[first, last)`` of ``original`` that ``view`` (of its contiguous stand-in) covers whole, or None."""
    if original is None or original.dim() == 0 or not view.is_contiguous():
        return None
    row = math.prod(original.shape[1:])
    offset, count = view.storage_offset(), view.numel()
    if row == 0 or offset % row or count % row:
        return None
    return offset // row, (offset + count) // row


def row_chunks(first: int, last: int, row: int) -> Iterator[tuple[int, int]]:
    """Rows ``[first, last)`` in chunks of at most :data:`CHUNK_ELEMENTS` elements (at least one row), each a
    multiple of 16 elements but the last, which has at least 16 unless the whole range has fewer."""
    unit = 16 // math.gcd(row, 16)  # rows per 16-element multiple
    size = max(unit, CHUNK_ELEMENTS // row // unit * unit)
    starts = list(range(first, last, size))
    if len(starts) > 1 and (last - starts[-1]) * row < 16:
        starts.pop()  # a ragged tail under 16 elements joins the chunk before it
    yield from zip(starts, starts[1:] + [last])


@dataclass
class Target:
    """Where a replay writes one original: ``local`` holds the rows/columns of the box at ``offset``."""

    local: Tensor
    offset: tuple[int, ...]
    shape: tuple[int, ...]  # the full tensor's


def target_of(original: Tensor) -> Optional[Target]:
    """The rank's own part of ``original`` as a box of the full tensor, or None (a strided shard, not a box)."""
    if not isinstance(original, DTensor):
        return Target(original, (0,) * original.dim(), tuple(original.shape))
    if not all(type(p) in (Shard, Replicate) for p in original.placements):
        return None
    _, offset = compute_local_shape_and_global_offset(original.shape, original.device_mesh, original.placements)
    return Target(original.to_local(), tuple(offset), tuple(original.shape))


@torch.no_grad()
def replay(writes: list[Write], targets: dict[int, Target]) -> None:
    """Run the recorded ``writes`` on each target's local part, in order (under the initializer's seed)."""
    for write in writes:
        target = targets[write.target]
        if write.func in RANDOM_FILLS:
            row = math.prod(target.shape[1:])
            for start, stop in row_chunks(write.first, write.last, row):
                chunk = torch.empty((stop - start, *target.shape[1:]), dtype=target.local.dtype,
                                    device=target.local.device)
                write.func(chunk, *write.args, **write.kwargs)
                _copy_rows(target, chunk, start)
        elif (part := _local_rows(target, write.first, write.last)) is not None:
            write.func(part[0], *write.args, **write.kwargs)


def _local_rows(target: Target, first: int, last: int) -> Optional[tuple[Tensor, int]]:
    """The local part of rows ``[first, last)`` and the global row it starts at, or None if none is held."""
    held_first, held_last = target.offset[0], target.offset[0] + target.local.shape[0]
    start, stop = max(first, held_first), min(last, held_last)
    if start >= stop:
        return None
    return target.local[start - held_first:stop - held_first], start


def _copy_rows(target: Target, chunk: Tensor, chunk_first: int) -> None:
    part = _local_rows(target, chunk_first, chunk_first + chunk.shape[0])
    if part is None:
        return
    rows, start = part
    box = tuple(slice(o, o + n) for o, n in zip(target.offset[1:], target.local.shape[1:]))
    rows.copy_(chunk[(slice(start - chunk_first, start - chunk_first + rows.shape[0]), *box)])
