"""Consolidate a sharded ``HybridStrategy`` checkpoint into one file holding the unmodified module's state dict.

A sharded checkpoint is a ``torch.distributed.checkpoint`` folder (one ``.distcp`` file per rank) plus Lightning's
``meta.pt``. Its tensors are stored under the unmodified LightningModule's parameter names with their global
shapes (fused projections in their original row order), so consolidation needs no process group and no
knowledge of the layout that wrote it: every chunk is read into one full tensor per name, on CPU, in one process.

Two outputs:

* a Lightning checkpoint file (``torch.save``): ``meta.pt``'s entries (epoch, global step, hyperparameters, …)
  but the sharded files' checksums, plus ``state_dict``, without optimizer state, so
  ``MyModule.load_from_checkpoint(path)`` restores the model on one device for inference or fine-tuning;
* ``safetensors=True``: the bare state dict as a ``.safetensors`` file (the LightningModule's parameter names).

Example::

    export_checkpoint("checkpoints/epoch=3-step=4000.ckpt", "model.ckpt")
    export_checkpoint("checkpoints/epoch=3-step=4000.ckpt", "model.safetensors", safetensors=True)

or from a shell: ``lightning-hybrid export checkpoints/epoch=3-step=4000.ckpt model.safetensors --safetensors``.
A Hugging Face model directory (``--hf``, streamed shard by shard): ``checkpoint/hf_export.py``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

import torch

from lightning_hybrid._compat import lightning_metadata_path, read_dcp_in_one_process
from lightning_hybrid.checkpoint.dcp_io import MODULE_STATE_KEY
from lightning_hybrid.checkpoint.integrity import CHECKSUMS_KEY


def require_sharded_checkpoint(checkpoint: Union[str, os.PathLike]) -> Path:
    """``checkpoint`` as a path, if it is a sharded checkpoint folder; else a ``ValueError`` saying what it needs."""
    folder = Path(checkpoint)
    if not (folder / ".metadata").is_file():
        raise ValueError(
            f"{folder} is not a sharded HybridStrategy checkpoint: expected a folder with a '.metadata' file and one"
            " '.distcp' file per rank (written by save_distributed_checkpoint=True). A single-file checkpoint"
            " already holds the full state dict: load it with torch.load."
        )
    return folder


def load_module_state(checkpoint: Union[str, os.PathLike]) -> dict[str, torch.Tensor]:
    """The full (unsharded) module state dict of a sharded checkpoint folder, on CPU."""
    folder = require_sharded_checkpoint(checkpoint)
    return read_dcp_in_one_process(folder, {MODULE_STATE_KEY})[MODULE_STATE_KEY]


def export_checkpoint(
    checkpoint: Union[str, os.PathLike], output: Union[str, os.PathLike], *, safetensors: bool = False
) -> Path:
    """Write the consolidated module state of a sharded checkpoint to ``output`` (see the module docstring) and
    return its path. The file appears complete or not at all (written under a temporary name, then renamed)."""
    state_dict = load_module_state(checkpoint)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=output.parent, prefix=f".{output.name}.", delete=False) as partial:
        partial_path = Path(partial.name)
    try:
        if safetensors:
            _save_safetensors(state_dict, partial_path)
        else:
            lightning_state = torch.load(lightning_metadata_path(Path(checkpoint)), map_location="cpu",
                                         weights_only=False)
            lightning_state.pop(CHECKSUMS_KEY, None)  # records of the sharded folder's files, not of this file
            lightning_state[MODULE_STATE_KEY] = state_dict
            torch.save(lightning_state, partial_path)
        os.replace(partial_path, output)
    finally:
        partial_path.unlink(missing_ok=True)
    return output


def _save_safetensors(state_dict: dict[str, torch.Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as error:
        raise ImportError("safetensors output needs the safetensors package: pip install safetensors") from error
    save_file({name: tensor.contiguous() for name, tensor in state_dict.items()}, str(path), metadata={"format": "pt"})
