"""Integer attributes a sharded block's forward must read as per-rank values (head counts, widths).

A block reshapes its projections' outputs with sizes it keeps as attributes (``self.num_heads``,
``config.num_key_value_heads``, ``self.inner``). Which attributes hold a size that sharding makes per-rank is only
hinted at by their values (a group count can equal a head count), so :func:`attributes_to_scale` sorts the
candidates into likely and doubtful ones and :func:`attribute_subsets` lists the sets to try, for the plan check to
settle (:mod:`lightning_hybrid.tensor_parallel.apply`).

Example::

    likely, doubtful = attributes_to_scale(trace, "attn", scaled={4, 32}, kept={8}, block=block)
    next(attribute_subsets(likely, doubtful))      # (("attn", "num_heads"), ("attn", "hidden_size"))
"""

from __future__ import annotations

import itertools
from typing import Iterator

from torch import nn

from lightning_hybrid.tensor_parallel.dataflow import BlockTrace, attribute_holders


def attributes_to_scale(
    trace: BlockTrace, owner: str, scaled: set[int], kept: set[int], block: nn.Module
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """Integer attributes under ``owner``, read by the forward, whose value equals a size that becomes per-rank.

    A value match is only a hint (a group count can equal a head count), so the caller tries subsets; attributes
    whose value also equals a size that stays (e.g. the head size) are the doubtful ones.
    """
    likely, doubtful = [], []
    for path, holder in attribute_holders(block):
        if owner and path != owner and not path.startswith(owner + "."):
            continue
        for attr, value in vars(holder).items():
            read = (path, attr) in trace.attribute_reads or path in trace.unobserved
            if type(value) is int and read and value in scaled:
                (doubtful if value in kept else likely).append((path, attr))
    return likely, doubtful


def attribute_subsets(likely: list[tuple[str, str]], doubtful: list[tuple[str, str]]) -> Iterator[tuple[tuple[str, str], ...]]:
    """Attribute sets to try: all likely ones first (head counts are the usual reason a value shows up in a
    reshape), then fewer; doubtful ones are added to each likely set before it is tried without them."""
    for size in range(len(likely), -1, -1):
        for chosen in itertools.combinations(likely, size):
            for extra in range(len(doubtful), -1, -1):
                for added in itertools.combinations(doubtful, extra):
                    yield chosen + added
