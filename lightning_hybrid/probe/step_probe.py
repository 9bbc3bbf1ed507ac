"""The setup probe: the user's step run at setup on its first batch, recorded once and run again only where
something must be timed, each run leaving no trace in the training that follows.

Setup learns from the user's own step which blocks exist, what they receive, where the vocabulary is used and how
the step flows around the blocks (:mod:`.record`). :class:`StepProbe` runs it through the caller's ``run_step``
(the Lightning side: :mod:`lightning_hybrid.glue.setup_batch` fetches the first batch once and converts it as
Lightning's loop does) and records it the first time :meth:`StepProbe.record` is asked; every later reader gets
the same record. Only timing runs again (:meth:`StepProbe.run`, ``pp_split="measured"``), on the same batch.

Every run is isolated here, in one place (:meth:`StepProbe.isolated`): the random streams of the CPU and the
device are forked (the step's dropout masks, a shuffling sampler's seed: the real steps draw what they would have
drawn without the probe) and every buffer is restored (BatchNorm's running statistics count only real steps).

Example::

    probe = StepProbe(lightning_module, blocks, run_step=lambda microbatches: lightning_module.training_step(batch, 0),
                      device=torch.device("cpu"))
    probe.record().block_calls[0]          # the first block's inputs; the step ran once
    probe.record().block_flops             # the same record: not run again
    with probe.isolated(), torch.enable_grad():
        loss = probe.run(microbatches=4)   # the first quarter of the batch, for timing
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.probe.record import SetupRecord, record_step

#: The step on the probe's batch, or on the first of ``microbatches`` equal parts of it.
RunStep = Callable[[int], Any]
#: ``run_on(work)``: ``work(batch)`` on the probe's batch, inside the step's context (precision, logs muted).
RunOn = Callable[[Callable[[Any], Any]], Any]


class StepProbe:
    """The user's step at setup: :meth:`record` once, :meth:`run` again for timing (see the module docstring)."""

    def __init__(self, root: nn.Module, blocks: BlockList, run_step: RunStep, device: torch.device,
                 prepare: Callable[[], Any] = lambda: None, run_on: Optional[RunOn] = None,
                 step_name: str = "training_step") -> None:
        self.root, self.blocks, self.device = root, blocks, device
        self._run_step = run_step
        #: The step method the probe runs (the trainer's mode: ``"training_step"`` when fitting).
        self.step_name = step_name
        self._run_on = run_on
        # Work the training itself would do, done early for the probe (the loop's data iterator started): once,
        # before the first run and outside its isolation, so that its effects on the random streams stay.
        self._prepare: Optional[Callable[[], Any]] = prepare
        self._record: Optional[SetupRecord] = None

    def record(self) -> SetupRecord:
        """What the step showed about the model (:class:`~lightning_hybrid.probe.record.SetupRecord`): the step runs
        once, gradients off, isolated, the first time this is asked."""
        if self._record is None:
            with self.isolated():
                self._record = record_step(self.root, self.blocks, lambda: self._run_step(1))
        return self._record

    def run(self, microbatches: int = 1) -> Any:
        """The step on the first of ``microbatches`` parts of the batch, as the caller's context leaves gradients;
        returns its output. Not isolated by itself: run it inside :meth:`isolated`."""
        return self._run_step(microbatches)

    @property
    def can_run_on(self) -> bool:
        """Whether :meth:`run_on` can hand out the batch (a probe built from a Trainer's loop can)."""
        return self._run_on is not None

    def run_on(self, work: Callable[[Any], Any]) -> Any:
        """``work(batch)`` on the probe's batch, converted as the step receives it, inside the step's context (the
        precision plugin's, ``self.log`` muted); not isolated by itself."""
        if self._run_on is None:
            raise RuntimeError("This StepProbe was built without run_on: it cannot hand out its batch.")
        return self._run_on(work)

    def step(self, batch: Any) -> Any:
        """The step method on ``batch`` (batch index 0), as :meth:`run_on`'s work."""
        return getattr(self.root, self.step_name)(batch, 0)

    def isolated(self) -> contextlib.AbstractContextManager[None]:
        """Within it, the random streams are forked and every buffer is restored on exit (the first call runs the
        caller's ``prepare`` first, outside)."""
        if self._prepare is not None:
            prepare, self._prepare = self._prepare, None
            prepare()
        return leaving_no_trace(self.root, self.device)


@contextlib.contextmanager
def leaving_no_trace(root: nn.Module, device: torch.device) -> Iterator[None]:
    """The random streams of the CPU and of ``device`` forked, and ``root``'s buffers as they were afterwards: the
    same tensors (one the step replaced is put back) holding the same values."""
    saved = []
    for name, buffer in root.named_buffers(remove_duplicate=False):
        owner_name, _, attribute = name.rpartition(".")
        # A meta tensor has no values to keep; an expanded one (elements sharing memory) cannot be written in place.
        expanded = any(stride == 0 and size > 1 for stride, size in zip(buffer.stride(), buffer.shape))
        value = None if buffer.is_meta or expanded else buffer.detach().clone()
        saved.append((root.get_submodule(owner_name), attribute, buffer, value))
    devices = [device] if device.type not in ("cpu", "meta") else []
    try:
        with torch.random.fork_rng(devices, device_type=device.type if devices else "cpu"):
            yield
    finally:
        with torch.no_grad():
            for owner, attribute, buffer, value in saved:
                if getattr(owner, attribute, None) is not buffer:
                    setattr(owner, attribute, buffer)
                if value is not None and not torch.equal(buffer, value):
                    buffer.copy_(value)
