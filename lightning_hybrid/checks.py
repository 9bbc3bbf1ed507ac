"""The argument check every part of the package shares: a count or a size must be positive.

It sits below everything else (no imports from the package, no torch), so the strategy's options, the mesh, the
pipeline schedules, the planner and the monitor word the same mistake the same way.

Example::

    check_positive("HybridStrategy", "tp", tp, also=" or 'auto'")     # unless tp == "auto" was handled first
    check_positive("Cluster", "peak_flops", 1e15, integer=False)
"""

from __future__ import annotations


def check_positive(owner: str, name: str, value: object, *, integer: bool = True, also: str = "") -> None:
    """Raise ``ValueError("owner(name=value) is invalid: name must be a positive integer<also>.")`` unless
    ``value`` is a positive integer (or, with ``integer=False``, a positive number). Booleans are refused.
    ``also`` names what else the caller accepts (e.g. ``" or 'auto'"``)."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise ValueError(f"{owner}({name}={value!r}) is invalid: {name} must be {kind}{also}.")


def check_positive_values(owner: str, *, integer: bool = True, **values: object) -> None:
    """:func:`check_positive` for each keyword: ``check_positive_values("Cluster", nodes=1, gpus_per_node=8)``."""
    for name, value in values.items():
        check_positive(owner, name, value, integer=integer)
