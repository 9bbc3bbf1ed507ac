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
    """The model's repeated blocks in the order the step runs them: a view of the container (or containers, e.g. an
    encoder's blocks then a decoder's) that holds them, by position, with each block's name in the model
    (``blocks.name(0) == "model.layers.0"``, or ``"model.layers.<key>"`` in a ``ModuleDict``). Indexing reads the
    container each time, so a block swapped in place is what it returns.

    Example::

        BlockList("model.layers", model.layers)                                  # one list
        BlockList("encoder.layers", encoder_layers, ("decoder.layers", decoder_layers))   # two, run in this order
    """

    def __init__(self, path: str, container: nn.Module, *more: tuple[str, nn.Module]) -> None:
        #: ``(path, container)`` of every list of blocks, in the order the step runs them.
        self.parts: tuple[tuple[str, nn.Module], ...] = ((path, container), *more)
        #: The lists' paths joined by ``","`` (what ``HybridStrategy(blocks=...)`` accepts for several lists).
        self.path = ",".join(part for part, _ in self.parts)
        self._entries = [(part_path, held, name) for part_path, held in self.parts for name, _ in held.named_children()]
        #: The blocks' names inside their containers, in order.
        self.keys = tuple(name for _, _, name in self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __getitem__(self, index: int) -> nn.Module:  # type: ignore[override]
        _, container, key = self._entries[index]
        return container.get_submodule(key)

    def name(self, index: int) -> str:
        """The block's name in the root module."""
        path, _, key = self._entries[index]
        return f"{path}.{key}" if path else key

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, container in self.parts:
            yield from container.parameters()

    def is_container(self, module: nn.Module) -> bool:
        """Whether ``module`` is one of the lists holding the blocks."""
        return any(module is container for _, container in self.parts)

    def contains_name(self, name: str) -> bool:
        """Whether the module or parameter ``name`` (in the root) lies inside one of the blocks."""
        return any(name.startswith(path + ".") if path else len(container) > 0 for path, container in self.parts)

    def modules(self) -> Iterator[nn.Module]:
        """Every module of every block (and the containers)."""
        for _, container in self.parts:
            yield from container.modules()


def find_block_list(root: nn.Module, path: str | None = None) -> tuple[str, BlockList]:
    """Return ``(name, blocks)`` of the model's repeated blocks.

    The outermost containers (``ModuleList``, ``Sequential`` or ``ModuleDict``) of two or more blocks — modules
    with parameters, of one class or composite modules of several (dense and mixture-of-experts layers); never a
    container of unlike parts such as ``ModuleDict(wte=..., h=ModuleList(...), ln_f=...)``. The one with the most
    children, then the most parameters, holds the blocks; other outermost containers of composite blocks (a
    decoder's beside an encoder's, single-stream beside double-stream blocks) join it, in the order the model
    registers them. ``path`` names the container explicitly (several: ``"encoder.layers,decoder.layers"``, in the
    order the step runs them) and skips the search.
    """
    if path is not None:
        return path, BlockList(*_named_parts(root, path))
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
    main = max(candidates, key=lambda item: (len(item[1]), _parameter_count(item[1])))
    parts = [item for item in candidates if item is main or all(_composite(child) for child in item[1].children())]
    blocks = BlockList(*parts[0], *parts[1:])
    return blocks.path, blocks


def _named_parts(root: nn.Module, path: str) -> list:
    parts = []
    for part in path.split(","):
        part = part.strip()
        try:
            container = root.get_submodule(part)
        except AttributeError as error:
            raise ValueError(f"HybridStrategy(blocks={path!r}): {type(root).__name__} has no submodule {part!r}.") from error
        if not isinstance(container, CONTAINERS) or len(container) == 0:
            raise ValueError(
                f"HybridStrategy(blocks={path!r}) must name non-empty nn.ModuleList, nn.Sequential or nn.ModuleDict"
                f" containers (several separated by ','), got {type(container).__name__} at {part!r}."
            )
        parts.append((part, container))
    return [*parts[0], *parts[1:]]


def _holds_blocks(container: nn.Module) -> bool:
    """Every child has parameters (activations and dropout between layers mean a hand-written trunk); children of
    several classes must each be a composite module that is not itself a container (dense and MoE layers, not an
    embedding beside a list of layers and a norm)."""
    children = list(container.children())
    if not all(any(True for _ in child.parameters()) for child in children):
        return False
    return len({type(child) for child in children}) == 1 or all(
        _composite(child) and not isinstance(child, CONTAINERS) for child in children)


def _composite(module: nn.Module) -> bool:
    return any(True for _ in module.children())


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


def blocks_holding(blocks: Sequence[nn.Module]) -> dict[int, set[int]]:
    """``id`` of every parameter of ``blocks`` → the indices of the blocks holding it (several: a weight they share
    or tie)."""
    holders: dict[int, set[int]] = {}
    for index, block in enumerate(blocks):
        for parameter in block.parameters():
            holders.setdefault(id(parameter), set()).add(index)
    return holders


def shared_between_blocks(blocks: Sequence[nn.Module]) -> list[list[nn.Module]]:
    """Modules of several blocks holding the same parameters, grouped: one module object that several blocks hold,
    or one module per block with its parameters tied to the others' (Zamba2's transformer block that every hybrid
    layer calls, tied by Hugging Face). Each group is one set of weights: sharded once (one FSDP2 unit, one
    tensor-parallel layout), its gradient the sum of every block's use. The outermost such modules, in block
    order."""
    shared = {key for key, indices in blocks_holding(blocks).items() if len(indices) > 1}
    groups: dict[frozenset[int], list[nn.Module]] = {}
    for block in blocks:
        taken: set[int] = set()
        for name, module in block.named_modules():
            weights = frozenset(id(p) for p in module.parameters())
            if name and weights and weights <= shared and id(module) not in taken:
                taken |= {id(m) for m in module.modules()}
                group = groups.setdefault(weights, [])
                if all(held is not module for held in group):
                    group.append(module)
    return list(groups.values())


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
