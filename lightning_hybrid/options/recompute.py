"""Which blocks activation checkpointing recomputes: ``HybridStrategy(activation_checkpointing=...)`` resolved into
a :class:`CheckpointPlan` (applied by :mod:`lightning_hybrid.parallel.activation_checkpointing`; the planner prices
it).

Example::

    CheckpointPlan.resolve("every")        # CheckpointPlan(every=1, selective=False)
    CheckpointPlan.resolve(2).covers(1)    # True: blocks 1, 3, 5, ... (every 2nd, 0-based)
    CheckpointPlan.resolve("none")         # None
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, Union

# int before the names: a configuration parser (LightningCLI) then reads "2" as every 2nd block, not a bad mode.
ActivationCheckpointing = Optional[Union[int, Literal["none", "every", "selective"]]]


@dataclass(frozen=True)
class CheckpointPlan:
    """Which blocks are checkpointed and how (see the module docstring)."""

    every: int
    selective: bool = False

    @classmethod
    def resolve(cls, mode: ActivationCheckpointing) -> Optional["CheckpointPlan"]:
        """The plan for a ``HybridStrategy(activation_checkpointing=...)`` value; ``None`` for no checkpointing."""
        if mode is None or mode == "none":
            return None
        if mode == "every":
            return cls(every=1)
        if mode == "selective":
            return cls(every=1, selective=True)
        if isinstance(mode, int) and not isinstance(mode, bool):
            if mode <= 0:
                raise ValueError(
                    f"HybridStrategy(activation_checkpointing={mode}) is invalid: an integer N checkpoints every"
                    " N-th block and must be ≥ 1 (1 is the same as 'every'); use None for no checkpointing."
                )
            return cls(every=mode)
        raise ValueError(
            f"HybridStrategy(activation_checkpointing={mode!r}) is not a mode: use None (store all activations),"
            " 'every' (checkpoint every block), an integer N ≥ 1 (every N-th block) or 'selective' (every block,"
            " keeping matmul and attention outputs)."
        )

    def covers(self, block_index: int) -> bool:
        """Whether block ``block_index`` (0-based, over the whole model) is checkpointed."""
        return (block_index + 1) % self.every == 0
