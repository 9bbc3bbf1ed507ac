"""Trace how data flows between the linear layers of one block.

Tensor-parallel planning needs to know, for every ``nn.Linear`` in a block, *which* tensors its input is computed
from, and how the features of its output are cut up afterwards (split into q/k/v, reshaped into heads). Module
names cannot tell us that reliably; running the block once can. :func:`trace_block` runs the block's forward under
a :class:`~torch.overrides.TorchFunctionMode` that labels every tensor with its *nearest sources*: the linear layers
(or block arguments) it was computed from without passing through another linear layer. It also notes which
attributes of the block's own modules (and their config objects) the forward reads.

Example::

    trace = trace_block(block, args, kwargs)
    trace.linears["attn.proj"].sources     # {"attn.qkv"}: proj consumes qkv's output (through attention)
    trace.output_sources                   # {"arg0", "attn.proj", "mlp.down"}: what reaches the residual stream
"""

from __future__ import annotations

import copy
import functools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid._compat import tree_flatten

# Functions that cut a tensor's last dimension into pieces or reshape it; their outputs tell us whether a linear
# layer's features are fused (q|k|v) and how they group into heads.
_SPLIT_FUNCTIONS = {torch.split, torch.Tensor.split, torch.chunk, torch.Tensor.chunk, torch.tensor_split,
                    torch.Tensor.tensor_split, torch.Tensor.split_with_sizes}
_RESHAPE_FUNCTIONS = {torch.reshape, torch.Tensor.reshape, torch.Tensor.view, torch.unflatten,
                      torch.Tensor.unflatten}


@dataclass
class LinearUse:
    """One call of a linear layer inside the traced block: an ``nn.Linear``, or any layer holding just a 2-D
    ``weight`` (and a 1-D ``bias``) that maps the input's last dimension to the output's through it."""

    name: str
    module: nn.Module
    #: Nearest sources of the layer's input: names of other linear layers and ``"argN"`` for block arguments.
    sources: frozenset[str]
    in_features: int = 0
    out_features: int = 0
    #: The weight is stored ``(in, out)`` and applied as ``x @ weight`` (Hugging Face's ``Conv1D``).
    transposed: bool = False
    #: Dimensions of the output (a slice of a tensor with other dimensions cuts heads, not the layer's pieces).
    out_dims: int = 0


@dataclass
class FeatureCut:
    """The last dimension of a linear layer's output being split or reshaped."""

    linear: str
    #: Sizes of the pieces a split produced (empty for a reshape).
    pieces: tuple[int, ...] = ()
    #: Factors a reshape cut the (piece's) last dimension into, outermost first; the last one is the head size.
    factors: tuple[int, ...] = ()
    #: ``(start, stop)`` of a slice taken of the last dimension (``qkv[..., :q_width]``).
    span: tuple[int, int] | None = None


@dataclass
class BlockTrace:
    """What one forward pass of a block revealed about its linear layers."""

    linears: dict[str, LinearUse] = field(default_factory=dict)
    output_sources: frozenset[str] = frozenset()
    cuts: list[FeatureCut] = field(default_factory=list)
    #: ``(holder path, attribute)`` read during the forward, for holders from :func:`attribute_holders`.
    attribute_reads: set[tuple[str, str]] = field(default_factory=set)
    #: Holders whose reads could not be observed (their class cannot be swapped); treat every attribute as read.
    unobserved: set[str] = field(default_factory=set)
    #: Layers holding one matrix whose call is no plain linear map of the last dimension (a router that returns
    #: logits, scores and expert indices): the planner keeps them whole.
    opaque: set[str] = field(default_factory=set)
    #: Nearest sources of the first input of each other module holding parameters of its own (a norm): which
    #: linear layers' outputs it computes on.
    module_inputs: dict[str, frozenset[str]] = field(default_factory=dict)
    #: Linear layers whose output a discrete choice is made on (top-k routing, argmax): computed in pieces it may
    #: round differently from one device and choose otherwise, so the planner never shards them alone.
    selected: set[str] = field(default_factory=set)
    #: Linear layers whose output tensor the forward then changes in place (Llama 4 adds the routed experts'
    #: output into the shared expert's with ``add_``).
    written_in_place: set[str] = field(default_factory=set)

    def consumers(self, name: str) -> list[str]:
        """Linear layers whose input is computed from ``name``'s output (``"output"`` if the block output is)."""
        users = [use.name for use in self.linears.values() if name in use.sources]
        return users + (["output"] if name in self.output_sources else [])


class _SourceTracker(TorchFunctionMode):
    """Labels each tensor produced inside the mode with the union of its inputs' labels, and notes how each
    watched weight is applied (``weight_uses``: ``id`` → ``False`` for ``F.linear(x, w)``, ``True`` for ``x @ w``)."""

    def __init__(self) -> None:
        super().__init__()
        self._labels: dict[int, frozenset[str]] = {}
        self._alive: list[torch.Tensor] = []  # keeps labelled tensors alive so that their ids stay unique
        self.on_call: Callable[[Any, tuple, dict, Any, frozenset[str]], None] | None = None
        self.weight_uses: dict[int, bool | None] = {}

    def label(self, tensor: torch.Tensor, sources: frozenset[str]) -> None:
        self._labels[id(tensor)] = sources
        self._alive.append(tensor)

    def sources_of(self, tree: Any) -> frozenset[str]:
        leaves, _ = tree_flatten(tree)
        found: set[str] = set()
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                found |= self._labels.get(id(leaf), frozenset())
        return frozenset(found)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        self._note_weight_use(func, args)
        out = func(*args, **kwargs)
        sources = frozenset() if func in _FRESH else self.sources_of((args, kwargs))
        if sources:
            if self.on_call is not None:
                self.on_call(func, args, kwargs, out, sources)
            written = [args[0], args[0]._base] if _writes_in_place(func, args) else []
            for leaf in [*tree_flatten(out)[0], *written]:  # a write into a view changes what its base holds
                if isinstance(leaf, torch.Tensor):
                    self.label(leaf, sources | self._labels.get(id(leaf), frozenset()))
        return out


    def _note_weight_use(self, func: Any, args: tuple) -> None:
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if func is F.linear and len(tensors) > 1 and id(tensors[1]) in self.weight_uses:
            self.weight_uses[id(tensors[1])] = False
        elif func in _MATMULS and tensors and id(tensors[-1]) in self.weight_uses:
            self.weight_uses[id(tensors[-1])] = True


def _writes_in_place(func: Any, args: tuple) -> bool:
    """``x.copy_(y)``, ``x[...] = y``, ``x.add_(y)``: the call changes its first argument."""
    name = getattr(func, "__name__", "")
    return bool(args) and isinstance(args[0], torch.Tensor) and (
        name == "__setitem__" or (name.endswith("_") and not name.startswith("_")))


#: Functions whose output takes only a shape, dtype or device from their tensor arguments (a scan's zero state
#: built with ``x.new_zeros``): it carries no data of theirs.
_FRESH = {torch.Tensor.new_zeros, torch.Tensor.new_ones, torch.Tensor.new_empty, torch.Tensor.new_full,
          torch.zeros_like, torch.ones_like, torch.empty_like, torch.full_like, torch.rand_like, torch.randn_like}
#: Functions that choose by value (which experts a token goes to).
_SELECTIONS = {torch.topk, torch.Tensor.topk, torch.argmax, torch.Tensor.argmax, torch.argmin, torch.Tensor.argmin,
               torch.sort, torch.Tensor.sort, torch.argsort, torch.Tensor.argsort, torch.kthvalue}
#: Functions that apply a weight stored ``(in, out)`` as their last matrix operand: ``x @ w``, ``addmm(b, x, w)``.
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm, torch.addmm,
            torch.Tensor.addmm}


def _watch_linears(block: nn.Module, tracker: _SourceTracker, before: Callable[..., None],
                   after: Callable[..., None]) -> list[Any]:
    """Forward hooks on every candidate linear layer of ``block``; their weights watched by ``tracker``."""
    hooks = []
    for module in block.modules():
        if _holds_one_matrix(module):
            tracker.weight_uses[id(module.weight)] = None
            hooks.append(module.register_forward_pre_hook(before))
            hooks.append(module.register_forward_hook(after))
    return hooks


def _watch_weighted(block: nn.Module, tracker: _SourceTracker, trace: BlockTrace) -> list[Any]:
    """Pre-hooks noting what each module holding parameters of its own (no candidate linear) computes on."""
    def note(name: str, module: nn.Module, inputs: tuple) -> None:
        trace.module_inputs.setdefault(name, tracker.sources_of(inputs[:1]))

    return [module.register_forward_pre_hook(functools.partial(note, name)) for name, module in block.named_modules()
            if not _holds_one_matrix(module) and any(True for _ in module.parameters(recurse=False))]


def _holds_one_matrix(module: nn.Module) -> bool:
    """``nn.Linear``, or a leaf module whose own parameters are a 2-D ``weight`` and at most a 1-D ``bias``."""
    if isinstance(module, nn.Linear):
        return True
    if any(True for _ in module.children()):
        return False
    own = dict(module.named_parameters(recurse=False))
    weight, bias = own.pop("weight", None), own.pop("bias", None)
    return not own and weight is not None and weight.dim() == 2 and (bias is None or bias.dim() == 1)


def _orientation(module: nn.Module, inputs: tuple, output: Any, applied_transposed: bool | None) -> bool | None:
    """Whether ``module``'s weight is stored ``(in, out)`` (``True``) or ``(out, in)`` (``False``), from the shapes
    it mapped (and, for a square weight, from how the forward applied it); ``None`` if it is no linear map of the
    last dimension."""
    if type(module).forward is nn.Linear.forward:
        return False
    # a subclass with its own forward (Llama 4's router returns scores and logits) is judged by what it returned
    if not (inputs and isinstance(inputs[0], torch.Tensor) and isinstance(output, torch.Tensor)):
        return None
    rows, columns = module.weight.shape
    width_in, width_out = inputs[0].shape[-1], output.shape[-1]
    if (rows, columns) == (width_in, width_out) and rows != columns:
        return True
    if (rows, columns) == (width_out, width_in) and rows != columns:
        return False
    return applied_transposed if rows == columns == width_in == width_out else None


def trace_block(block: nn.Module, args: tuple, kwargs: dict) -> BlockTrace:
    """Run ``block(*args, **kwargs)`` once (without gradients) and record the data flow between its linears."""
    args, kwargs = copy.deepcopy((args, kwargs))  # the block may update state it is handed (e.g. a key/value cache)
    trace = BlockTrace()
    tracker = _SourceTracker()
    names = {module: name for name, module in block.named_modules()}
    outputs: dict[int, str] = {}  # a linear layer's output tensor (alive: labelled) → the layer
    for index, leaf in enumerate(tree_flatten((args, kwargs))[0]):
        if isinstance(leaf, torch.Tensor):
            tracker.label(leaf, frozenset({f"arg{index}"}))

    def before_linear(module: nn.Module, inputs: tuple) -> None:
        name = names[module]
        trace.linears[name] = LinearUse(name, module, tracker.sources_of(inputs))

    def after_linear(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        use = trace.linears[names[module]]
        transposed = _orientation(module, inputs, output, tracker.weight_uses.get(id(module.weight)))
        if transposed is None:  # not a linear map of the last dimension: kept whole if it applied its weight
            del trace.linears[use.name]
            if tracker.weight_uses.get(id(module.weight)) is not None:
                trace.opaque.add(use.name)
            return
        use.transposed = transposed
        use.in_features, use.out_features, use.out_dims = inputs[0].shape[-1], output.shape[-1], output.dim()
        tracker.label(output, frozenset({names[module]}))
        outputs[id(output)] = names[module]

    def record_cut(func: Any, args: tuple, kwargs: dict, out: Any, sources: frozenset[str]) -> None:
        if func in _SELECTIONS:
            trace.selected |= {source for source in sources if not source.startswith("arg")}
        if _writes_in_place(func, args) and id(args[0]) in outputs:
            trace.written_in_place.add(outputs[id(args[0])])
        if len(sources) == 1 and isinstance(args[0], torch.Tensor):
            cut = _feature_cut(func, args, out, next(iter(sources)), trace)
            if cut is not None:
                trace.cuts.append(cut)

    tracker.on_call = record_cut
    hooks = _watch_linears(block, tracker, before_linear, after_linear) + _watch_weighted(block, tracker, trace)
    holders, reads = list(attribute_holders(block)), set()
    try:
        with torch.no_grad(), tracker, _recording_reads([obj for _, obj in holders], reads) as unobserved:
            output = block(*args, **kwargs)
        trace.output_sources = tracker.sources_of(output)
    finally:
        for hook in hooks:
            hook.remove()
    _note_reads(trace, holders, reads, unobserved)
    return trace


def _note_reads(trace: BlockTrace, holders: list[tuple[str, Any]], reads: set[tuple[int, str]],
                unobserved: set[int]) -> None:
    """Put the attribute reads recorded by object into ``trace`` by holder path."""
    for path, obj in holders:
        trace.attribute_reads |= {(path, attr) for holder, attr in reads if holder == id(obj)}
        if id(obj) in unobserved:
            trace.unobserved.add(path)


def attribute_holders(block: nn.Module) -> Iterator[tuple[str, Any]]:
    """``(path, object)`` of the block's user-defined modules and of the plain config objects they hold: where the
    integer attributes a forward reshapes with (head counts, widths) live. torch's own modules are skipped: their
    attributes (``in_features`` ...) describe parameters, which sharding already changes."""
    for name, module in block.named_modules():
        if type(module).__module__.startswith("torch."):
            continue
        yield name, module
        for attr, value in vars(module).items():
            if hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type)) and not callable(value):
                yield (f"{name}.{attr}" if name else attr), value


@contextmanager
def _recording_reads(objects: list[Any], reads: set[tuple[int, str]]) -> Iterator[set[int]]:
    """Record ``(id(object), attribute)`` for every attribute read on ``objects`` by swapping in a subclass whose
    ``__getattribute__`` notes the name; yields the ids of objects whose class could not be swapped."""
    swapped, unobserved = [], set()
    for obj in {id(o): o for o in objects}.values():
        original = type(obj)

        def note(self: Any, name: str, _original: type = original) -> Any:
            reads.add((id(self), name))
            return _original.__getattribute__(self, name)

        try:
            obj.__class__ = type(original.__name__, (original,), {"__getattribute__": note})
        except TypeError:  # built-in types such as SimpleNamespace
            unobserved.add(id(obj))
            continue
        swapped.append((obj, original))
    try:
        yield unobserved
    finally:
        for obj, original in swapped:
            obj.__class__ = original


def _feature_cut(func: Any, args: tuple, out: Any, source: str, trace: BlockTrace) -> FeatureCut | None:
    """Describe how ``func(*args)`` cut the features of ``source``'s output, or ``None`` if it did not touch them."""
    tensor, use = args[0], trace.linears.get(source)
    if use is None or tensor.dim() == 0:
        return None
    widths = _feature_widths(use.out_features, trace, source)
    if func in _SPLIT_FUNCTIONS and isinstance(out, (tuple, list)) and len(out) > 1:
        dim = _split_dim(tensor, out)
        # the features moved by a transpose (Mamba: in_proj(x).transpose(1, 2).chunk(2, dim=1)) are still its pieces
        moved = dim is not None and tensor.shape[-1] not in widths and tensor.dim() == use.out_dims
        if dim is not None and tensor.shape[dim] in widths and (dim == tensor.dim() - 1 or moved):
            return FeatureCut(source, pieces=tuple(piece.shape[dim] for piece in out))
        return None
    if tensor.shape[-1] not in widths:
        return None
    if func is torch.Tensor.__getitem__ and isinstance(out, torch.Tensor) and tensor.dim() == use.out_dims:
        span = _last_dim_slice(tensor, args[1] if len(args) > 1 else None)
        return None if span is None else FeatureCut(source, span=span)
    if func in _RESHAPE_FUNCTIONS and isinstance(out, torch.Tensor):
        factors = _split_factors(tensor.shape, out.shape)
        if factors is not None and len(factors) > 1:
            return FeatureCut(source, factors=factors)
    return None


def _last_dim_slice(tensor: torch.Tensor, index: Any) -> tuple[int, int] | None:
    """``(start, stop)`` when ``tensor[index]`` takes a contiguous slice of the last dimension and nothing else."""
    index = index if isinstance(index, tuple) else (index,)
    if not index or not isinstance(index[-1], slice) or index[-1].step not in (None, 1):
        return None
    leading = index[:-1]
    whole = all(item is Ellipsis or item == slice(None) for item in leading)
    if not whole or (Ellipsis not in leading and len(leading) != tensor.dim() - 1):
        return None
    start, stop, _ = index[-1].indices(tensor.shape[-1])
    return (start, stop) if stop > start else None


def _feature_widths(out_features: int, trace: BlockTrace, source: str) -> set[int]:
    """Widths a tensor of ``source``'s features can have: the whole output, or one piece of a recorded split."""
    widths = {out_features}
    for cut in trace.cuts:
        if cut.linear == source:
            widths.update(cut.pieces)
            widths.update([cut.span[1] - cut.span[0]] if cut.span else [])
    return widths


def _split_dim(tensor: torch.Tensor, pieces: Any) -> int | None:
    """The one dimension ``pieces`` cut ``tensor`` along (the others kept whole), or ``None``."""
    if not all(isinstance(piece, torch.Tensor) and piece.dim() == tensor.dim() for piece in pieces):
        return None
    cut = {dim for piece in pieces for dim in range(tensor.dim()) if piece.shape[dim] != tensor.shape[dim]}
    if len(cut) != 1:
        return None
    dim = cut.pop()
    return dim if sum(piece.shape[dim] for piece in pieces) == tensor.shape[dim] else None


def _split_factors(before: torch.Size, after: torch.Size) -> tuple[int, ...] | None:
    """Factors the last dim of ``before`` was reshaped into, when the leading dims are untouched."""
    lead = len(before) - 1
    if tuple(after[:lead]) != tuple(before[:lead]):
        return None
    factors = tuple(after[lead:])
    return factors if math.prod(factors) == before[-1] else None
