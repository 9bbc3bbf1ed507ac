"""Values that leave a block other than through its outputs, found on the first batch's step.

Context parallelism gathers what a block returns; a value computed inside a block that the step reads some other
way — a forward hook recording a module's output (Hugging Face's ``output_router_logits`` feeding the
load-balancing loss, ``output_attentions``), an attribute a module stores — would hold this rank's positions only,
and what the step computes from it would differ from one device's, silently (a load-balancing loss weighted 0.001
moves the loss below float32's resolution, but not the router's gradients). :func:`find_escape` runs the step once
(gradients off) under a ``TorchFunctionMode`` that notes every tensor a torch function makes while a block runs
and reports the blocks that made a tensor a torch function reads outside every block, their own outputs excepted.
Such blocks stay whole (:mod:`.apply`).

Example::

    find_escapes(blocks, run_step=lambda: module.training_step(batch, 0))   # {0, 1, 2, 3}: Mixtral's router logits
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_hybrid._compat import tree_leaves
from lightning_hybrid.probe.blocks import BlockList


class _Escapes(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.running: list[int] = []  # the blocks running now, innermost last
        self.made: dict[int, tuple[weakref.ref, int]] = {}  # id → (the tensor, the block that made it)
        self.found: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if not self.running:
            self.found.update(self.made[id(x)][1] for x in tree_leaves((args, kwargs))
                              if isinstance(x, Tensor) and self._made_inside(x))
        output = func(*args, **kwargs)
        if self.running:
            for value in tree_leaves(output):
                if isinstance(value, Tensor):
                    self.made[id(value)] = (weakref.ref(value), self.running[-1])
        return output

    def _made_inside(self, tensor: Tensor) -> bool:
        entry = self.made.get(id(tensor))
        return entry is not None and entry[0]() is tensor  # not a new tensor at a freed one's address

    def entered(self, index: int) -> None:
        self.running.append(index)

    def returned(self, output: Any) -> None:
        self.running.pop()
        for value in tree_leaves(output):  # what the block returns reaches the step gathered
            if isinstance(value, Tensor):
                self.made.pop(id(value), None)


def find_escapes(blocks: BlockList, run_step: Callable[[], Any]) -> set[int]:
    """The blocks whose inside values the step reads other than through their outputs. ``run_step`` runs the step
    (the caller isolates it and turns gradients off)."""
    escapes = _Escapes()
    handles = []
    for index in range(len(blocks)):
        handles.append(blocks[index].register_forward_pre_hook(lambda *_, index=index: escapes.entered(index)))
        handles.append(blocks[index].register_forward_hook(lambda _, __, output: escapes.returned(output)))
    try:
        with escapes:
            run_step()
    finally:
        for handle in handles:
            handle.remove()
    return escapes.found
