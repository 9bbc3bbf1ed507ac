"""Export a sharded ``HybridStrategy`` checkpoint as a Hugging Face model directory.

The LightningModule wraps an unmodified ``transformers.PreTrainedModel`` (as ``self.model`` or anywhere else);
the directory holds that model's weights under its own names, as ``save_pretrained`` would write them, so
``AutoModelForCausalLM.from_pretrained(directory)`` (or the model's own class) loads them bit for bit::

    export_hugging_face("checkpoints/epoch=3-step=4000.ckpt", "hf_model")

or ``lightning-hybrid export checkpoints/epoch=3-step=4000.ckpt hf_model --hf``.

* **Which model, which names.** The checkpoint stores the LightningModule's state dict (``model.lm_head.weight``);
  the Hugging Face names are those under the outermost ``PreTrainedModel`` inside it, found by type, not by
  attribute name. The module is built on the meta device (no memory) from the class ``HybridStrategy`` recorded
  in the checkpoint (``lightning_hybrid.glue.checkpoint_records``) or the one ``module`` names, with the hyperparameters
  the checkpoint saved (``module_kwargs`` add to or override them), ``configure_model()`` included. A built module
  (any device) may be passed instead.
* **config.json** is the found model's ``config`` (with ``architectures`` and ``dtype`` set as ``save_pretrained``
  sets them; ``generation_config.json`` too for generative models), or a copy of ``config_from``'s.
* **Tied weights** are written once, under the name ``from_pretrained`` loads and ties the others to (the source
  of the model's ``all_tied_weights_keys``), as ``save_pretrained`` does; the checkpoint holds them under every name.
* **Streaming.** Tensors are read from the DCP files one output shard at a time (``max_shard_size``, the Hub's
  5 GB by default) with ``torch.distributed.checkpoint``'s public loader and written with ``safetensors``; peak
  memory is about one shard (or the largest tensor), never the model. Several shards get a
  ``model.safetensors.index.json``, as Hugging Face writes it.
* Weights are written in the model's runtime layout under this ``transformers``: Mixtral's experts stay fused
  (``experts.gate_up_proj``), which this version loads; ``save_pretrained``'s conversion back to older
  per-expert layouts needs every tensor at once and is not done.

The directory appears complete or not at all (written under ``<name>.partial``, then renamed); an existing
non-empty directory is refused rather than mixed with other files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import warnings
from collections import defaultdict
from itertools import chain
from pathlib import Path
from typing import Any, Mapping, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid._compat import lightning_metadata_path
from lightning_hybrid.checkpoint.export import require_sharded_checkpoint
from lightning_hybrid.checkpoint.dcp_io import MODULE_STATE_KEY, partial_checkpoint_path
from lightning_hybrid.checkpoint.module_class import MODULE_CLASS_KEY, instantiate_on_meta

#: The Hugging Face Hub's default shard size (``huggingface_hub``): a shard is what the export holds in memory.
DEFAULT_MAX_SHARD_SIZE = "5GB"


def export_hugging_face(
    checkpoint: Union[str, os.PathLike],
    output_dir: Union[str, os.PathLike],
    module: Optional[Union[str, type, nn.Module]] = None,
    *,
    module_kwargs: Optional[Mapping[str, Any]] = None,
    max_shard_size: Union[int, str] = DEFAULT_MAX_SHARD_SIZE,
    config_from: Optional[Union[str, os.PathLike]] = None,
    replace: bool = False,
) -> Path:
    """Write the ``PreTrainedModel`` inside the checkpoint's LightningModule as a Hugging Face directory (see the
    module docstring) and return its path.

    ``module``: the LightningModule's class, as ``"package.module:ClassName"`` or the class itself, or a built
    instance; by default the class the checkpoint recorded. ``max_shard_size``: bytes, or ``"500MB"``-style. ``config_from``: a Hugging Face directory (or its
    ``config.json``) whose config to copy instead of the model's own. ``replace``: an earlier export in
    ``output_dir`` (a directory holding ``config.json``) is replaced once the new one is complete — what a job that
    restarted and trained on exports again; any other non-empty directory is still refused.
    """
    folder = require_sharded_checkpoint(checkpoint)
    output = Path(output_dir)
    earlier_export = replace and (output / "config.json").is_file()
    if output.exists() and (not output.is_dir() or any(output.iterdir())) and not earlier_export:
        raise ValueError(f"{output} already exists and is not an empty directory: export into a new directory"
                         + ("." if replace else " (or pass replace=True over an earlier export)."))
    prefix, pretrained = find_pretrained_model(_built_module(module, folder, module_kwargs))
    reader = dcp.FileSystemReader(folder)
    stored = _stored_tensors(reader, prefix, _exported_names(pretrained), folder)
    partial = partial_checkpoint_path(output)
    shutil.rmtree(partial, ignore_errors=True)  # left by an export that crashed
    partial.mkdir(parents=True)
    try:
        _write_weights(reader, prefix, stored, partial, max_shard_size)
        _write_config(pretrained, stored, partial, config_from)
        if earlier_export:
            shutil.rmtree(output)  # only now: a failed export above leaves the earlier one in place
        os.replace(partial, output)  # onto a missing or empty directory: atomic
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return output


def find_pretrained_model(module: nn.Module) -> tuple[str, nn.Module]:
    """``(prefix, model)``: the outermost ``transformers.PreTrainedModel`` inside ``module`` (itself included) and
    the prefix of its names in ``module``'s state dict (``"model."``, or ``""`` for ``module`` itself)."""
    try:
        from transformers import PreTrainedModel
    except ImportError as error:
        raise ImportError("a Hugging Face export needs the transformers package: pip install transformers") from error

    found = [(name, m) for name, m in module.named_modules() if isinstance(m, PreTrainedModel)]
    outermost = [(name, m) for name, m in found
                 if not any(name.startswith(f"{other}.") or (other == "" and name) for other, _ in found)]
    if not outermost:
        raise ValueError(
            f"{type(module).__name__} holds no transformers.PreTrainedModel, so there is no Hugging Face model to"
            " export: export its state dict with `lightning-hybrid export CKPT model.safetensors --safetensors`.")
    if len(outermost) > 1:
        raise ValueError(f"{type(module).__name__} holds several Hugging Face models"
                         f" ({', '.join(name for name, _ in outermost)}); export needs exactly one.")
    name, model = outermost[0]
    return (f"{name}." if name else ""), model


def _built_module(module: Optional[Union[str, type, nn.Module]], folder: Path,
                  module_kwargs: Optional[Mapping[str, Any]]) -> nn.Module:
    if isinstance(module, nn.Module):
        return module
    # Lightning saves the constructor arguments (save_hyperparameters) in meta.pt; the tensors are not read here.
    saved = torch.load(lightning_metadata_path(folder), map_location="cpu", weights_only=False)
    if isinstance(module, type):
        module = f"{module.__module__}:{module.__qualname__}"
    elif module is None:
        module = saved.get(MODULE_CLASS_KEY)
    if module is None:
        raise ValueError(f"The checkpoint {folder} does not record its LightningModule's class (written by an older"
                         " version or by a class defined in a notebook): name it, --module package.module:Class"
                         " (module= in Python).")
    return instantiate_on_meta(module, {**saved.get("hyper_parameters", {}), **(module_kwargs or {})})


def _exported_names(model: nn.Module) -> list[str]:
    """The names ``save_pretrained`` writes: the state dict less ``_keys_to_ignore_on_save`` and tied aliases."""
    ignored = set(getattr(model, "_keys_to_ignore_on_save", None) or ())
    aliases = _tied_aliases(model)
    return [name for name in model.state_dict() if name not in ignored and name not in aliases]


def _tied_aliases(model: nn.Module) -> set[str]:
    """Names of tensors the model shares with another name that ``from_pretrained`` ties to that other one: the
    targets of each (sub)model's ``all_tied_weights_keys``, found by object identity as ``save_pretrained`` does."""
    targets = {f"{path}.{target}" if path else target
               for path, sub in model.named_modules() for target in getattr(sub, "all_tied_weights_keys", {}) or {}}
    holders: dict[int, list[str]] = defaultdict(list)
    for name, tensor in chain(model.named_parameters(remove_duplicate=False),
                              model.named_buffers(remove_duplicate=False)):
        holders[id(tensor)].append(name)
    aliases: set[str] = set()
    for names in holders.values():
        tied = sorted(name for name in names if name in targets)
        aliases.update(tied[: len(names) - 1])  # one name of each shared tensor is always kept
    return aliases


def _stored_tensors(reader: dcp.FileSystemReader, prefix: str, names: list[str],
                    folder: Path) -> dict[str, TensorStorageMetadata]:
    """Each exported name's global size and dtype in the checkpoint (its metadata only)."""
    entries = reader.read_metadata().state_dict_metadata
    stored = {name: entries.get(f"{MODULE_STATE_KEY}.{prefix}{name}") for name in names}
    missing = [f"{prefix}{name}" for name, entry in stored.items() if not isinstance(entry, TensorStorageMetadata)]
    if missing:
        raise ValueError(f"The checkpoint {folder} lacks tensors of the module's Hugging Face model: {missing[:8]}"
                         f"{' ...' if len(missing) > 8 else ''} ({len(missing)} of {len(names)}). Is it from"
                         " another model, or were the module's hyperparameters overridden?")
    return stored  # type: ignore[return-value]


def _write_weights(reader: dcp.FileSystemReader, prefix: str, stored: dict[str, TensorStorageMetadata],
                   folder: Path, max_shard_size: Union[int, str]) -> None:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    # Meta tensors of the stored sizes: Hugging Face's own sharding rule (names in order, filenames, index).
    shapes = {name: torch.empty(entry.size, dtype=entry.properties.dtype, device="meta")
              for name, entry in stored.items()}
    split = split_torch_state_dict_into_shards(shapes, max_shard_size=max_shard_size)
    for filename, names in split.filename_to_tensors.items():
        shard = {f"{prefix}{name}": torch.empty_like(shapes[name], device="cpu") for name in names}
        # Public DCP loading into preallocated tensors reads only these entries' chunks (strided pieces too). It
        # warns on every single-process load, which is what an export is.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.load({MODULE_STATE_KEY: shard}, storage_reader=reader, no_dist=True)
        save_file({name: shard[f"{prefix}{name}"] for name in names}, str(folder / filename),
                  metadata={"format": "pt"})  # from_pretrained refuses safetensors files without a format
        del shard
    if split.is_sharded:
        total = sum(shape.numel() for shape in shapes.values())
        index = {"metadata": {"total_parameters": total, **split.metadata}, "weight_map": split.tensor_to_filename}
        text = json.dumps(index, indent=2, sort_keys=True) + "\n"
        (folder / "model.safetensors.index.json").write_text(text, encoding="utf-8")


def _write_config(model: nn.Module, stored: dict[str, TensorStorageMetadata], folder: Path,
                  config_from: Optional[Union[str, os.PathLike]]) -> None:
    if config_from is not None:
        source = Path(config_from)
        source = source / "config.json" if source.is_dir() else source
        if not source.is_file():
            raise ValueError(f"config_from={config_from}: no config.json there.")
        shutil.copyfile(source, folder / "config.json")
        return
    config = copy.deepcopy(model.config)  # the caller's model keeps its config
    # As save_pretrained: the class to build, and the weights' dtype (the first floating one), which
    # from_pretrained(dtype="auto") reads.
    config.architectures = [type(model).__name__]
    floating = [entry.properties.dtype for entry in stored.values() if entry.properties.dtype.is_floating_point]
    if floating:
        config.dtype = str(floating[0]).removeprefix("torch.")
    config.save_pretrained(folder)
    if model.can_generate() and getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
