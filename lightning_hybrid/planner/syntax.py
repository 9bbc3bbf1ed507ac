"""The words a layout is written in (``lightning-hybrid plan --layout "tp8 pp8 interleaved_1f1b m96 ac"``), read
without torch so that the command's ``--help`` can quote them. :func:`~lightning_hybrid.planner.layout.parse_layout`
builds the :class:`~lightning_hybrid.planner.layout.Layout`; ``str(layout)`` writes the same words.

Example::

    layout_words("tp8 pp8 1f1b m64 ac")   # {"tp": 8, "pp": 8, "pp_schedule": "1f1b", "microbatches": 64, ...}
"""

from __future__ import annotations

import re
from typing import Any

from lightning_hybrid.options.schedules import SCHEDULES

_DEGREES = {"dp": "dp", "tp": "tp", "pp": "pp", "rep": "dp_replicate", "ep": "ep", "cp": "cp", "acc": "accumulate",
            "m": "microbatches",
            "v": "virtual_stages", "z": "zero"}
_FLAGS = {"whole-vocab": ("shard_vocab", False), "compile": ("compile", True), "offload": ("offload", True),
          "loss-parallel": ("loss_parallel", True)}
LAYOUT_SYNTAX = ("words separated by spaces: dpN tpN ppN repN (dp_replicate) epN (experts over N dp ranks) cpN"
                 " (each sequence over N ranks) accN (accumulate_grad_batches) mN"
                 " (microbatches) vN (virtual stages) zN (ZeRO level), a pp_schedule name, ac | ac=selective | ac=N |"
                 " ac=none, whole-vocab, compile, offload, loss-parallel, reduce=bf16")


def layout_words(text: str) -> dict[str, Any]:
    """The Layout fields ``text`` gives (names as :class:`~lightning_hybrid.planner.layout.Layout` spells them);
    an unknown word raises ``ValueError`` quoting :data:`LAYOUT_SYNTAX`."""
    values: dict[str, Any] = {}
    for word in text.replace(",", " ").lower().split():
        values.update(_read_word(word, text))
    return values


def _read_word(word: str, text: str) -> dict[str, Any]:
    match = re.fullmatch(r"(dp|tp|pp|rep|ep|cp|acc|m|v|z)(\d+)", word)
    if match:
        return {_DEGREES[match[1]]: int(match[2])}
    if word.replace("-", "_") in SCHEDULES:
        return {"pp_schedule": word.replace("-", "_")}
    if word in _FLAGS:
        return dict([_FLAGS[word]])
    if word == "ac" or word.startswith("ac="):
        mode = word[3:] or "every"
        return {"activation_checkpointing": int(mode) if mode.isdigit() else None if mode == "none" else mode}
    if word.startswith("reduce="):
        return {"reduce_dtype": word[len("reduce="):]}
    raise ValueError(f"layout {text!r}: cannot read {word!r}. A layout is written as {LAYOUT_SYNTAX}.")
