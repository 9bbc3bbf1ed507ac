"""The tensor-parallel planner's refusals: a module it cannot shard correctly, named, with a short reason.

Every place that declines to shard part of a block (a matrix parameter in no linear layer it recognizes, a size
tp does not divide, a plan check that finds the block's output changed) raises :class:`PlanRefusal` naming the
modules concerned, relative to the block. :mod:`lightning_hybrid.tensor_parallel.fallback` keeps those modules
whole on every tensor-parallel rank and plans the rest again; with ``HybridStrategy(tp_strict=True)`` the refusal
reaches the user as it is. Errors that are not the planner's own (a bug in the block's forward, a ``tp_plan``
pattern that matches nothing) are never a :class:`PlanRefusal`, so they are never hidden by keeping a module whole.

Example::

    raise PlanRefusal("tp=2 does not divide ... Pass tp_plan={'*.attn.qkv': 'replicate'}.",
                      modules=("attn.qkv", "attn.proj"), reason="tp=2 does not divide the 3 heads of 'attn.qkv'")
"""

from __future__ import annotations

from typing import Sequence


class PlanRefusal(ValueError):
    """The planner cannot shard ``modules`` (names relative to the block; none: the block as a whole) correctly.
    The message says what to pass instead; ``reason`` says why in a few words, for the plan's report."""

    def __init__(self, message: str, modules: Sequence[str] = (), reason: str = "") -> None:
        super().__init__(message)
        self.modules = tuple(modules)
        self.reason = reason or message


class PlanCheckFailed(PlanRefusal, RuntimeError):
    """The plan check ran the block unsharded and sharded and their outputs differ (also a ``RuntimeError``, what
    the check raised before it was a refusal the strategy can fall back from)."""
