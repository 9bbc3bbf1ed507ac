"""Hugging Face checkpoints whose names or layout differ from the model's: transformers' own conversion mapping.

transformers 5 keeps a mixture of experts stacked in the model (``mlp.experts.gate_up_proj``: ``(experts, 2 ×
hidden, width)``) but saves and publishes it per expert (``block_sparse_moe.experts.3.w1.weight``), and converts
on load with a per-family mapping (``transformers.conversion_mapping``): renamings, and converters whose operations
stack the experts (``MergeModulelist``) and join gate and up (``Concatenate``). :func:`conversion_plan` applies the
same mapping to the stored names; :func:`read_converted` reads one converted tensor's sources whole (one layer's
experts at a time) and runs the converter's own operations on them, so the result is what ``from_pretrained``
would hold; the caller copies each rank's slice into its shard.

Example::

    renamed, converted = conversion_plan(pretrained_model, stored_names)
    renamed["model.layers.0.mlp.gate.weight"]          # "model.layers.0.block_sparse_moe.gate.weight"
    files = stored_files(directory)
    full = read_converted(directory, converted["model.layers.0.mlp.experts.gate_up_proj"], files)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch
from torch import nn


@dataclass
class Converted:
    """One model tensor made from several stored ones: each source pattern's stored names in expert order."""

    converter: Any
    sources: dict[str, list[str]] = field(default_factory=dict)


def conversion_plan(model: nn.Module, stored: Iterable[str]) -> tuple[dict[str, str], dict[str, Converted]]:
    """``(renamed, converted)`` for ``model`` (a ``PreTrainedModel``) and the checkpoint's ``stored`` names:
    model name → stored name for tensors stored whole under another name, and model name → :class:`Converted` for
    tensors stored in pieces. Empty where transformers has no mapping for the family."""
    transforms = _mapping(model)
    renamed: dict[str, str] = {}
    converted: dict[str, Converted] = {}
    pieces: dict[str, dict[str, list[tuple[int, str]]]] = {}
    for name in stored:
        target, matched = name, None
        for transform in transforms:
            target, pattern = transform.rename_source_key(target)
            if pattern is not None and hasattr(transform, "operations"):
                matched = (transform, pattern)
                break
        if matched is None:
            if target != name:
                renamed[target] = name
            continue
        transform, pattern = matched
        converted.setdefault(target, Converted(transform))
        pieces.setdefault(target, {}).setdefault(pattern, []).append((_expert_index(name, pattern), name))
    for target, by_pattern in pieces.items():
        converted[target].sources = {pattern: [name for _, name in sorted(found)] for pattern, found in by_pattern.items()}
    return renamed, converted


def _mapping(model: nn.Module) -> list[Any]:
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:  # transformers before 5 loads checkpoints under the model's own names
        return []
    return list(get_checkpoint_conversion_mapping(getattr(model.config, "model_type", "")) or [])


def _expert_index(name: str, pattern: str) -> int:
    """The number a ``*`` of ``pattern`` stands for in ``name`` (the expert's index)."""
    regex = re.escape(pattern).replace(r"\*", r"(\d+)")
    found = re.search(regex, name)
    return int(found.group(1)) if found else 0


def converted_shape(converted: Converted, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The converted tensor's shape, from its sources' stored ``shapes`` (the operations run on meta tensors)."""
    return tuple(_convert(converted, {name: torch.empty(shapes[name], device="meta")
                                      for names in converted.sources.values() for name in names}).shape)


def read_converted(directory: Path, converted: Converted, files: dict[str, str]) -> torch.Tensor:
    """The converted tensor, whole: its sources read from the safetensors ``files`` (:func:`stored_files`) and
    converted by transformers' operations."""
    from safetensors import safe_open

    tensors = {}
    for name in (name for names in converted.sources.values() for name in names):
        with safe_open(str(directory / files[name]), framework="pt") as stored:
            tensors[name] = stored.get_tensor(name)
    return _convert(converted, tensors)


def _convert(converted: Converted, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    transform = converted.converter
    collected: Any = {pattern: [tensors[name] for name in names] for pattern, names in converted.sources.items()}
    for operation in transform.operations:
        collected = operation.convert(collected, source_patterns=transform.source_patterns,
                                      target_patterns=transform.target_patterns)
    (result,) = collected.values()
    return result


def stored_files(directory: Path) -> dict[str, str]:
    """Stored name → the safetensors file holding it (one file, or the index of several)."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        return json.loads(index.read_text())["weight_map"]
    from safetensors import safe_open

    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as stored:
            files.update(dict.fromkeys(stored.keys(), path.name))
    return files
