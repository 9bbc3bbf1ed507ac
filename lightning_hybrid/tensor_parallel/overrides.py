"""The user's ``tp_plan`` entries: module-name patterns resolved to modules, and to one plan per block structure.

``tp_plan`` maps ``fnmatch`` patterns over the model's module names to a style (``"colwise"``, ``"rowwise"``,
``"replicate"`` or a torch ``ParallelStyle``); the planner treats what falls inside a block as that block
structure's explicit choices (:func:`block_tp_overrides`), the rest is applied as given.

Example::

    resolve_overrides({"blocks.*.attn.qkv": "replicate"}, names)   # {"blocks.0.attn.qkv": "replicate", ...}
    block_tp_overrides(root, tp_plan, ["blocks.0", "blocks.1"])     # {"attn.qkv": "replicate"}
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Mapping, Sequence, Union

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

PlanEntry = Union[str, ParallelStyle]
_STYLE_NAMES = ("colwise", "rowwise", "replicate")


def resolve_overrides(tp_plan: Mapping[str, PlanEntry], names: list[str]) -> dict[str, PlanEntry]:
    """Expand ``tp_plan`` patterns (``fnmatch`` syntax) into exact module names; later entries win."""
    resolved: dict[str, PlanEntry] = {}
    for pattern, entry in tp_plan.items():
        if not isinstance(entry, ParallelStyle) and entry not in _STYLE_NAMES:
            raise ValueError(
                f"tp_plan[{pattern!r}] = {entry!r} is not a style: use one of {', '.join(_STYLE_NAMES)} or a"
                " torch.distributed.tensor.parallel.ParallelStyle."
            )
        matched = [name for name in names if fnmatchcase(name, pattern)]
        if not matched:
            examples = ", ".join(names[:6])
            raise ValueError(f"tp_plan entry {pattern!r} matches no module. Module names look like: {examples}, ...")
        resolved.update(dict.fromkeys(matched, entry))
    return resolved


def block_tp_overrides(root: nn.Module, tp_plan: Mapping[str, PlanEntry],
                       block_names: Sequence[str]) -> dict[str, PlanEntry]:
    """``tp_plan``'s entries for the blocks ``block_names`` names (their names in the root; blocks of one
    structure), relative to one block: the plan each of them gets."""
    overrides = resolve_overrides(tp_plan, [name for name, _ in root.named_modules()])
    return _per_block_overrides(overrides, block_names)


def _per_block_overrides(overrides: Mapping[str, PlanEntry], block_names: Sequence[str]) -> dict[str, PlanEntry]:
    """``tp_plan`` entries inside the blocks ``block_names`` names, relative to one block; one plan serves them
    all."""
    per_block: dict[str, dict[str, PlanEntry]] = {block: {} for block in block_names}
    for name, entry in overrides.items():
        block, _, relative = name.rpartition(".")
        while block and block not in per_block:
            block, _, head = block.rpartition(".")
            relative = f"{head}.{relative}"
        if block:
            per_block[block][relative] = entry
    plans = list(per_block.values())
    if any(entries != plans[0] for entries in plans):
        where = block_names[0].rpartition(".")[0]
        raise ValueError(
            f"tp_plan entries inside '{where}' must treat every block of one structure alike (one plan is"
            f" applied to all of them); write them with a wildcard, e.g. '{where}.*.attn.qkv'."
        )
    return plans[0]
