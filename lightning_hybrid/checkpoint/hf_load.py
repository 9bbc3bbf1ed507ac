"""Load a Hugging Face checkpoint directory straight into the sharded model.

A Hugging Face directory (``config.json`` + ``model.safetensors``, or ``model-0000x-of-0000y.safetensors`` with
their index) stores the ``PreTrainedModel``'s state dict under its own names, each tensor whole. After the
strategy has sharded the model (tensor parallelism, pipeline stages, FSDP2), every rank asks
``torch.distributed.checkpoint`` for exactly the boxes of each global tensor it holds, and DCP's Hugging Face
storage reader reads those slices from the safetensors files (``safe_open(...).get_slice``): no rank reads a tensor
it does not hold, none holds the whole model. Fused projections dealt to ranks in strided pieces are described
piece by piece, and every tensor in blocks of rows of at most :data:`READ_BLOCK_BYTES`
(:func:`lightning_hybrid.checkpoint.dcp_io.in_row_blocks`), so a rank holds its shards plus one such block.

Names: the ``PreTrainedModel`` inside the LightningModule is found by type; its path (``model.`` for
``self.model = AutoModelForCausalLM...``) is stripped from the LightningModule's names. A weight Hugging Face saves
once because it is tied (``lm_head.weight`` to the token embedding, ``all_tied_weights_keys``) is read from its
source's name, also on a pipeline stage that holds only the tied copy. A checkpoint saved under other names or in
pieces (transformers 5 stores a mixture of experts per expert and stacks it in the model) is read through
transformers' own conversion mapping (:mod:`.hf_convert`): renamed tensors by DCP as the others, each stacked
tensor whole (one layer's experts at a time) and sliced to this rank's shard. Missing, unexpected or shape-mismatched
names stop loading on every rank with one message listing them, before anything is written.

Example::

    HybridStrategy(tp=2, pp=2, weights="checkpoints/llama-3.2-1b")   # applied right after sharding
    load_pretrained(lightning_module, "checkpoints/llama-3.2-1b")     # the same, by hand, on every rank
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_hybrid.checkpoint.dcp_io import in_row_blocks
from lightning_hybrid.checkpoint.hf_convert import (Converted, conversion_plan, converted_shape, read_converted,
                                                    stored_files)

#: The most a rank reads at once (the Hugging Face reader materializes each box it is asked for before copying it).
READ_BLOCK_BYTES = 16 * 2**20


def load_pretrained(module: nn.Module, directory: Union[str, os.PathLike]) -> None:
    """Fill ``module``'s parameters and persistent buffers (as sharded, on every rank; a collective) from the Hugging
    Face checkpoint ``directory`` for the ``PreTrainedModel`` it contains."""
    directory = Path(directory)
    prefix, tied, pretrained = _pretrained_model(module)
    shapes, stored_as, converted = _checkpoint_as_named(pretrained, directory)
    local = {name[len(prefix):]: tensor for name, tensor in get_model_state_dict(module).items()
             if name.startswith(prefix)}
    # Where each local tensor's values are stored: its own name, or a tied weight's source (saved once).
    sources = {name: name if name in shapes else tied.get(name, name) for name in local}
    buffers = {name[len(prefix):] for name, _ in module.named_buffers() if name.startswith(prefix)}
    _check_names(directory, shapes, local, sources, buffers)
    local = {name: tensor for name, tensor in local.items() if sources[name] in shapes}
    files = stored_files(directory) if converted else {}
    with torch.no_grad():
        for name, tensor in local.items():
            if sources[name] in converted:  # stored in pieces (experts one by one): read whole, then this shard
                _copy_whole_into(tensor, read_converted(directory, converted[sources[name]], files))
    # One DCP load per distinct source name: a tied copy held next to its source is read in a second pass.
    first: dict[str, torch.Tensor] = {}
    second: dict[str, torch.Tensor] = {}
    for name, tensor in local.items():
        if sources[name] in converted:
            continue
        target = first if stored_as[sources[name]] not in first else second
        if not any(tensor is held for held in first.values()):
            target[stored_as[sources[name]]] = tensor
    for state in (first, second):
        blocks = {name: in_row_blocks(tensor, READ_BLOCK_BYTES) for name, tensor in state.items()}
        with torch.no_grad():
            dcp.load(blocks, storage_reader=_reader(directory))


def loaded_names(module: nn.Module, directory: Union[str, os.PathLike]) -> set[str]:
    """The names (in ``module``) of the parameters and buffers :func:`load_pretrained` will overwrite from
    ``directory``: materialization need not initialize them."""
    prefix, tied, pretrained = _pretrained_model(module)
    stored = _checkpoint_as_named(pretrained, Path(directory))[0]
    names = [name for name, _ in [*module.named_parameters(remove_duplicate=False),
                                  *module.named_buffers(remove_duplicate=False)] if name.startswith(prefix)]
    return {name for name in names
            if (short := name[len(prefix):]) in stored or tied.get(short, short) in stored}


def _checkpoint_as_named(pretrained: nn.Module, directory: Path) -> tuple[dict, dict[str, str], dict[str, Converted]]:
    """The checkpoint under the model's names (transformers' conversion mapping applied, :mod:`.hf_convert`):
    ``(shapes, stored_as, converted)`` — every model name's stored shape, the stored name of each tensor stored
    whole, and the tensors stored in pieces."""
    stored = {name: tuple(meta.size) for name, meta in _reader(directory).read_metadata().state_dict_metadata.items()}
    renamed, converted = conversion_plan(pretrained, stored)
    pieces = {name for entry in converted.values() for names in entry.sources.values() for name in names}
    stored_as = {name: name for name in stored if name not in pieces and name not in renamed.values()}
    stored_as.update(renamed)
    shapes = {name: stored[source] for name, source in stored_as.items()}
    shapes.update({name: converted_shape(entry, stored) for name, entry in converted.items()})
    return shapes, stored_as, converted


def _copy_whole_into(tensor: torch.Tensor, whole: torch.Tensor) -> None:
    """Copy this rank's part of ``whole`` into ``tensor`` (a DTensor shard — sliced here, no communication — or a
    plain tensor)."""
    if isinstance(tensor, DTensor):
        part = distribute_tensor(whole.to(tensor.dtype), tensor.device_mesh, tensor.placements, src_data_rank=None)
        tensor.to_local().copy_(part.to_local())
    else:
        tensor.copy_(whole)


def _pretrained_model(module: nn.Module) -> tuple[str, dict[str, str], nn.Module]:
    """The outermost ``PreTrainedModel``'s name prefix, its tied ``{target: source}`` names, and itself."""
    try:
        from transformers import PreTrainedModel
    except ImportError as error:
        raise ImportError("Loading a Hugging Face checkpoint needs the `transformers` package.") from error
    for name, candidate in module.named_modules():
        if isinstance(candidate, PreTrainedModel):
            tied = dict(getattr(candidate, "all_tied_weights_keys", None) or {})
            if not candidate.config.tie_word_embeddings:
                tied = {}
            return (f"{name}." if name else ""), tied, candidate
    raise ValueError(
        f"HybridStrategy(weights=...) loads a Hugging Face checkpoint into the transformers.PreTrainedModel of the"
        f" LightningModule, but {type(module).__name__} holds none. Load other weights in configure_model (before"
        " sharding) or with Lightning's checkpoint loading."
    )


def _reader(directory: Path) -> Any:
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    if not directory.is_dir() or not any(directory.glob("*.safetensors")):
        raise FileNotFoundError(f"{directory} is not a Hugging Face checkpoint directory: no *.safetensors files.")
    return HuggingFaceStorageReader(str(directory))


def _check_names(directory: Path, stored: dict[str, tuple[int, ...]], local: dict[str, torch.Tensor],
                 sources: dict[str, str], buffers: set[str]) -> None:
    """Every rank raises the same error if the checkpoint does not match the whole model (pipeline ranks hold
    different names, so they compare the union). Buffers a checkpoint lacks keep their initialized values
    (Hugging Face does not save every persistent buffer, e.g. position ids)."""
    wanted = {sources[name]: (tuple(tensor.shape), name in buffers) for name, tensor in local.items()}
    everyone: list[Any] = [wanted]
    if dist.is_available() and dist.is_initialized():
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, wanted)
    model = {name: shape for held in everyone for name, (shape, _) in held.items()}
    optional = {name for held in everyone for name, (_, is_buffer) in held.items() if is_buffer}
    missing = sorted(model.keys() - stored.keys() - optional)
    unexpected = sorted(stored.keys() - model.keys())
    mismatched = sorted(f"{name} {stored[name]} vs model {shape}" for name, shape in model.items()
                        if name in stored and stored[name] != shape)
    if missing or unexpected or mismatched:
        raise ValueError(
            f"The Hugging Face checkpoint {directory} does not match the model: missing {missing},"
            f" unexpected {unexpected}, shape mismatches {mismatched}. Is it a checkpoint of another model or"
            " configuration? Nothing was loaded."
        )
