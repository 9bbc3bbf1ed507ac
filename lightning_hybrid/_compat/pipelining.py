"""Private torch names of ``torch.distributed.pipelining`` the pipeline relies on, each with the reason no public
API serves (the compatibility package's rule: see :mod:`lightning_hybrid._compat`). Imported by the pipeline only,
so importing the package does not load torch's pipelining.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
import torch.distributed as dist

from lightning_hybrid._compat import tree_map


def stage_to_rank(pp: int, num_stages: int, placement: str) -> dict[int, int]:
    """torch's own stage → pipeline-rank assignment for a schedule's placement (``"loop"`` or ``"v"``): the one
    its schedules use, kept in a private helper module."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    return generate_stage_to_rank_mapping(pp, num_stages, style=placement)


def keep_forward_actions(schedule: Any) -> None:
    """Re-lower a V-shaped schedule with its forward actions only.

    torch 2.13's V schedules still run their backward actions under ``eval()`` (and fail); the forward actions of
    the training order, lowered again with torch's own passes (FSDP unshard/reshard, send/receive), are a valid
    forward-only schedule for the same stage placement. The public lowering entry point refuses an order without
    backward actions, hence the two private passes.
    """
    from torch.distributed.pipelining.schedules import _add_send_recv, _add_unshard_reshard, _ComputationType

    forwards: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order.items():
        kept: list[Any] = []
        for action in actions:
            if action is None:
                continue
            parts = action.sub_actions if action.computation_type == _ComputationType.OVERLAP_F_B else (action,)
            kept += [a for a in parts or () if a.computation_type == _ComputationType.FORWARD]
        forwards[rank] = _add_unshard_reshard(kept)
    schedule.pipeline_order_with_comms = _add_send_recv(
        forwards, stage_to_rank=lambda stage: schedule.stage_index_to_group_rank[stage], num_stages=schedule._num_stages
    )


def resize_stage_buffers(stage: Any, chunk: int, inputs: list[tuple[int, ...]], outputs: list[tuple[int, ...]]) -> None:
    """Give microbatch ``chunk`` of a built ``PipelineStage`` receive buffers of new shapes: for the activations it
    receives (``inputs``; none on the first stage) and the gradients of what it sends (``outputs``; none on the
    last). torch 2.13's stages fix one shape for every microbatch when their schedule first runs and have no public
    way to change it; the buffers are per-microbatch attributes that torch itself swaps (``set_local_fwd_input``).
    Dtypes stay what torch inferred. The stage's own metadata follows microbatch 0 (what it sends zeros by)."""
    from dataclasses import replace

    from torch.distributed.pipelining._utils import _DTensorMeta

    def reshaped(meta: Any, shape: tuple[int, ...]) -> Any:
        if isinstance(meta, _DTensorMeta):
            raise NotImplementedError("batches of varying shapes with DTensor activations between pipeline stages")
        return replace(meta, shape=torch.Size(shape), stride=torch.empty(shape, device="meta").stride())

    for infos, shapes in ((stage.args_recv_info.get(chunk, ()), inputs), (stage.grad_recv_info.get(chunk, ()), outputs)):
        received = [info for info in infos if not info.is_root_arg]
        if not received:  # nothing received: the first stage's inputs, or gradients in a forward-only schedule
            continue
        for info, shape in zip(received, shapes, strict=True):
            if info.tensor_meta is None:  # an output without a gradient: nothing is received for it
                continue
            info.tensor_meta = reshaped(info.tensor_meta, shape)
            info.buffer = torch.empty(shape, dtype=info.tensor_meta.dtype, device=info.buffer.device)
    if chunk == 0:
        meta = stage._stage_meta
        for name, shapes in (("inputs", inputs), ("input_grads", inputs), ("outputs", outputs), ("output_grads", outputs)):
            old = getattr(meta, name)
            if old and shapes:
                setattr(meta, name, tuple(m if m is None else reshaped(m, s) for m, s in zip(old, shapes, strict=True)))


def pipeline_stage(module: torch.nn.Module, index: int, num_stages: int, device: torch.device, group: Any) -> Any:
    """A torch ``PipelineStage`` whose receive buffers exist only while their message is in flight.

    torch 2.13's stage allocates one receive buffer per microbatch and direction when its schedule first runs and
    keeps them all (m = 512 microbatches of a 1T model: 100 GiB on a middle stage). This stage allocates a buffer
    when the schedule posts its receive and drops it after the forward (activations) or backward (gradients) that
    consumes it; torch's own caches (``fwd_cache``, ``backward_state``) keep what autograd still needs, so an
    activation lives exactly as long as its microbatch is in flight and the allocator reuses the memory. The
    buffers are private attributes of torch's stage that the public API cannot reach; the overridden methods are
    torch's internal steps of creating and consuming them. The last stage also cuts each microbatch's loss and
    output from their graph after the backward (:func:`_detach`), which would otherwise keep every received
    activation."""
    return _arrival_stage_class()(module, index, num_stages, device, group=group)


@functools.cache
def _arrival_stage_class() -> type:
    from torch.distributed.pipelining import PipelineStage

    class ArrivalBufferStage(PipelineStage):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._spent_losses: dict[int, Any] = {}  # a loss whose weight gradients are still to come (split backward)

        def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
            with _buffers_on_meta(self):  # placeholders (shape, stride, dtype) instead of m buffers
                super()._setup_forward_recv_info(num_microbatches, has_backward)

        def _create_grad_recv_info(self, act_send_info: dict) -> tuple:
            with _buffers_on_meta(self):
                return super()._create_grad_recv_info(act_send_info)

        def _get_recv_ops(self, recv_infos: tuple) -> list:
            _allocate(recv_infos, self.device)
            return super()._get_recv_ops(recv_infos)

        def set_local_bwd_input(self, next_stage_bwd_outputs: tuple, mb_index: int) -> None:
            _allocate(self.grad_recv_info[mb_index], self.device)  # torch zeroes the buffer of a None gradient
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

        def forward_one_chunk(self, fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
            _release(self.args_recv_info.get(fwd_chunk_id, ()))
            return output

        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
            _release(self.grad_recv_info.get(bwd_chunk_id, ()))
            if self.is_last and bwd_chunk_id < len(self.output_chunks):  # kept for the step's merged output
                self.output_chunks[bwd_chunk_id] = tree_map(_detached, self.output_chunks[bwd_chunk_id])
            if full_backward:
                _detach(loss)
            else:  # the weight gradients still run through the loss's graph
                self._spent_losses[bwd_chunk_id] = loss

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            super().backward_weight_one_chunk(bwd_chunk_id, last_backward)
            _detach(self._spent_losses.pop(bwd_chunk_id, None))

    return ArrivalBufferStage


@contextlib.contextmanager
def _buffers_on_meta(stage: Any) -> Iterator[None]:
    device, stage.device = stage.device, torch.device("meta")
    try:
        yield
    finally:
        stage.device = device


def _allocate(recv_infos: tuple, device: torch.device) -> None:
    for info in recv_infos:
        if info.buffer is not None and info.buffer.is_meta:
            info.buffer = _empty_on(info.buffer, device)


def _empty_on(buffer: torch.Tensor, device: Any) -> torch.Tensor:
    """An uninitialized tensor of ``buffer``'s shape, strides and dtype on ``device`` (``"meta"``: a placeholder)."""
    return torch.empty_strided(buffer.shape, buffer.stride(), dtype=buffer.dtype, device=device)


def _detach(loss: Any) -> None:
    """Cut a last stage's microbatch loss from its graph once its backward has run: torch's schedules keep every
    microbatch's loss and output until the step ends, and through their graph they keep the stage's received
    activation (autograd's leaf node holds it): m activations on the last stage. torch detaches the outputs
    itself, but not those that are views (a ``Linear`` on a 3-D input returns one)."""
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None and not loss._is_view():
        loss.detach_()


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _release(recv_infos: tuple) -> None:
    for info in recv_infos:
        if info.buffer is not None and not info.buffer.is_meta:
            info.buffer = _empty_on(info.buffer, "meta")


def release_sends_on_arrival() -> None:
    """Let torch's pipeline schedules drop each sent tensor once its receiver has it, not at the end of the step.

    torch 2.13's multi-stage schedule runtime keeps the ``Work`` of every send until the step ends, and a send's
    ``Work`` keeps its tensor: a rank holds all m microbatches' sent activations and gradients (2·v·m b·s·h
    tensors). Its schedules post sends through the private ``schedules._batch_p2p``; wrapped, a send-only batch
    hands the schedule stand-ins whose ``wait()`` waits for the real send if it is still pending, while every call
    lets go of the sends already completed. Idempotent; the schedules' behaviour is otherwise unchanged."""
    from torch.distributed.pipelining import schedules

    if isinstance(schedules._batch_p2p, _SendTracker):
        return
    schedules._batch_p2p = _SendTracker(schedules._batch_p2p)


class _SendTracker:
    def __init__(self, batch_p2p: Any) -> None:
        self._batch_p2p = batch_p2p
        self._pending: dict[int, Any] = {}  # token → Work of a send not yet known complete
        self._tokens = iter(range(2**62))

    def __call__(self, p2p_ops: list, desc: Any = None) -> list:
        for token in [token for token, work in self._pending.items() if work.is_completed()]:
            del self._pending[token]  # the Work and, with it, the sent tensor
        works = self._batch_p2p(p2p_ops, desc=desc)
        if not p2p_ops or any(op.op is not dist.isend for op in p2p_ops):
            return works
        tokens = [next(self._tokens) for _ in works]
        self._pending.update(zip(tokens, works))
        return [_PendingSend(self._pending, token) for token in tokens]


class _PendingSend:
    """What the schedule keeps of one send: its token, not the ``Work`` (which would keep the tensor)."""

    def __init__(self, pending: dict[int, Any], token: int) -> None:
        self._pending, self._token = pending, token

    def wait(self, *args: Any) -> bool:
        work = self._pending.pop(self._token, None)
        return work.wait(*args) if work is not None else True


def stage_buffers_ready(stage: Any) -> bool:
    """Whether a ``PipelineStage``'s schedule has run it (its receive buffers exist): torch keeps them private."""
    return bool(stage.args_recv_info)
