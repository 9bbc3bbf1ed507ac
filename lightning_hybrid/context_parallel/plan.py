"""Which blocks context parallelism splits, and how: found and proved at setup on one call of each block structure.

A block can run on its part of the sequence when every operation in it acts per position except its attention,
whose call is exchanged (:mod:`.attention`). That is not read from names or classes but checked, on the first
block of each structure with the call the setup probe recorded (:mod:`lightning_hybrid.probe.record`), in one
process and without communication:

1. the block runs whole, its attention calls recorded (queries, keys, values, mask, result); their query length
   ``S`` is the sequence. None: nothing to exchange, the block stays whole;
2. each argument with exactly one dimension of length ``S`` is split along it (hidden states, rotary tables,
   position ids); the others stay whole (a ``(B, 1, S, S)`` mask, a conditioning vector, an encoder's output);
3. the block runs once per part of the ``N`` parts, its attention answered with the part's rows of the recorded
   result, after checking that the part's queries, keys and values are the recorded ones' rows (so positions,
   rotary angles and masks reached the attention as in the whole run) and that its mask is the whole run's;
4. the parts' outputs, put back together along the output's dimension of length ``S``, must equal the whole
   output; an output without that dimension must be the same in every part.

Any difference means the block mixes positions outside its attention (a convolution over time, a selective scan,
a norm over the sequence) or computes positions itself: it stays whole on every rank of the group — correct,
without the memory saving — and the reason is reported. Dropout is off for the check; buffers and random streams
are left as they were. A model on the meta device is planned from shapes alone (steps 1, 2 and the output's
dimension), reported as unchecked.

Example::

    plan = plan_block(model.layers[0], probe.record().block_calls[0], parts=2)
    plan.split          # {0: 1, 3: 1, 4: 1}: hidden states, cos and sin along dim 1; the mask (leaf 2) whole
    plan.gather         # {0: 1}
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid._compat import tree_flatten, tree_unflatten
from lightning_hybrid.context_parallel.attention import AttentionHandler, routed_attention
from lightning_hybrid.context_parallel.exchange import positions
from lightning_hybrid.probe.record import BlockCall
from lightning_hybrid.probe.step_probe import leaving_no_trace

#: Largest difference, relative to the largest magnitude, between a part's value and the whole run's rows: far
#: above what splitting a matmul into parts changes, far below what a value from other positions does.
TOLERANCE = 1e-4


@dataclass
class BlockPlan:
    """How a block runs on its part: argument leaves (``tree_flatten((args, kwargs))`` order) split along a
    dimension, output leaves gathered along one; the sequence length and heads it was planned with."""

    leaves: int
    split: dict[int, int]
    gather: dict[int, int]
    length: int
    heads: int
    checked: bool


class Mismatch(Exception):
    """A part's run differs from the whole run's (the message says where)."""


@dataclass
class _Call:
    kind: str  # "sdpa" or "hf"
    query: Tensor
    key: Tensor
    value: Tensor
    mask: Any
    output: Tensor
    weights: Any = None


class _Recording(AttentionHandler):
    def __init__(self) -> None:
        self.calls: list[_Call] = []

    def sdpa(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        output = F.scaled_dot_product_attention(query, key, value, **kwargs)
        self.calls.append(_Call("sdpa", query, key, value, kwargs.get("attn_mask"), output))
        return output

    def hf(self, function: Callable, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Optional[Tensor], **kwargs: Any) -> tuple[Tensor, Any]:
        output, weights = function(module, query, key, value, attention_mask, **kwargs)
        self.calls.append(_Call("hf", query, key, value, attention_mask, output, weights))
        return output, weights


class _Replay(AttentionHandler):
    """A part's attention calls answered with the recorded results' rows, after checking what the part passed."""

    def __init__(self, calls: list[_Call], index: int, parts: int, checked: bool) -> None:
        self.calls, self.index, self.parts, self.checked, self.next = calls, index, parts, checked, 0

    def sdpa(self, query: Tensor, key: Tensor, value: Tensor, **kwargs: Any) -> Tensor:
        return self._answer("sdpa", query, key, value, kwargs.get("attn_mask"))[0]

    def hf(self, function: Callable, module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
           attention_mask: Optional[Tensor], **kwargs: Any) -> tuple[Tensor, Any]:
        return self._answer("hf", query, key, value, attention_mask)

    def _answer(self, kind: str, query: Tensor, key: Tensor, value: Tensor, mask: Any) -> tuple[Tensor, Any]:
        if self.next >= len(self.calls) or self.calls[self.next].kind != kind:
            raise Mismatch("its attention is called differently on a part of the sequence")
        call, self.next = self.calls[self.next], self.next + 1
        if self.checked:
            for name, got, whole in (("queries", query, call.query), ("keys", key, call.key),
                                     ("values", value, call.value)):
                expected = self._rows(whole, 2) if got.shape[2] != whole.shape[2] else whole
                _require_close(got, expected, f"its attention's {name} on a part of the sequence")
            if isinstance(call.mask, Tensor):
                _require_close(mask, call.mask, "its attention mask on a part of the sequence")
        return self._rows(call.output, 2 if kind == "sdpa" else 1), call.weights

    def _rows(self, tensor: Tensor, dim: int) -> Tensor:
        return positions(tensor, dim, self.index, self.parts)


def plan_block(block: nn.Module, call: BlockCall, parts: int) -> Union[BlockPlan, str]:
    """The block's plan for ``parts`` ranks, or why it stays whole (see the module docstring)."""
    leaves, spec = tree_flatten(call)
    checked = not any(isinstance(x, Tensor) and x.is_meta for x in [*leaves, *block.parameters()])
    recording = _Recording()
    whole = _run(block, call, recording)
    if not recording.calls:
        return "no attention call found in it (nothing to exchange)"
    length, heads = recording.calls[0].query.shape[2], recording.calls[0].query.shape[1]
    if length % parts or heads % parts:
        return f"its attention's {length} positions and {heads} heads do not both divide into {parts} parts"
    split = {i: _sequence_dims(x, length)[0] for i, x in enumerate(leaves) if len(_sequence_dims(x, length)) == 1}
    if not split:
        return f"no argument has the attention's {length} positions as a dimension"
    try:
        outputs = [_run(block, _part_call(leaves, spec, split, index, parts),
                        _Replay(recording.calls, index, parts, checked)) for index in range(parts)]
        gather = _gathered_outputs(whole, outputs, length, checked)
    except Mismatch as mismatch:
        return f"{mismatch}: it mixes positions outside its attention, or computes positions itself"
    except Exception as error:  # a block that cannot run on a part at all stays whole too, with what it raised
        return f"it fails on a part of the sequence ({type(error).__name__}: {error})"
    return BlockPlan(len(leaves), split, gather, length, heads, checked)


def _sequence_dims(value: Any, length: int) -> list[int]:
    return [d for d, size in enumerate(value.shape) if size == length] if isinstance(value, Tensor) else []


def _part_call(leaves: list, spec: Any, split: dict[int, int], index: int, parts: int) -> BlockCall:
    return tree_unflatten([positions(value, split[i], index, parts) if i in split else value
                           for i, value in enumerate(leaves)], spec)


def _gathered_outputs(whole: Any, parts: list[Any], length: int, checked: bool) -> dict[int, int]:
    """Output leaf → the dimension its parts are put together along; the others must equal the whole output's."""
    whole_leaves, _ = tree_flatten(whole)
    part_leaves = [tree_flatten(output)[0] for output in parts]
    gather = {}
    for i, value in enumerate(whole_leaves):
        pieces = [leaves[i] for leaves in part_leaves]
        if not isinstance(value, Tensor):
            if any(piece != value for piece in pieces):
                raise Mismatch("a non-tensor output differs on a part of the sequence")
            continue
        dims = [d for d in _sequence_dims(value, length) if pieces[0].shape[d] == length // len(parts)]
        if len(dims) == 1:
            gather[i] = dims[0]
            if checked:
                _require_close(torch.cat(pieces, dims[0]), value, "its output put together from the parts")
        elif checked:
            for piece in pieces:
                _require_close(piece, value, "an output without the sequence dimension")
    return gather


def _require_close(got: Any, expected: Tensor, what: str) -> None:
    if not isinstance(got, Tensor) or got.shape != expected.shape:
        raise Mismatch(f"{what} has another shape than in the whole run")
    if not got.is_floating_point():
        if not torch.equal(got, expected):
            raise Mismatch(f"{what} differs from the whole run's")
        return
    scale = expected.detach().abs().max().float().clamp(min=1.0)
    if (got.detach().float() - expected.detach().float()).abs().max() > TOLERANCE * scale:
        raise Mismatch(f"{what} differs from the whole run's")


def _run(block: nn.Module, call: BlockCall, handler: AttentionHandler) -> Any:
    args, kwargs = copy.deepcopy(call)  # each run its own objects: a key/value cache the block appends to
    device = next((p.device for p in block.parameters()), torch.device("cpu"))
    with leaving_no_trace(block, device), torch.no_grad(), _dropout_off(block), routed_attention(block, handler):
        torch.manual_seed(0)
        return block(*args, **kwargs)


@contextlib.contextmanager
def _dropout_off(block: nn.Module) -> Iterator[None]:
    dropouts = [(m, m.p) for m in block.modules() if isinstance(m, nn.modules.dropout._DropoutNd)]
    for module, _ in dropouts:
        module.p = 0.0
    try:
        yield
    finally:
        for module, p in dropouts:
            module.p = p
