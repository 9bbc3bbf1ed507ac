"""The split by measured time (``pp_split="measured"``): what the step timing attributes where, that it leaves no
trace, the split and predictions computed from given times, bad input, and a pp=2 run (``measured_split.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_hybrid import HybridStrategy
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.pipeline.timed_split import (
    META_DEVICE,
    _StepClock,
    StepTimes,
    imbalance,
    measure_step,
    predicted_bubble,
    split_by_time,
)
from lightning_hybrid.options.schedules import PipelineSchedule
from tests.helpers import REPO_ROOT, relative_difference, run_rank_script

SCRIPT = REPO_ROOT / "tests" / "pipeline" / "measured_split.py"
MS = 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Predictions and the split from given times (fast)
# ----------------------------------------------------------------------------------------------------------------
def test_stage_seconds_add_the_work_outside_the_blocks_to_the_end_stages() -> None:
    times = StepTimes(before=1.0, blocks=[10.0, 2.0, 3.0, 4.0], after=5.0)
    assert times.stage_seconds([1, 3]) == [11.0, 14.0]
    assert times.stage_seconds([2, 1, 1]) == [13.0, 3.0, 9.0]
    assert imbalance([11.0, 14.0]) == pytest.approx(14.0 / 12.5 - 1.0)


@pytest.mark.parametrize(("name", "pp", "microbatches"), [("1f1b", 2, 4), ("gpipe", 4, 8), ("interleaved_1f1b", 2, 4)])
def test_predicted_bubble_of_equal_stages_is_the_theory(name: str, pp: int, microbatches: int) -> None:
    schedule = PipelineSchedule.resolve(name, pp, microbatches=microbatches)
    assert predicted_bubble([2.0] * schedule.num_stages, schedule) == pytest.approx(schedule.theoretical_bubble())


def test_predicted_bubble_of_unequal_stages_is_paced_by_the_slowest() -> None:
    schedule = PipelineSchedule.resolve("1f1b", 2, microbatches=4)
    # The slowest stage (3 s) runs 4 microbatches, the other's 1 s once to fill: step 13 s; busy 4·3 and 4·1 s.
    assert predicted_bubble([3.0, 1.0], schedule) == pytest.approx(1 - 4 * 2.0 / 13.0)
    looped = PipelineSchedule.resolve("interleaved_1f1b", 2, microbatches=4)  # rank 0: stages 0, 2; rank 1: 1, 3
    # Rank 0 takes 3 s per microbatch: step 4·3 + (5 − 3) / 2 = 13 s; mean busy 4·2.5 s.
    assert predicted_bubble([2.0, 1.0, 1.0, 1.0], looped) == pytest.approx(1 - 4 * 2.5 / 13.0)


def test_split_by_time_balances_seconds_and_predicts_the_flop_split_under_them() -> None:
    schedule = PipelineSchedule.resolve("1f1b", 2, microbatches=4)
    times = StepTimes(before=1 * MS, blocks=[10 * MS, 1 * MS, 1 * MS, 1 * MS], after=2 * MS)
    measured = split_by_time(times, schedule, flop_split=[3, 1])
    # Measured: block 0 alone on stage 0 (11 ms) against 3 blocks and the head (5 ms); [2, 2] would be 12 ms.
    assert measured.blocks_per_stage == [1, 3]
    assert measured.stage_seconds == pytest.approx([11 * MS, 5 * MS])
    assert measured.flop_stage_seconds == pytest.approx([13 * MS, 3 * MS])
    assert measured.bubble == pytest.approx(1 - 4 * 8 / (4 * 11 + 5))
    assert measured.flop_bubble == pytest.approx(1 - 4 * 8 / (4 * 13 + 3))
    line = measured.describe()
    assert "Blocks per stage [1, 3]: stage times [11, 5] ms" in line
    assert "the FLOP-balanced split [3, 1] would take [13, 3] ms, predicted bubble 0.418" in line


def test_split_option_is_checked_at_construction() -> None:
    assert HybridStrategy(pp=2, pp_split="measured").options.pp_split == "measured"
    with pytest.raises(ValueError, match=r"pp_split='fastest'\) is invalid: pass the blocks of each stage .*'measured'"):
        HybridStrategy(pp=2, pp_split="fastest")
    with pytest.raises(ValueError, match=r"pp='auto', pp_split='measured'\) is not supported.*Pass pp=N"):
        HybridStrategy(pp="auto", pp_split="measured")


# ----------------------------------------------------------------------------------------------------------------
# Timing one step (in process, no process group)
# ----------------------------------------------------------------------------------------------------------------
class _Clock:
    """The step clock's time, advanced only by the blocks: what each takes is exact whatever else the machine does
    (wall-clock sleeps had come out up to 80 ms long on a machine running a test suite beside them)."""

    seconds = 0.0

    @classmethod
    def advance(cls, seconds: float) -> None:
        cls.seconds += seconds


@pytest.fixture(autouse=True)
def block_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_StepClock, "now", lambda self: _Clock.seconds)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward take fixed times on the step clock (:class:`_Clock`)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, forward_s: float, backward_s: float) -> Tensor:
        ctx.backward_s = backward_s
        _Clock.advance(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        _Clock.advance(ctx.backward_s)
        return grad, None, None


class _Slow(nn.Module):
    def __init__(self, forward_s: float, backward_s: float, width: int = 8) -> None:
        super().__init__()
        self.linear, self.seconds = nn.Linear(width, width), (forward_s, backward_s)

    def forward(self, x: Tensor) -> Tensor:
        return _Sleep.apply(self.linear(x), *self.seconds)


class _SlowModel(nn.Module):
    """Embedding (with dropout and a BatchNorm: random and running state the timing must leave as it was), three
    blocks and a head, each with a known forward and backward time."""

    def __init__(self, block_seconds: list[tuple[float, float]]) -> None:
        super().__init__()
        self.embed, self.norm, self.dropout = _Slow(4 * MS, 8 * MS), nn.BatchNorm1d(8), nn.Dropout(0.1)
        self.blocks = nn.ModuleList(_Slow(*seconds) for seconds in block_seconds)
        self.head = _Slow(6 * MS, 12 * MS)

    def forward(self, x: Tensor) -> Tensor:
        x = self.dropout(self.norm(self.embed(x)))
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def test_measured_times_put_each_forward_and_backward_where_it_ran() -> None:
    blocks_s = [(1 * MS, 2 * MS), (10 * MS, 20 * MS), (1 * MS, 2 * MS)]
    model = _SlowModel(blocks_s)
    _, blocks = find_block_list(model)
    inputs = torch.randn(4, 8)
    rng, running_mean = torch.get_rng_state(), model.norm.running_mean.clone()
    times = measure_step(model, blocks, lambda: model(inputs), torch.device("cpu"), repeats=3)
    expected = [forward + backward for forward, backward in blocks_s]
    slack = 15 * MS  # the smallest misplacement the bound must catch: a whole 20 ms block counted twice or elsewhere
    for measured, wanted in zip(times.blocks, expected):
        assert wanted <= measured < wanted + slack
    assert 12 * MS <= times.before < 12 * MS + slack  # the embedding's 4 + 8 ms
    assert 18 * MS <= times.after < 18 * MS + slack  # the head's 6 + 12 ms
    assert times.backward
    # Nothing the training sees changed: no gradient left, the running statistics and the random stream as before.
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model.norm.running_mean, running_mean) and torch.equal(torch.get_rng_state(), rng)


def test_a_step_without_a_loss_to_differentiate_is_timed_forward_only() -> None:
    model = _SlowModel([(2 * MS, 20 * MS)] * 2)
    _, blocks = find_block_list(model)
    inputs = torch.randn(4, 8)
    times = measure_step(model, blocks, lambda: {"loss": model(inputs).detach()}, torch.device("cpu"), repeats=1)
    assert not times.backward
    assert all(2 * MS <= block < 8 * MS for block in times.blocks)  # the 20 ms backward never ran


def test_a_meta_device_model_is_refused_with_the_alternatives() -> None:
    with torch.device("meta"):
        model = _SlowModel([(0.0, 0.0)] * 2)
    _, blocks = find_block_list(model)
    with pytest.raises(ValueError, match=r"parameters are on the meta device.*pp_split=\[\.\.\.\].*traced FLOPs"):
        measure_step(model, blocks, lambda: model(torch.randn(4, 8, device="meta")), torch.device("cpu"))
    assert "pp_split='measured'" in META_DEVICE


# ----------------------------------------------------------------------------------------------------------------
# pp=2 on blocks whose time FLOPs do not see (multi-process, slow)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_measured_split_moves_blocks_off_the_slow_stage_and_trains_like_one_device(tmp_path: Path) -> None:
    """Four blocks with equal matrix products; block 0 also runs 40 rounds of scans along the sequence (about 15
    times the others' time, zero FLOPs). By FLOPs the head weighs two blocks, so the FLOP split is [3, 1]; by
    time block 0 outweighs the other three and the head, so the measured split gives it a stage of its own."""
    reference = run_rank_script(SCRIPT, ["--splits", "reference", "--out", tmp_path / "reference.pt"])["reference"]
    run = run_rank_script(SCRIPT, ["--splits", "measured", "--devices", 2, "--out", tmp_path / "pp.pt"],
                          nprocs_timeout=300)["measured"]
    measured = run["measured"]
    assert measured["flop_blocks_per_stage"] == [3, 1]
    assert measured["blocks_per_stage"] == [1, 3]
    assert run["blocks_per_stage"] == [[1, 3], [1, 3]]  # both ranks adopted it
    blocks = measured["times"]["blocks"]
    assert blocks[0] > 3 * max(blocks[1:]) and measured["times"]["backward"]
    # Predicted from the measured costs: the slowest stage is faster, the bubble smaller than the FLOP split's.
    assert max(measured["stage_seconds"]) < max(measured["flop_stage_seconds"])
    assert measured["bubble"] < measured["flop_bubble"]
    assert len(reference["losses"]) == len(run["losses"]) == 4
    assert max(abs(a - b) / abs(a) for a, b in zip(reference["losses"], run["losses"], strict=True)) <= 1e-5
    assert run["params"].keys() == reference["params"].keys()
    assert max(relative_difference(reference["params"][k], run["params"][k]) for k in reference["params"]) <= 1e-5
