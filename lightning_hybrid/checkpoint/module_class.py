"""The module a checkpoint was written from, rebuilt on the meta device from its class path and constructor
arguments: the checkpoint records them (:data:`MODULE_CLASS_KEY`, written by
:mod:`lightning_hybrid.glue.checkpoint_records`), the Hugging Face export rebuilds the module from them
(:mod:`lightning_hybrid.checkpoint.hf_export`), and the planner measures a model named on its command line the same
way (:mod:`lightning_hybrid.planner.model`).

Example::

    module = instantiate_on_meta("recipes.gpt:GPTLightning", {"n_layer": 4})   # no memory, no initialization
    import_class("path/to/script.py:MyModule")
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Mapping

import torch
from torch import nn

#: Key of the module's class path in the checkpoint dict (``meta.pt`` of a sharded checkpoint).
MODULE_CLASS_KEY = "lightning_hybrid_module_class"


def instantiate_on_meta(target: str, kwargs: Mapping[str, Any]) -> nn.Module:
    """``"package.module:ClassName"`` (or ``"path/to/script.py:ClassName"``) built from ``kwargs`` on the meta
    device, ``configure_model()`` included (also the checkpoint export's way to know a module's structure); a
    failure is a ``ValueError`` naming it."""
    module_class = import_class(target)
    try:
        with torch.device("meta"):  # no memory and no initialization: any size can be measured
            module = _construct(module_class, kwargs)
            if callable(getattr(module, "configure_model", None)):
                module.configure_model()
    except Exception as error:  # the user's constructor: report it as bad input, with its message
        raise ValueError(f"Building {target}(**{dict(kwargs)!r}) on the meta device failed: {error!r}") from error
    return module


#: The one rebuilding function a checkpoint may name (``_instantiator``), as in Lightning's own allowlist.
LIGHTNING_CLI_INSTANTIATOR = "lightning.pytorch.cli.instantiate_module"


def _construct(module_class: type, kwargs: Mapping[str, Any]) -> nn.Module:
    """``module_class(**kwargs)``; the hyper-parameters of a ``LightningCLI`` run name its ``instantiate_module`` as
    ``_instantiator`` and keep nested classes as config dicts, so they are rebuilt through it, as Lightning's
    ``load_from_checkpoint`` does."""
    kwargs = dict(kwargs)
    instantiator = kwargs.pop("_instantiator", None)
    if instantiator is None:
        return module_class(**kwargs)
    if instantiator != LIGHTNING_CLI_INSTANTIATOR:
        raise ValueError(f"The checkpoint names the instantiator {instantiator!r}; only {LIGHTNING_CLI_INSTANTIATOR}"
                         " is trusted (pass the constructor's arguments with module_kwargs= / --module-kwargs).")
    from lightning.pytorch.cli import instantiate_module  # needs jsonargparse, as LightningCLI does

    return instantiate_module(module_class, kwargs)


def import_class(target: str) -> type:
    """The class ``"package.module:ClassName"`` names, or ``"path/to/script.py:ClassName"`` (the script imported
    under its own name: its ``if __name__ == "__main__"`` part does not run); a failure is a ``ValueError``."""
    module_name, _, class_name = target.rpartition(":")
    if not module_name or not class_name:
        raise ValueError(f"Expected 'package.module:ClassName', got {target!r}.")
    try:
        if module_name.endswith(".py"):
            spec = importlib.util.spec_from_file_location(Path(module_name).stem, module_name)
            if spec is None or spec.loader is None or not Path(module_name).is_file():
                raise ImportError(f"no script {module_name}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
        return getattr(module, class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"Cannot import {target!r}: {error}") from error
