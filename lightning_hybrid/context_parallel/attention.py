"""Attention on the whole sequence while a block runs on its part: the call found and exchanged, never rewritten.

Two ways a block's attention is reached, both without changing the model's code:

* **``F.scaled_dot_product_attention``** (custom modules, torchtitan-style code, and Hugging Face's ``"sdpa"``
  implementation underneath): a ``TorchFunctionMode`` active while the block runs takes the call;
* **Hugging Face's attention interface** (every implementation: ``"eager"``, ``"sdpa"``, flash, flex): while the block
  runs, its attention modules' config names a function registered in ``transformers``' ``AttentionInterface``,
  which calls the model's own implementation.

Either way the queries, keys and values arrive with this rank's positions of every head; :func:`exchanged_call`
turns each that holds this rank's positions into every position of ``heads / N`` heads
(:func:`~.exchange.sequence_to_heads`; one that already holds every position, an encoder's output for
cross-attention, is cut to those heads), calls the attention (masks, causality, windows, scaling: the model's own,
on the whole sequence) and turns the result back. Key/value heads that do not divide by ``N`` (grouped-query
attention under tp) are repeated to the query heads first.

Why this exchange (DeepSpeed-Ulysses') and not ring attention: it calls the model's own attention, whatever its
kernel, mask or window (torch's ``context_parallel`` ring attention dispatches only CUDA SDPA kernels, so it could
neither run nor be tested here on CPU, nor serve eager or masked attention); each rank computes every position of
its heads, so a causal triangle costs every rank the same and needs no load balancing; its bytes per rank fall
with cp (4 × b·s·h / cp each way, forward). What it needs: query heads (per tp rank) divisible by cp.

:class:`AttentionCalls` is the same interception for the setup check (:mod:`.plan`): it records each call of the
unsplit block, then answers a part's run with the recorded result, checking what the part passed.

Example::

    with routed_attention(block, ExchangedAttention(group)):
        output = block(*local_args)      # every attention call exchanged over the group
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any, Callable, Iterator, Optional

import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid.context_parallel.exchange import ContextGroup, heads_to_sequence, part, sequence_to_heads

#: The name this package registers in Hugging Face's ``AttentionInterface``.
HF_ATTENTION = "lightning_hybrid_context_parallel"
#: The handler of the block running now (innermost last), each attention config's own implementation, and how
#: many Hugging Face implementations are running (their own F.scaled_dot_product_attention is not taken again).
_HANDLERS: list["AttentionHandler"] = []
_ORIGINAL: dict[int, str] = {}
_INSIDE_HF = [0]
#: ``F.scaled_dot_product_attention``'s arguments after the queries, keys and values, in order.
_SDPA_OPTIONS = ("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class AttentionHandler:
    """What happens to one attention call: ``sdpa(q, k, v, **kw)`` for ``F.scaled_dot_product_attention`` (output
    ``(…, h, L, d)``), ``hf(function, module, q, k, v, mask, **kw)`` for the interface (output ``(B, L, h, d)``)."""

    def sdpa(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        raise NotImplementedError

    def hf(self, function: Callable, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Optional[Tensor], **kwargs: Any) -> tuple[Tensor, Any]:
        raise NotImplementedError


class ExchangedAttention(AttentionHandler):
    """Training's handler: every call exchanged over ``group`` (see the module docstring)."""

    def __init__(self, group: ContextGroup) -> None:
        self.group = group

    def sdpa(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        if query.dim() != 4:
            raise ValueError(f"HybridStrategy(cp={self.group.size}): scaled_dot_product_attention was called with"
                             f" {query.dim()}-D queries; context parallelism exchanges (batch, heads, positions, dim).")
        query, key, value, _ = self._to_heads(query, key, value)
        kwargs["attn_mask"] = self._mask(kwargs.get("attn_mask"))
        output = F.scaled_dot_product_attention(query, key, value, **kwargs)
        return heads_to_sequence(output, 2, 1, self.group)

    def hf(self, function: Callable, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Optional[Tensor], **kwargs: Any) -> tuple[Tensor, Any]:
        groups = getattr(module, "num_key_value_groups", None)
        query, key, value, repeat = self._to_heads(query, key, value)
        mask = self._mask(attention_mask)
        with _attribute(module, "num_key_value_groups", groups // repeat if repeat > 1 and groups else groups):
            output, weights = function(module, query, key, value, mask, **kwargs)
        return heads_to_sequence(output, 1, 2, self.group), weights

    def _to_heads(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
        """``(B, heads, positions, dim)`` queries, keys and values on this rank's heads over every position, and
        how often each key/value head was repeated to divide over the group. One holding this rank's positions is
        exchanged; one holding every position already (cross-attention) is cut to this rank's heads."""
        repeat = _kv_repeat(query.shape[1], key.shape[1], self.group.size)
        if repeat > 1:
            key, value = key.repeat_interleave(repeat, 1), value.repeat_interleave(repeat, 1)
        local = query.shape[2]
        query, key, value = (sequence_to_heads(t, 2, 1, self.group) if t.shape[2] == local else part(t, 1, self.group)
                             for t in (query, key, value))
        return query, key, value, repeat

    def _mask(self, mask: Any) -> Any:
        """The mask for this rank's heads: a per-head mask cut to them, a broadcast one as it is."""
        if not isinstance(mask, Tensor) or mask.dim() != 4 or mask.shape[1] == 1:
            return mask
        return part(mask, 1, self.group)


def _kv_repeat(query_heads: int, kv_heads: int, size: int) -> int:
    """How often to repeat each key/value head so that the heads divide over the group (1: they already do)."""
    if query_heads % size:
        raise ValueError(f"HybridStrategy(cp={size}) deals the attention heads to the cp ranks, but a block's"
                         f" attention has {query_heads} query heads on this rank (after tp). Use a cp (× tp) that"
                         " divides the heads.")
    return 1 if kv_heads % size == 0 else query_heads // kv_heads


class _SdpaMode(TorchFunctionMode):
    def __init__(self, handler: AttentionHandler) -> None:
        super().__init__()
        self.handler = handler

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and not _INSIDE_HF[0]:
            query, key, value, *rest = args  # the options by name (a mask may be passed by position)
            return self.handler.sdpa(query, key, value, **dict(zip(_SDPA_OPTIONS, rest)), **kwargs)
        return func(*args, **kwargs)


def _hf_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                  **kwargs: Any) -> tuple[Tensor, Any]:
    """The function registered in Hugging Face's ``AttentionInterface``: the module's own implementation, called by
    the running block's handler (outside any block: plainly)."""
    function = _own_implementation(module)
    if not _HANDLERS:
        return function(module, query, key, value, attention_mask, **kwargs)
    with _suspended():  # the implementation's own F.scaled_dot_product_attention is not exchanged again
        return _HANDLERS[-1].hf(function, module, query, key, value, attention_mask, **kwargs)


def _own_implementation(module: nn.Module) -> Callable:
    name = _ORIGINAL[id(module.config)]
    if name == "eager":  # not registered: each modeling file defines its own, the default its modules pass
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def attention_configs(block: nn.Module) -> list[Any]:
    """The Hugging Face configs the block's modules read their attention implementation from (none: not HF) whose
    implementation can be found: a registered one, or ``"eager"`` with the modeling file's
    ``eager_attention_forward`` (a module without it is left alone: its attention is not reached, the block stays
    whole)."""
    found = {}
    for module in block.modules():
        config = getattr(module, "config", None)
        name = getattr(config, "_attn_implementation", None)
        if name is None or (name == "eager" and not hasattr(sys.modules[type(module).__module__],
                                                              "eager_attention_forward")):
            continue
        found[id(config)] = config
    return list(found.values())


@contextlib.contextmanager
def routed_attention(block: nn.Module, handler: AttentionHandler) -> Iterator[None]:
    """Within it, every attention call the block makes goes to ``handler`` (see the module docstring)."""
    configs = attention_configs(block)
    if configs:
        _register_hf()
    saved = [(config, config._attn_implementation) for config in configs]
    _HANDLERS.append(handler)
    try:
        for config, name in saved:
            if name != HF_ATTENTION:
                _ORIGINAL[id(config)] = name
                config._attn_implementation = HF_ATTENTION
        with _SdpaMode(handler):
            yield
    finally:
        _HANDLERS.pop()
        for config, name in saved:
            config._attn_implementation = name


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """The F.scaled_dot_product_attention mode off while Hugging Face's implementation runs (it may call it)."""
    _INSIDE_HF[0] += 1
    try:
        yield
    finally:
        _INSIDE_HF[0] -= 1


@contextlib.contextmanager
def _attribute(module: nn.Module, name: str, value: Any) -> Iterator[None]:
    if value is None or not hasattr(module, name):
        yield
        return
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _register_hf() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(HF_ATTENTION, _hf_attention)  # a dict update: the same entry each time
