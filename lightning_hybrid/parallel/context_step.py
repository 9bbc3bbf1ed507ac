"""The driver's context-parallel steps: every block structure planned on the unmodified model (0b, before the
pipeline split or tensor parallelism change the blocks), and the plans installed on this rank's blocks (2c, after
tensor and expert parallelism, whose setup checks run the blocks whole). See :mod:`lightning_hybrid.context_parallel`.

Example::

    applied = plan_context(blocks, dims, probe)                   # step 0b
    install_context(applied, blocks, owned, dims, "cpu")          # step 2c
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_hybrid.context_parallel.apply import AppliedContext, install_context_parallel, plan_context_parallel
from lightning_hybrid.context_parallel.exchange import ContextGroup
from lightning_hybrid.mesh import CONTEXT, ParallelDims
from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.probe.step_probe import StepProbe


def plan_context(blocks: BlockList, dims: ParallelDims, probe: StepProbe) -> AppliedContext:
    """Each block structure's plan for ``dims.cp`` parts (checked on its recorded call), logged once."""
    start = time.perf_counter()
    applied = plan_context_parallel(blocks, probe.record().block_calls, dims.cp)
    rank_zero_info(f"HybridStrategy: context parallelism (cp={dims.cp}), planned in {time.perf_counter() - start:.2f} s:")
    for line in applied.describe():
        rank_zero_info(f"HybridStrategy:   {line}")
    return applied


def install_context(applied: Optional[AppliedContext], blocks: BlockList, owned: Sequence[int], dims: ParallelDims,
                    device_type: str) -> None:
    """The planned blocks of ``owned`` run on this rank's part of the sequence, over its cp group (nothing without
    a plan: cp = 1)."""
    if applied is None:
        return
    mesh = dims.build_context_mesh(device_type)[CONTEXT]
    install_context_parallel(applied, blocks, owned, ContextGroup(mesh.get_group(), mesh.get_local_rank(), dims.cp))
