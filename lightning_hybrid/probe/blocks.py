"""Find a model's repeated blocks and capture what one of them receives.

Every parallelism here works block by block: tensor parallelism plans one block and repeats the plan, FSDP2
shards each block as one unit, pipelining splits the block list into stages. Transformers keep their
blocks in one container of same-class modules (``h``, ``layers``, ``blocks``, ``encoder.layer`` ..., a list or a
dict keyed by layer id), so we look for that structure instead of a name.

Example::

    path, blocks = find_block_list(lightning_module)            # ("model.layers", BlockList of its blocks)
    args, kwargs = capture_block_call(blocks[0], lambda: lightning_module.training_step(batch, 0))
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from lightning_hybrid._compat import tree_map


#: The containers blocks are kept in: lists (``ModuleList``, ``Sequential``) and dicts keyed by layer id
#: (``ModuleDict``, as torchtitan's models keep them).
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


class BlockList(Sequence[nn.Module]):
    """The model's repeated blocks in order: a view of the container that holds them, by position, with each
    block's name in the model (``blocks.name(0) == "model.layers.0"``, or ``"model.layers.<key>"`` in a
    ``ModuleDict``). Indexing reads the container each time, so a block swapped in place is what it returns."""

    def __init__(self, path: str, container: nn.Module) -> None:
        self.path = path
        self.container = container
        #: The blocks' names inside the container, in order.
        self.keys = tuple(name for name, _ in container.named_children())

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> nn.Module:  # type: ignore[override]
        return self.container.get_submodule(self.keys[index])

    def name(self, index: int) -> str:
        """The block's name in the root module."""
        return f"{self.path}.{self.keys[index]}" if self.path else self.keys[index]

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.container.parameters()


def find_block_list(root: nn.Module, path: str | None = None) -> tuple[str, BlockList]:
    """Return ``(name, blocks)`` of the model's repeated blocks.

    The outermost container (``ModuleList``, ``Sequential`` or ``ModuleDict``) of two or more blocks — modules
    with parameters, of one class or of several (dense and mixture-of-experts layers) — preferring the one with
    the most children, then the most parameters (a list of experts inside each block is not the model's block
    list). ``path`` names the container explicitly and skips the search.
    """
    if path is not None:
        try:
            container = root.get_submodule(path)
        except AttributeError as error:
            raise ValueError(f"HybridStrategy(blocks={path!r}): {type(root).__name__} has no submodule {path!r}.") from error
        if not isinstance(container, CONTAINERS) or len(container) == 0:
            raise ValueError(
                f"HybridStrategy(blocks={path!r}) must name a non-empty nn.ModuleList, nn.Sequential or"
                f" nn.ModuleDict, got {type(container).__name__}."
            )
        return path, BlockList(path, container)
    found = [(name, module) for name, module in root.named_modules()
             if isinstance(module, CONTAINERS) and len(module) >= 2 and _holds_blocks(module)]
    candidates = [(name, module) for name, module in found
                  if not any(name.startswith(outer + ".") for outer, _ in found if outer != name)]
    if not candidates:
        containers = [f"{name} ({type(m).__name__} of {len(m)})" for name, m in root.named_modules()
                      if isinstance(m, CONTAINERS)]
        raise ValueError(
            f"Could not find the repeated blocks of {type(root).__name__}: no nn.ModuleList/nn.Sequential/nn.ModuleDict"
            f" holds two or more blocks (containers found: {', '.join(containers) or 'none'})."
            " Pass HybridStrategy(blocks='path.to.block_list') to name the container."
        )
    name, container = max(candidates, key=lambda item: (len(item[1]), _parameter_count(item[1])))
    return name, BlockList(name, container)


def _holds_blocks(container: nn.Module) -> bool:
    """Every child has parameters (activations and dropout between layers mean a hand-written trunk)."""
    return all(any(True for _ in child.parameters()) for child in container.children())


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


class _BlockReached(BaseException):
    """Raised from the first block's pre-hook to stop the forward once its inputs are known.

    Derives from ``BaseException`` so that user code catching ``Exception`` around the forward does not swallow it.
    """


def block_structures(blocks: BlockList) -> list[list[int]]:
    """Indices of the blocks grouped by structure (submodule names, classes and parameter shapes), in order of
    first appearance: blocks of one group can share one tensor-parallel plan."""
    groups: dict[tuple, list[int]] = {}
    for index in range(len(blocks)):
        groups.setdefault(_structure(blocks[index]), []).append(index)
    return list(groups.values())


def _structure(block: nn.Module) -> tuple:
    return tuple((name, type(module).__qualname__, tuple((key, tuple(p.shape)) for key, p in
                                                        module.named_parameters(recurse=False)))
                 for name, module in block.named_modules())


def capture_block_call(block: nn.Module, run_forward: Callable[[], Any]) -> tuple[tuple, dict]:
    """Run ``run_forward`` until ``block`` is called and return the ``(args, kwargs)`` it is called with."""
    captured: dict[str, Any] = {}

    def stop(module: nn.Module, args: tuple, kwargs: dict) -> None:
        captured["call"] = tree_map(detached, (args, kwargs))
        raise _BlockReached

    handle = block.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with torch.no_grad():
            run_forward()
    except _BlockReached:
        pass
    finally:
        handle.remove()
    if "call" not in captured:
        raise RuntimeError(
            f"The model's step never called its block {type(block).__name__}, so its inputs are unknown. Tensor"
            " parallel planning needs one call of the first block; pass HybridStrategy(blocks=...) to name the"
            " block list the forward actually uses."
        )
    return captured["call"]


def detached(value: Any) -> Any:
    """``value`` detached from autograd if it is a tensor, else unchanged (for ``tree_map`` over step inputs and
    outputs)."""
    return value.detach() if isinstance(value, torch.Tensor) else value
