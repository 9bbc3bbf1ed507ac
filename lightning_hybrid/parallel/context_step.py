"""The driver's context-parallel steps: every block structure planned on the unmodified model (0b, before the
pipeline split or tensor parallelism change the blocks), and the plans installed on this rank's blocks (2c, after
tensor and expert parallelism, whose setup checks run the blocks whole). See :mod:`lightning_hybrid.context_parallel`.

Example::

    applied = plan_context(blocks, dims, probe)                   # step 0b
    install_context(applied, blocks, owned, dims, probe, "32-true")   # step 2c, and the step checked
"""

from __future__ import annotations

import math
import time
from typing import Any, Mapping, Optional, Sequence

import torch
from torch import Tensor
from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_hybrid.context_parallel.apply import AppliedContext, install_context_parallel, plan_context_parallel
from lightning_hybrid.context_parallel.escapes import find_escapes
from lightning_hybrid.context_parallel.exchange import ContextGroup, running_whole
from lightning_hybrid.mesh import CONTEXT, ParallelDims
from lightning_hybrid.pipeline.verify import NoDropout, checkable, tolerance
from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.probe.step_probe import StepProbe


def plan_context(blocks: BlockList, dims: ParallelDims, probe: StepProbe) -> AppliedContext:
    """Each block structure's plan for ``dims.cp`` parts (checked on its recorded call), logged once; blocks whose
    inside values the step reads other than through their outputs kept whole (:mod:`~lightning_hybrid.context_parallel.escapes`)."""
    start = time.perf_counter()
    escaping: set[int] = set()
    if checkable(probe):
        with probe.isolated(), torch.no_grad():
            escaping = find_escapes(blocks, lambda: probe.run_on(probe.step))
    applied = plan_context_parallel(blocks, probe.record().block_calls, dims.cp, escaping)
    rank_zero_info(f"HybridStrategy: context parallelism (cp={dims.cp}), planned in {time.perf_counter() - start:.2f} s:")
    for line in applied.describe():
        rank_zero_info(f"HybridStrategy:   {line}")
    return applied


def install_context(applied: Optional[AppliedContext], blocks: BlockList, owned: Sequence[int], dims: ParallelDims,
                    probe: StepProbe, precision: str) -> None:
    """The planned blocks of ``owned`` run on this rank's part of the sequence, over its cp group (nothing without
    a plan: cp = 1); without a pipeline, whose verification covers it, the step is checked (:func:`check_step`)."""
    if applied is None:
        return
    mesh = dims.build_context_mesh(probe.device.type)[CONTEXT]
    group = ContextGroup(mesh.get_group(), mesh.get_local_rank(), dims.cp)
    install_context_parallel(applied, blocks, owned, group)
    if dims.pp == 1 and applied.installed and checkable(probe) and not any(p.is_meta for p in probe.root.parameters()):
        check_step(group, probe, tolerance(precision))


def check_step(group: ContextGroup, probe: StepProbe, allowed: float) -> None:
    """The first batch's step (no gradients) with the blocks split and whole: the losses must agree (the blocks were
    checked one by one, and what leaves them other than through their outputs found: this checks the whole)."""
    start = time.perf_counter()
    with probe.isolated(), torch.no_grad(), NoDropout():
        with running_whole(group):
            whole = _loss(probe.run_on(probe.step))
        split = _loss(probe.run_on(probe.step))
    if whole is None or split is None:
        rank_zero_info("HybridStrategy: the step returns no loss tensor; cp checked block by block only")
        return
    if not math.isclose(split, whole, rel_tol=allowed, abs_tol=1e-6):
        raise ValueError(
            f"HybridStrategy(cp={group.size}): the first batch's loss is {split:.6g} with the blocks on their parts of"
            f" the sequence but {whole:.6g} with them whole, though each block gives the same output both ways:"
            " something reaches the loss from inside the blocks other than their outputs, by a way the setup"
            " could not follow. Use cp=1, and report the model."
        )
    rank_zero_info(f"HybridStrategy: the first batch's loss is the same with the blocks split over cp and whole"
                   f" ({split:.6g}; checked in {time.perf_counter() - start:.2f} s)")


def _loss(output: Any) -> Optional[float]:
    loss = output.get("loss") if isinstance(output, Mapping) else output
    return float(loss) if isinstance(loss, Tensor) and loss.numel() == 1 else None
