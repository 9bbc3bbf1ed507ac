"""Weights that several blocks hold, kept one weight under tensor parallelism.

A block may hold a module that other blocks hold too — the same object (a shared transformer block every hybrid
layer calls), or a module per block whose parameters Hugging Face ties to one another (Zamba2). Applying each
block's plan on its own would shard such a module twice (the same object: its attributes divided by tp twice) or
give each block its own sharded copy of the weight (tied parameters: trained apart from then on). So a module
already sharded with an earlier block is left out of the later blocks' plans (:func:`sharded_before`), and after
all blocks are sharded every holder of a tied parameter is given the first holder's sharded one (:func:`retie`;
each block's plan made its DTensor from the same values with the same layout).

Example::

    ties, seen = tied_holders(blocks), set()
    for block in blocks:
        apply_block_plan(block, plan.without(sharded_before(block, seen)), mesh)
    retie(ties)
"""

from __future__ import annotations

from typing import Sequence

from torch import nn

from lightning_hybrid.probe.blocks import blocks_holding

#: Every ``(module, attribute)`` holding one parameter.
Holders = list[tuple[nn.Module, str]]


def tied_holders(blocks: Sequence[nn.Module]) -> list[Holders]:
    """For each parameter that several of ``blocks`` hold, its holders (each once, in block order)."""
    shared = {key for key, indices in blocks_holding(blocks).items() if len(indices) > 1}
    found: dict[int, dict[tuple[int, str], tuple[nn.Module, str]]] = {key: {} for key in shared}
    for block in blocks:
        for module in block.modules():
            for attribute, parameter in module.named_parameters(recurse=False):
                if id(parameter) in found:
                    found[id(parameter)][(id(module), attribute)] = (module, attribute)
    return [list(holders.values()) for holders in found.values()]


def sharded_before(block: nn.Module, seen: set[int]) -> list[str]:
    """Names of ``block``'s modules that an earlier block holds too (sharded with it already); notes this block's
    modules in ``seen``."""
    names = [name for name, module in block.named_modules() if name and id(module) in seen]
    seen.update(id(module) for module in block.modules())
    return names


def retie(ties: list[Holders]) -> None:
    """Give every holder of each tied parameter the parameter its first holder has now."""
    for (first, attribute), *others in ties:
        parameter = getattr(first, attribute)
        for module, held_as in others:
            setattr(module, held_as, parameter)
