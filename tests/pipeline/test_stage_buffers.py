"""The pipeline stage HybridStrategy builds (``_compat.pipelining.pipeline_stage``): receive buffers that exist only
while their message is in flight, and the schedules' sends let go of once complete
(``_compat.pipelining.release_sends_on_arrival``). Equivalence of every schedule with one device runs in
``test_pipeline.py``, on this stage."""

from __future__ import annotations

import gc
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from lightning_hybrid._compat.pipelining import _SendTracker, pipeline_stage
from tests.helpers import on_two_ranks

MESSAGE = (1, 7, 13)  # one microbatch's activation: a shape nothing else in the test has


def _live_messages() -> int:
    """Distinct storages of real (not meta) tensors of the message's shape that Python objects hold."""
    return len({t.untyped_storage().data_ptr() for t in gc.get_objects()
                if isinstance(t, torch.Tensor) and not t.is_meta and tuple(t.shape) == MESSAGE})


def _peak_messages(rank: int, results: dict, kind: str, microbatches: int) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    gc.collect()  # the previous configuration's stages
    torch.manual_seed(rank)
    module = torch.nn.Linear(MESSAGE[-1], MESSAGE[-1] if rank == 0 else 5)  # the last stage's outputs are kept
    if kind == "torch":
        stage = PipelineStage(module, rank, 2, torch.device("cpu"), group=dist.group.WORLD)
    else:
        stage = pipeline_stage(module, rank, 2, torch.device("cpu"), dist.group.WORLD)
    peak = [0]
    for name in ("forward_one_chunk", "backward_one_chunk"):
        def counted(*args, _run=getattr(stage, name), **kwargs):
            peak[0] = max(peak[0], _live_messages())
            return _run(*args, **kwargs)
        setattr(stage, name, counted)
    schedule = Schedule1F1B(stage, microbatches, loss_fn=lambda output, target: ((output - target) ** 2).mean())
    for _ in range(2):  # the second step runs on the buffers the first created
        if rank == 0:
            schedule.step(torch.randn(microbatches * MESSAGE[0], *MESSAGE[1:]))
        else:
            schedule.step(target=torch.randn(microbatches * MESSAGE[0], MESSAGE[1], 5))
    results[(rank, kind, microbatches)] = peak[0]


def _all_configurations(rank: int, results: dict) -> None:
    for kind in ("torch", "arrival"):
        for microbatches in (4, 16):
            _peak_messages(rank, results, kind, microbatches)


@pytest.mark.slow
def test_receive_buffers_do_not_grow_with_the_microbatch_count() -> None:
    peaks = on_two_ranks(_all_configurations)
    for rank in (0, 1):  # rank 0 receives gradients, rank 1 activations
        assert peaks[(rank, "arrival", 16)] == peaks[(rank, "arrival", 4)] <= peaks[(rank, "torch", 4)], peaks
        # torch's stage keeps one buffer per microbatch (measured next to it, so the count above is meaningful)
        assert peaks[(rank, "torch", 16)] - peaks[(rank, "torch", 4)] == 12, peaks


class _Work:
    def __init__(self, completed: bool = False) -> None:
        self.completed, self.waited = completed, False

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, *args) -> bool:
        self.waited = self.completed = True
        return True


def test_sends_are_let_go_once_complete_and_waited_when_the_schedule_asks() -> None:
    issued: list[_Work] = []

    def batch_p2p(ops: list, desc=None) -> list:
        issued.extend(_Work() for _ in ops)
        return issued[-len(ops):]

    tracker = _SendTracker(batch_p2p)
    send = SimpleNamespace(op=dist.isend)
    first = tracker([send, send])
    assert len(tracker._pending) == 2 and not any(w.waited for w in issued)
    issued[0].completed = True
    receives = tracker([SimpleNamespace(op=dist.irecv)])  # any later call lets go of the completed send
    assert receives == [issued[2]] and len(tracker._pending) == 1  # receives are the schedule's own Works
    assert all(stand_in.wait() for stand_in in first)
    assert issued[1].waited and not issued[0].waited and tracker._pending == {}
