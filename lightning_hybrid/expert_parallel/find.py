"""Finding a block's mixture-of-experts layers by structure and by what one call of the block shows.

Two layouts are recognized, neither by name:

* **stacked**: a module whose own parameters all lead with the expert count (≥ 3-D weights, 2-D stacked biases),
  called with the tokens, the chosen experts and the routing weights (:class:`~.stacked.CallRoles`);
* **a list**: an ``nn.ModuleList`` of two or more modules of one class and parameter shapes, each called with one
  tensor of rows by one module's forward (the *host*), and together on fewer rows than every expert on every token
  of the host's input: a router chose among them.

:func:`find_expert_layers` runs the block once on its recorded call (gradients off) under hooks and returns what it
found, with the calls the setup check replays; what looks like experts but cannot be split is returned as a reason.

Example::

    found = find_expert_layers(block, args, kwargs)
    found.stacks["mlp.experts"]           # (args, kwargs, CallRoles): the call the experts module received
    found.lists["moe.experts"]            # ListCall: host "moe", its call, each expert's output tail
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_hybrid._compat import tree_map
from lightning_hybrid.expert_parallel.stacked import CallRoles, expert_count
from lightning_hybrid.probe.meta_step import meta_step


@dataclass
class StackCall:
    """A stacked experts module's recorded call and its roles."""

    args: tuple
    kwargs: dict
    roles: CallRoles


@dataclass
class ListCall:
    """An expert list's host (relative to the block), the host's recorded call and each expert's output tail."""

    host: str
    args: tuple
    kwargs: dict
    output_tails: list[tuple[int, ...]]


@dataclass
class FoundExperts:
    """A block's expert layers (paths relative to the block) and why others that look like experts stay whole."""

    stacks: dict[str, StackCall] = field(default_factory=dict)
    lists: dict[str, ListCall] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)


def find_expert_layers(block: nn.Module, args: tuple, kwargs: dict) -> FoundExperts:
    """The expert layers of ``block``, from one call of it with ``args``/``kwargs`` (see the module docstring)."""
    stacks = {name: m for name, m in block.named_modules() if expert_count(m)}
    lists = {name: m for name, m in block.named_modules() if _like_experts(m)}
    found = FoundExperts()
    if not stacks and not lists:
        return found
    watch = _CallWatch(block, set(stacks.values()) | {child for m in lists.values() for child in m})
    on_meta = any(p.is_meta for p in block.parameters())
    try:
        with torch.no_grad(), watch, meta_step() if on_meta else contextlib.nullcontext():
            call_args, call_kwargs = copy.deepcopy((args, kwargs))  # the block may update a key/value cache it gets
            block(*call_args, **call_kwargs)
    except Exception:  # noqa: BLE001 - a meta-device block choosing rows by value (lists) cannot run on meta
        if not on_meta:
            raise
    for name, module in stacks.items():
        _add_stack(found, name, module, watch)
    for name, experts in lists.items():
        if on_meta:
            found.kept[name] = ("on the meta device which rows a router sends to each module of the list cannot be"
                                " seen; build the model with values to spread it over the ep ranks")
        else:
            _add_list(found, name, experts, watch)
    return found


def _like_experts(module: nn.Module) -> bool:
    if not isinstance(module, nn.ModuleList) or len(module) < 2:
        return False
    shapes = {(type(m), tuple((k, tuple(p.shape)) for k, p in m.named_parameters())) for m in module}
    return len(shapes) == 1 and any(True for _ in module[0].parameters())


def _add_stack(found: FoundExperts, name: str, module: nn.Module, watch: "_CallWatch") -> None:
    if module not in watch.calls:
        return
    args, kwargs, _ = watch.calls[module][0]
    roles = CallRoles.of(args, kwargs, expert_count(module))
    if roles is None:
        found.kept[name] = ("its experts are stacked but its call is not (tokens, chosen experts, routing weights):"
                            " the tokens cannot be sent to the experts' ranks")
    else:
        found.stacks[name] = StackCall(args, kwargs, roles)


def _add_list(found: FoundExperts, name: str, experts: nn.ModuleList, watch: "_CallWatch") -> None:
    calls = [watch.calls.get(expert, []) for expert in experts]
    made = [call for expert_calls in calls for call in expert_calls]
    if not made:
        return
    hosts = {host for _, _, host in made}
    host = next(iter(hosts))
    if len(hosts) != 1 or host not in watch.calls or any(len(a) != 1 or k or not isinstance(a[0], Tensor) for a, k, _ in made):
        found.kept[name] = "its modules are not each called with one tensor of rows by one module's forward"
        return
    host_args, host_kwargs, _ = watch.calls[host][0]
    first = next(v for v in [*host_args, *host_kwargs.values()] if isinstance(v, Tensor))
    rows = first.numel() // max(first.shape[-1], 1) if first.dim() else 1
    if sum(a[0].shape[0] for a, _, _ in made) >= len(experts) * rows:
        found.kept[name] = "every module of the list computes every token: no router chooses among them"
        return
    tails = [tuple(watch.outputs[expert][1:]) if expert in watch.outputs else tuple(made[0][0][0].shape[1:])
             for expert in experts]
    found.lists[name] = ListCall(watch.names[host], host_args, host_kwargs, tails)


class _CallWatch:
    """Within the ``with`` body: the first calls of the ``watched`` modules (arguments cloned, and the innermost
    module of ``block`` running each), and of the modules running them; the watched modules' output shapes."""

    def __init__(self, block: nn.Module, watched: set[nn.Module]) -> None:
        self.block, self.watched = block, watched
        self.names = {m: name for name, m in block.named_modules()}
        self.calls: dict[nn.Module, list[tuple[tuple, dict, Optional[nn.Module]]]] = {}
        self.outputs: dict[nn.Module, tuple[int, ...]] = {}
        self._running: list[nn.Module] = []
        self._stack = contextlib.ExitStack()
        # A module running an expert contains it: only those modules' calls are kept besides the experts'.
        self._ancestors = {m for m in self.names if any(inner in watched for inner in m.modules())} - watched

    def __enter__(self) -> "_CallWatch":
        for module in self.names:
            self._stack.callback(module.register_forward_pre_hook(self._before, with_kwargs=True).remove)
            self._stack.callback(module.register_forward_hook(self._after).remove)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _before(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        caller = self._running[-1] if self._running else None
        if module in self.watched or (module not in self.calls and module in self._ancestors):
            self.calls.setdefault(module, []).append((*_cloned((args, kwargs)), caller))
        self._running.append(module)

    def _after(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._running.pop()
        if module in self.watched and isinstance(output, Tensor):
            self.outputs.setdefault(module, tuple(output.shape))


def _cloned(tree: Any) -> Any:
    return tree_map(lambda v: v.detach().clone() if isinstance(v, Tensor) else v, tree)
