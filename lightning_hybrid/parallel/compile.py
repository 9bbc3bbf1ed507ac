"""``torch.compile`` per block (``HybridStrategy(compile=True)``, or a dict of ``torch.compile`` arguments).

Each block is compiled in place (``block.compile(**arguments)``), not wrapped: it keeps its identity, class,
parameter names and hooks, so FSDP2 shards it as it would an eager block, state dicts and checkpoints are
unchanged, and torch's zero-bubble pipeline schedules, which refuse ``OptimizedModule`` wrappers, accept it.
Nothing is compiled at setup: a block's graph is built at its first call (the first training step) and shared by
every block of its class; a new input shape (validation's batch, the last short batch) compiles once more.

Where the driver applies it (step 4, torchtitan's order): after tensor parallelism, so the graph holds the
sharded layers and their collectives; after activation checkpointing, which Dynamo traces as one region
recomputed in backward; before FSDP2, whose hooks Dynamo does not trace: they gather and reshard around each
block's graph as they do around an eager block.

Two kinds of block are treated apart:

* a block the LightningModule compiled itself (``torch.compile(block)``, ``block.compile()``), one holding a
  compiled module or one inside a compiled module is left as the module compiled it, never compiled twice;
* a block whose ``forward`` is torch's own (``nn.TransformerEncoderLayer``, a bare ``nn.Linear``): in-place
  compilation of it compiles nothing, because Dynamo does not start tracing in torch's files. Its class is
  swapped for a subclass whose ``forward``, defined here, calls torch's: Dynamo starts here and traces into it.

Zero-bubble pipeline schedules (``interleaved_zero_bubble``, ``zbv_zero_bubble``, ``dualpipev``) run a stage's
backward twice, input gradients then weight gradients; a compiled block's backward is one graph computing both, so
it runs in full both times (numbers unchanged, backward compute doubled for the compiled blocks), and AOTAutograd's
donated buffers, which allow one run only, are switched off for the process.

Refused at setup: activation checkpointing together with tensor parallelism and FSDP2 (parameters sharded over two
meshes), which torch 2.13's AOTAutograd fails to compile (see
:func:`~lightning_hybrid.parallel.parallelize.check_compile_layout`).

Example::

    arguments = compile_arguments({"mode": "max-autotune-no-cudagraphs"})   # lightning_hybrid.options.feature_checks
    compiled, kept = compile_blocks(module, "model.blocks", [model.blocks[0], model.blocks[1]], arguments)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from lightning_hybrid._compat import is_compiled, let_compiled_backward_run_twice

_TORCH_DIR = Path(torch.__file__).parent


def compile_blocks(module: nn.Module, blocks_path: str, blocks: Sequence[nn.Module], arguments: Mapping[str, Any],
                   backward_twice: bool = False) -> tuple[int, int]:
    """Compile each of ``blocks`` (this rank's blocks of the container at ``blocks_path`` in ``module``) in place
    with ``torch.compile`` ``arguments``; ``backward_twice``: a zero-bubble schedule will run each backward graph
    twice. Returns ``(compiled, kept)``: how many blocks were compiled and how many were left as the
    LightningModule compiled them (see the module docstring)."""
    if _compiled_around(module, blocks_path):
        return 0, len(blocks)
    if backward_twice:
        let_compiled_backward_run_twice()
    compiled = 0
    for block in blocks:
        if any(is_compiled(inner) for inner in block.modules()):
            continue
        if _forward_in_torch(type(block)):
            block.__class__ = _traceable_class(type(block))
        block.compile(**arguments)
        compiled += 1
    return compiled, len(blocks) - compiled


def _compiled_around(module: nn.Module, blocks_path: str) -> bool:
    """Whether ``module`` or a module on the path down to the block container is compiled."""
    for path in blocks_path.split(","):
        names = path.split(".") if path else []
        if any(is_compiled(module.get_submodule(".".join(names[:depth]))) for depth in range(len(names) + 1)):
            return True
    return False


def _forward_in_torch(cls: type) -> bool:
    code = getattr(cls.forward, "__code__", None)
    return code is not None and Path(code.co_filename).resolve().is_relative_to(_TORCH_DIR.resolve())


_TRACEABLE_CLASSES: dict[type, type] = {}


def _traceable_class(cls: type) -> type:
    """``cls`` with a ``forward`` defined outside torch that calls ``cls.forward`` (see the module docstring)."""
    if cls not in _TRACEABLE_CLASSES:

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return cls.forward(self, *args, **kwargs)

        _TRACEABLE_CLASSES[cls] = type(f"Traceable{cls.__name__}", (cls,), {"forward": forward})
    return _TRACEABLE_CLASSES[cls]
