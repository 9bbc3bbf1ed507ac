"""Which pipeline schedule runs: torch's seven schedules, their stage-count and microbatch rules checked up front.

Importing this module imports no torch: the planner (``lightning-hybrid plan``) validates schedules with it.
torch's classes are looked up by name (``get_schedule_class``) only when a schedule is built.

Example::

    schedule = PipelineSchedule.resolve("interleaved_1f1b", pp=4)   # virtual_stages=2, microbatches=8
    schedule.stage_ids(pp_rank=1)                                   # [1, 5]
    schedule.theoretical_bubble()                                   # (p − 1) / (m·v + p − 1) = 3 / 19
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_hybrid.checks import check_positive

#: Accepted schedule names → torch's names for them (``torch.distributed.pipelining.schedules.get_schedule_class``).
SCHEDULES: dict[str, str] = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved_1f1b": "Interleaved1F1B",
    "looped_bfs": "LoopedBFS",
    "interleaved_zero_bubble": "InterleavedZeroBubble",
    "zbv_zero_bubble": "ZBVZeroBubble",
    "dualpipev": "DualPipeV",
}
#: torch's ``PipelineScheduleSingle`` subclasses: one stage per rank (a test checks this against torch's classes).
_SINGLE_STAGE = {"gpipe", "1f1b"}
#: "v" schedules place two stages per rank in a V (rank r holds stages r and 2·pp−1−r).
_V_SHAPED = {"zbv_zero_bubble", "dualpipev"}
#: Zero-bubble schedules compute weight gradients in a separate pass after the input gradients.
_SPLIT_WEIGHT_GRADIENTS = {"interleaved_zero_bubble", "zbv_zero_bubble", "dualpipev"}
#: The schedules the planner's cost model predicts (:mod:`lightning_hybrid.planner.cost`): a closed-form bubble and
#: a known number of microbatches in flight per rank.
PLANNED_SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")


@dataclass(frozen=True)
class PipelineSchedule:
    """A validated schedule choice: name, pipeline degree, stages per rank and microbatches per step."""

    name: str
    pp: int
    virtual_stages: int
    microbatches: int

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual_stages

    @property
    def torch_class(self) -> type:
        from torch.distributed.pipelining.schedules import get_schedule_class

        return get_schedule_class(SCHEDULES[self.name])

    @property
    def placement(self) -> str:
        """``"v"`` (rank r holds stages r and 2·pp−1−r) or ``"loop"`` (rank r holds stages r, r+pp, ...)."""
        return "v" if self.name in _V_SHAPED else "loop"

    @property
    def splits_weight_gradients(self) -> bool:
        """Whether weight gradients are computed after, and apart from, the input gradients (zero-bubble)."""
        return self.name in _SPLIT_WEIGHT_GRADIENTS

    @property
    def single_stage(self) -> bool:
        return self.name in _SINGLE_STAGE

    @classmethod
    def resolve(
        cls, name: str, pp: int, virtual_stages: Optional[int] = None, microbatches: Optional[int] = None
    ) -> "PipelineSchedule":
        """Check a schedule against its stage-count and microbatch rules (torch's, stated up front)."""
        key = _schedule_key(name)
        single = key in _SINGLE_STAGE
        if virtual_stages is None:
            virtual_stages = 1 if single else 2
        check_positive("HybridStrategy", "virtual_stages", virtual_stages)
        if single and virtual_stages != 1:
            raise ValueError(
                f"pp_schedule={name!r} runs one stage per rank; virtual_stages={virtual_stages} needs a multi-stage"
                " schedule: 'interleaved_1f1b', 'looped_bfs', 'interleaved_zero_bubble' (or 'zbv_zero_bubble' /"
                " 'dualpipev' with virtual_stages=2)."
            )
        if key in _V_SHAPED and virtual_stages != 2:
            raise ValueError(f"pp_schedule={name!r} places exactly 2 stages per rank in a V; use virtual_stages=2.")
        stages = pp * virtual_stages
        if microbatches is None:
            microbatches = stages
        check_positive("HybridStrategy", "microbatches", microbatches)
        _check_microbatches(key, name, pp, stages, microbatches)
        return cls(key, pp, virtual_stages, microbatches)

    def stage_ids(self, pp_rank: int) -> list[int]:
        """The stages that pipeline rank ``pp_rank`` runs (torch's own stage → rank mapping for the schedule)."""
        return sorted(stage for stage, rank in self.stage_ranks().items() if rank == pp_rank)

    def stage_ranks(self) -> dict[int, int]:
        """Stage index → pipeline rank that runs it."""
        from lightning_hybrid._compat.pipelining import stage_to_rank

        return stage_to_rank(self.pp, self.num_stages, self.placement)

    def theoretical_bubble(self) -> Optional[float]:
        """Idle fraction of an ideal schedule with equal stage times: ``(p − 1) / (m·v + p − 1)`` for GPipe, 1F1B,
        interleaved 1F1B and looped BFS (``v`` stages per rank); ``None`` for the zero-bubble schedules, whose
        idle time has no closed form (it depends on the ratio of forward, input- and weight-gradient times)."""
        if self.splits_weight_gradients:
            return None
        return (self.pp - 1) / (self.microbatches * self.virtual_stages + self.pp - 1)


def _schedule_key(name: str) -> str:
    normalized = str(name).lower().replace("-", "_")
    aliases = {key.replace("_", ""): key for key in SCHEDULES}
    key = aliases.get(normalized.replace("_", ""))
    if key is None:
        raise ValueError(f"Unknown pp_schedule={name!r}. Choose one of: {', '.join(SCHEDULES)}.")
    return key


def _check_microbatches(key: str, name: str, pp: int, stages: int, microbatches: int) -> None:
    if key == "1f1b" and microbatches < pp:
        raise ValueError(f"pp_schedule={name!r} needs microbatches ≥ pp ({pp}); got microbatches={microbatches}.")
    if key == "dualpipev" and microbatches < stages:
        raise ValueError(
            f"pp_schedule={name!r} needs microbatches ≥ its {stages} stages (2 × pp); got microbatches={microbatches}."
        )
    if key in ("interleaved_1f1b", "interleaved_zero_bubble"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise ValueError(
                f"pp_schedule={name!r} runs microbatches in rounds of pp={pp}: microbatches={microbatches} must be"
                f" below pp or a multiple of its {rounds} rounds (e.g. {pp * rounds})."
            )
