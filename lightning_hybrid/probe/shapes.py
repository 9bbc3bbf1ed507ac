"""Output shapes of a unit for inputs of shapes it was not traced with, from how its outputs followed its inputs.

A stand-in (:mod:`lightning_hybrid.pipeline.dispatch`) answers with zeros shaped like the unit's output. With
dynamic padding every batch has another sequence length, and a last batch has fewer samples, so the shapes of the
setup trace alone cannot answer, and running the unit's meta-device copy for every new shape costs Python time per
operation (and some kernels have no working meta version). A :class:`ShapeRelation` instead learns, per unit and
per call *structure* (the nesting, each tensor's rank and dtype kind, plain values other than ints), which input
size each output size follows:

* every output size equal to an input tensor's size (or an int argument) in every call observed *follows* those
  inputs, the same dimension of an input of the same rank first: a block's ``(B, T, D)`` output follows the
  ``(B, T, D)`` hidden state it was given, not the rotary table whose last size happened to equal ``B``;
* an output size equal to no input size is a *constant* (the vocabulary of a head, the width of an embedding),
  trusted for a new call once it stayed the same in an observed call where the same inputs changed;
* anything else (a size several inputs gave in the trace and that now differ, a flattened ``B·T``) is not derived:
  the caller runs the meta-device copy and :meth:`ShapeRelation.observe` narrows the relation with its answer.

Every observation can only remove candidates, so the meta copy runs a bounded number of times per unit, whatever
the number of distinct shapes, and nothing is stored per shape. The rule's limit: an output size that is in truth
constant but equalled an input size in every call observed is taken to follow that input.

Example::

    relation = ShapeRelation(describe_call((x, rope), {}), output_spec(block(x, rope)))
    relation.predict(describe_call((x[:, :10], rope[:10]), {}))  # TensorSpec((B, 10, D), dtype), or None
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor

from lightning_hybrid._compat import tree_flatten, tree_map, tree_unflatten

_PLAIN_VALUES = (bool, float, str, type(None))


@dataclass(frozen=True)
class TensorSpec:
    """What a stand-in needs of a tensor the real module returned: its shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class CallShape:
    """A call's inputs as output shapes can depend on them: ``structure`` (hashable; everything but the sizes),
    ``sizes`` (every tensor dimension and int argument, in order) and, for each size, ``(rank, dimension)`` of its
    tensor (``(0, 0)`` for an int)."""

    structure: tuple
    sizes: tuple[int, ...]
    places: tuple[tuple[int, int], ...]


#: ``str`` of the tree spec of ``(args, {})`` with ``n`` tensor args, by ``n`` (see :func:`_flatten_call`).
_TENSOR_ARGS_SPECS: dict[int, str] = {}


def _flatten_call(args: tuple, kwargs: dict) -> tuple[Sequence[Any], str]:
    """The leaves of ``(args, kwargs)`` and the text of their tree spec. Stand-ins describe every call of another
    stage's unit, and most are ``block(x, ...)`` with tensors only, whose leaves are the args and whose spec depends
    on their number alone: flattening and printing the spec cost several times the rest of the description."""
    if not kwargs and all(isinstance(arg, Tensor) for arg in args):
        if len(args) not in _TENSOR_ARGS_SPECS:
            _TENSOR_ARGS_SPECS[len(args)] = str(tree_flatten((args, kwargs))[1])
        return args, _TENSOR_ARGS_SPECS[len(args)]
    leaves, spec = tree_flatten((args, kwargs))
    return leaves, str(spec)


def describe_call(args: tuple, kwargs: dict) -> CallShape:
    """The :class:`CallShape` of a call. Floating tensors are one kind (mixed precision changes their dtype, not the
    shapes that follow); any other object counts by its class alone: a key/value cache handed to every block
    (Hugging Face decoders pass one even in training) fills up while the step runs."""
    leaves, spec = _flatten_call(args, kwargs)
    structure: list[Any] = [spec]
    sizes: list[int] = []
    places: list[tuple[int, int]] = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            structure.append((leaf.dim(), "floating" if leaf.is_floating_point() else leaf.dtype))
            sizes.extend(leaf.shape)
            places.extend((leaf.dim(), dim) for dim in range(leaf.dim()))
        elif isinstance(leaf, int) and not isinstance(leaf, bool):
            structure.append(int)
            sizes.append(leaf)
            places.append((0, 0))
        elif isinstance(leaf, _PLAIN_VALUES):
            structure.append((type(leaf), leaf))
        else:
            structure.append((type(leaf), None))
    return CallShape(tuple(structure), tuple(int(s) for s in sizes), tuple(places))


def output_spec(output: Any) -> Any:
    """``output`` with every tensor replaced by its :class:`TensorSpec`."""
    return tree_map(lambda v: TensorSpec(tuple(v.shape), v.dtype) if isinstance(v, Tensor) else v, output)


@dataclass
class _Size:
    """What one output size may follow: input positions equal to it in every call observed, or a constant."""

    sources: set[int]
    constant: Optional[int]
    #: Input positions that changed from the first call in a call where this size stayed ``constant``.
    steady_over: set[int] = field(default_factory=set)


class ShapeRelation:
    """How one unit's output shapes follow its input sizes, for calls of one structure (see the module docstring)."""

    def __init__(self, call: CallShape, output: Any) -> None:
        leaves, self._spec = tree_flatten(output)
        self._leaves = leaves
        self._first = call.sizes
        self._sizes = [[_Size({i for i, v in enumerate(call.sizes) if v == size}, size) for size in leaf.shape]
                       for leaf in leaves if isinstance(leaf, TensorSpec)]
        #: Per output size, the input positions at its own place (same rank, same dimension): preferred sources.
        self._aligned = [[{i for i, place in enumerate(call.places) if place == (len(sizes), dim)}
                          for dim in range(len(sizes))] for sizes in self._sizes]

    def observe(self, call: CallShape, output: Any) -> None:
        """Narrow the relation with another call's output (its leaves must match the first call's)."""
        observed = [leaf for leaf in tree_flatten(output)[0] if isinstance(leaf, TensorSpec)]
        changed = {i for i, (a, b) in enumerate(zip(call.sizes, self._first)) if a != b}
        for sizes, leaf in zip(self._sizes, observed, strict=True):
            for entry, size in zip(sizes, leaf.shape, strict=True):
                entry.sources = {i for i in entry.sources if call.sizes[i] == size}
                if entry.constant is not None and entry.constant != size:
                    entry.constant = None
                elif entry.constant is not None:
                    entry.steady_over |= changed

    def predict(self, call: CallShape) -> Optional[Any]:
        """The output (tensors as :class:`TensorSpec`) for ``call``, or ``None`` where some size is not derived."""
        changed = {i for i, (a, b) in enumerate(zip(call.sizes, self._first)) if a != b}
        shapes = []
        for sizes, aligned in zip(self._sizes, self._aligned):
            shape = []
            for entry, own_place in zip(sizes, aligned):
                sources = (entry.sources & own_place) or entry.sources
                values = {call.sizes[i] for i in sources}
                if not entry.sources and entry.constant is not None and changed <= entry.steady_over:
                    values = {entry.constant}
                if len(values) != 1:
                    return None
                shape.append(values.pop())
            shapes.append(tuple(shape))
        specs = iter(shapes)
        leaves = [TensorSpec(next(specs), leaf.dtype) if isinstance(leaf, TensorSpec) else leaf
                  for leaf in self._leaves]
        return tree_unflatten(leaves, self._spec)


class UnitShapes:
    """Every unit's :class:`ShapeRelation`\\ s, one per call structure seen: what the trace records and the
    stand-ins consult."""

    def __init__(self) -> None:
        self._relations: dict[str, dict[tuple, ShapeRelation]] = {}

    def observe(self, name: str, call: CallShape, output: Any) -> None:
        """Record unit ``name``'s output (tensors as :class:`TensorSpec`) for a call."""
        relations = self._relations.setdefault(name, {})
        try:
            relations[call.structure].observe(call, output)
        except (KeyError, ValueError):  # a first call of this structure, or outputs of another nesting: start anew
            relations[call.structure] = ShapeRelation(call, output)

    def predict(self, name: str, call: CallShape) -> Optional[Any]:
        """Unit ``name``'s output for ``call`` as far as the calls observed derive it; ``None`` otherwise."""
        relation = self._relations.get(name, {}).get(call.structure)
        return None if relation is None else relation.predict(call)
