"""The ``lightning-hybrid`` command.

Usage::

    lightning-hybrid export CHECKPOINT_FOLDER OUTPUT [--safetensors]
    python -m lightning_hybrid export CHECKPOINT_FOLDER OUTPUT      # the same without the installed script
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from lightning_hybrid.export import export_checkpoint


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hybrid", description="Tools for HybridStrategy runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser(
        "export",
        help="consolidate a sharded checkpoint into one file with the unmodified module's state dict",
        description="Consolidate a sharded checkpoint folder (any layout) into one Lightning checkpoint file"
        " (loadable with YourModule.load_from_checkpoint) or, with --safetensors, a .safetensors state dict.",
    )
    export.add_argument("checkpoint", help="sharded checkpoint folder written by HybridStrategy")
    export.add_argument("output", help="file to write")
    export.add_argument("--safetensors", action="store_true", help="write the state dict in safetensors format")
    args = parser.parse_args(argv)
    try:
        path = export_checkpoint(args.checkpoint, args.output, safetensors=args.safetensors)
    except (ValueError, ImportError) as error:
        parser.exit(2, f"lightning-hybrid export: error: {error}\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
