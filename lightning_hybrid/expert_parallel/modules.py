"""Running a module's own forward on other values: the class swap expert parallelism uses, which survives FSDP2's.

:func:`keeps_own_class` gives a module a subclass with another forward and remembers the class it had, so
:func:`base_forward` finds the module's own forward even after FSDP2 derived its ``FSDP…`` class from the swapped
one. :func:`with_values` puts other tensors (local shards) in place of parameters and other values in place of
attributes for the length of a call, and the originals back afterwards, even if the call raises.

Example::

    keeps_own_class(experts, "ExpertParallel", dispatched_forward)
    with with_values(experts, {"gate_up_proj": local}, {"num_experts": 2}):
        out = base_forward(experts, tokens, chosen, weights)
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from torch import Tensor, nn

_CLASSES: dict[tuple[type, str], type] = {}


def keeps_own_class(module: nn.Module, kind: str, forward: Callable[..., Any]) -> None:
    """Swap ``module``'s class for a subclass named ``<kind><class>`` whose forward is ``forward``."""
    base = type(module)
    if (base, kind) not in _CLASSES:
        _CLASSES[(base, kind)] = type(f"{kind}{base.__name__}", (base,), {"forward": forward, "ep_base_class": base})
    module.__class__ = _CLASSES[(base, kind)]


def base_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``module``'s forward as its own class (before :func:`keeps_own_class`) defines it."""
    return module.ep_base_class.forward(module, *args, **kwargs)


@contextlib.contextmanager
def with_values(module: nn.Module, parameters: Mapping[str, Tensor], attributes: Mapping[str, Any]) -> Iterator[None]:
    """``module``'s own parameters and attributes named in the mappings replaced for the ``with`` body."""
    held = {name: module._parameters[name] for name in parameters}
    kept = {key: getattr(module, key) for key in attributes}
    try:
        module._parameters.update(parameters)
        for key, value in attributes.items():
            object.__setattr__(module, key, value)
        yield
    finally:
        module._parameters.update(held)
        for key, value in kept.items():
            object.__setattr__(module, key, value)
