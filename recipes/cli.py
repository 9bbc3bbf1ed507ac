"""What the recipes' command lines share: ``LightningCLI`` with the recipe's yaml as the default config file of every
subcommand, and ``fit`` as the subcommand when the arguments do not start with one, so that ``python
recipes/pretrain_gpt.py`` alone trains with the yaml's values and ``python recipes/pretrain_gpt.py
--trainer.max_steps 50`` is ``... fit --trainer.max_steps 50``.

Usage::

    run_cli(PretrainCLI, GPTLightning, GrammarDataModule, Path("recipes/configs/gpt_tiny.yaml"))
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

__all__ = ["run_cli", "with_subcommand"]


def with_subcommand(args: list[str]) -> list[str]:
    """``args`` with ``fit`` in front unless they start with a subcommand (``fit``, ``validate``, ...)."""
    return args if args[:1] and args[0] in LightningCLI.subcommands() else ["fit", *args]


def run_cli(cli_class: type[LightningCLI], model_class: type[LightningModule],
            datamodule_class: type[LightningDataModule], config: Path, args: list[str] | None = None) -> LightningCLI:
    """Parse ``args`` (default ``sys.argv[1:]``) over the defaults in ``config``, instantiate and run."""
    # The recipe hands LightningCLI the command line itself (with `fit` added), which LightningCLI warns about.
    warnings.filterwarnings("ignore", ".*LightningCLI's args parameter is intended to run from within Python.*")
    # The recipes' data are in memory: DataLoader worker processes would only add start-up time.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    # `ckpt_path: last` means "resume if there is a checkpoint": a first run has none, which Lightning warns about
    # with a hint to set save_last=True that the recipe already sets (the run's summary says where it started).
    warnings.filterwarnings("ignore", r'.*ckpt_path="last"\) is set, but there is no last checkpoint available.*')
    # Lightning 2.6.6's CombinedLoader builds a pytree LeafSpec, which torch 2.13 deprecates: Lightning's own call,
    # once per validation loader and rank, that nothing in the recipe can change.
    warnings.filterwarnings("ignore", r".*isinstance\(treespec, LeafSpec\)` is deprecated.*",
                            module=r"lightning\.pytorch\.utilities\._pytree")
    defaults = {"default_config_files": [str(config)]}
    return cli_class(
        model_class, datamodule_class,
        parser_kwargs={name: defaults for name in LightningCLI.subcommands()},
        args=with_subcommand(sys.argv[1:] if args is None else args),
        auto_configure_optimizers=False,  # the modules configure their own optimizers
        # The checkpoints keep the modules' own hyperparameters (plain values), not LightningCLI's parsed config and
        # its `_instantiator`, which the Hugging Face export would pass to the constructor as one more argument.
        load_from_checkpoint_support=False,
    )
