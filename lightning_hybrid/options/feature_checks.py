"""Checks of HybridStrategy's single-feature arguments (loss parallel, asynchronous checkpoints, the gradient
reduction dtype, the watchdog bound, ``torch.compile``'s arguments), kept apart from
:mod:`lightning_hybrid.options.hybrid_options` so that it reads as the layout's options. Each raises ``ValueError``
naming the argument and what to pass instead.

Example::

    checked_reduce_dtype("bfloat16")        # "bf16"
    check_loss_parallel(True, tp=1, pp=1, shard_vocab=True)   # ValueError: tp=1 shards nothing
    compile_arguments({"mode": "max-autotune-no-cudagraphs"})   # the dict; True → {}, False → None
"""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional, Union

import torch

from lightning_hybrid.checks import check_positive


def check_loss_parallel(loss_parallel: object, tp: object, pp: object, shard_vocab: bool) -> None:
    """Refuse ``loss_parallel=True`` where no head can be sharded over the vocabulary (with ``tp="auto"`` that is
    known at setup: :func:`lightning_hybrid.tensor_parallel.loss_parallel.require_sharded_head`)."""
    if not isinstance(loss_parallel, bool):
        raise ValueError(f"HybridStrategy(loss_parallel={loss_parallel!r}) is invalid: pass True (the loss computed"
                         " from logits sharded over the vocabulary) or False (logits gathered, the default).")
    if not loss_parallel:
        return
    if tp == 1:
        raise ValueError("HybridStrategy(loss_parallel=True) computes the loss from logits sharded over the"
                         " tensor-parallel ranks, but tp=1 shards nothing: pass tp=N (N > 1) or drop loss_parallel.")
    if not shard_vocab:
        raise ValueError("HybridStrategy(loss_parallel=True, shard_vocab=False): with shard_vocab=False the head stays"
                         " whole, so its logits are not sharded over the vocabulary. Pass shard_vocab=True or drop"
                         " loss_parallel.")
    if pp != 1:
        # Under a pipeline the loss is computed on the last stage inside torch's schedule, where this strategy's
        # step context does not reach, and its output is sent between ranks as a plain tensor.
        raise ValueError(f"HybridStrategy(loss_parallel=True, pp={pp!r}) is not supported: with a pipeline the loss"
                         " is computed on the last stage inside the pipeline schedule. Drop loss_parallel (the"
                         " logits are then gathered) or use pp=1.")


#: What each boolean argument's ``True`` and ``False`` mean, for the error a non-boolean gets.
_FLAG_MEANINGS = {
    "offload": ("CPU offload", "none"),
    "shard_vocab": ("shard the embedding and head over the vocabulary under tp", "keep them whole"),
    "tp_strict": ("refuse at setup what tensor parallelism cannot shard", "keep it whole on every tp rank"),
}


def check_flags(**flags: object) -> None:
    """Refuse a boolean argument given anything but ``True`` or ``False``."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            true, false = _FLAG_MEANINGS[name]
            raise ValueError(f"HybridStrategy({name}={value!r}) is invalid: pass True ({true}) or False ({false}).")


def check_context_parallel(cp: object, compile: object, chooses_layout: bool) -> None:
    """``cp`` a positive integer, with what it does not combine with yet refused."""
    check_positive("HybridStrategy", "cp", cp)
    if cp == 1:
        return
    if compile:
        # The exchange runs around each block's forward and inside its attention call (a TorchFunctionMode and
        # Hugging Face's attention interface), which per-block compilation would have to trace.
        raise ValueError(f"HybridStrategy(cp={cp}, compile=...) is not supported yet: drop compile, or use cp=1.")
    if chooses_layout:
        raise ValueError(f"HybridStrategy(cp={cp}) with tp='auto' or pp='auto': the layout search does not place"
                         " context parallelism yet. Pass fixed tp and pp (`lightning-hybrid plan --seq-len ...`"
                         " prices cp), or cp=1.")


def check_async_checkpoint(async_checkpoint: object, save_distributed_checkpoint: bool) -> None:
    if not isinstance(async_checkpoint, bool):
        raise ValueError(f"HybridStrategy(async_checkpoint={async_checkpoint!r}) is invalid: pass True (write"
                         " checkpoints in the background) or False.")
    if async_checkpoint and not save_distributed_checkpoint:
        raise ValueError("HybridStrategy(async_checkpoint=True, save_distributed_checkpoint=False): asynchronous saves"
                         " write one DCP shard per rank, and a consolidated file is written by rank 0 alone. Keep"
                         " save_distributed_checkpoint=True, or pass async_checkpoint=False.")


def checked_reduce_dtype(value: object) -> Optional[str]:
    names = {"fp32": "fp32", "float32": "fp32", "bf16": "bf16", "bfloat16": "bf16"}
    if value is None:
        return None
    name = str(value).removeprefix("torch.")  # torch.bfloat16 is accepted too
    if name not in names:
        raise ValueError(f"HybridStrategy(reduce_dtype={value!r}) is not a gradient reduction dtype: pass 'bf16'"
                         " (half the gradient traffic) or 'fp32' (the default).")
    return names[name]


def checked_watchdog_timeout(value: object) -> Optional[float]:
    if value is None or (value == 0 and not isinstance(value, bool)):
        return None
    check_positive("HybridStrategy", "watchdog_timeout", value, integer=False,
                   also=" of seconds (default 180), or None / 0 to turn the watchdog off")
    return float(value)  # type: ignore[arg-type]


Compile = Union[bool, Mapping[str, Any]]


def compile_arguments(value: Compile) -> Optional[dict[str, Any]]:
    """The ``torch.compile`` keyword arguments of ``HybridStrategy(compile=value)``: ``None`` for no
    compilation, ``{}`` for ``True``, the dict's items otherwise. Anything else, or a key ``torch.compile`` does
    not take, raises a ``ValueError`` naming what to pass."""
    if value is True or value is False:
        return {} if value else None
    accepted = sorted(set(inspect.signature(torch.compile).parameters) - {"model"})
    if not isinstance(value, Mapping):
        raise ValueError(f"HybridStrategy(compile={value!r}) is invalid: pass True (torch.compile every block), False,"
                         f" or a dict of torch.compile keyword arguments ({', '.join(accepted)}), e.g."
                         " {'mode': 'max-autotune-no-cudagraphs'}.")
    unknown = sorted(str(key) for key in value if key not in accepted)
    if unknown:
        raise ValueError(f"HybridStrategy(compile={dict(value)!r}): {', '.join(unknown)} are not torch.compile"
                         f" arguments; the dict takes {', '.join(accepted)}.")
    return dict(value)
