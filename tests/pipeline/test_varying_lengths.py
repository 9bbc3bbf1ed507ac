"""Fine-tuning data under pipeline parallelism: batches padded to their own longest sequence, a smaller last batch,
and microbatches holding different numbers of loss terms (``tests/pipeline/varying_lengths.py``)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from lightning_hybrid.pipeline.microbatches import counting_loss_terms, split_microbatches
from lightning_hybrid.probe.shapes import ShapeRelation, TensorSpec, describe_call
from tests.helpers import REPO_ROOT, relative_difference, run_rank_script

SCRIPT = REPO_ROOT / "tests" / "pipeline" / "varying_lengths.py"
SCHEDULES = ["1f1b", "gpipe", "interleaved_1f1b", "zbv_zero_bubble"]


def _run(schedules: list[str], out: Path, ranks: int) -> dict:
    return run_rank_script(SCRIPT, ["--schedules", *schedules, "--devices", ranks, "--out", out], nprocs_timeout=400)


def test_varying_lengths_and_a_smaller_last_batch_train_like_one_device_under_every_schedule(tmp_path: Path) -> None:
    reference = _run(["reference"], tmp_path / "reference.pt", ranks=1)["reference"]
    runs = _run(SCHEDULES, tmp_path / "pp.pt", ranks=2)  # one launch, one fit per schedule
    assert len(reference["losses"]) == 6  # 23 samples in batches of 4: the last holds 3, split 2 + 1
    for schedule in SCHEDULES:
        run = runs[schedule]
        # The logged loss is the full batch's mean over real tokens although the microbatches hold different counts.
        losses = [abs(a - b) / abs(a) for a, b in zip(reference["losses"], run["losses"], strict=True)]
        assert max(losses) <= 1e-5, (schedule, reference["losses"], run["losses"])
        assert run["params"].keys() == reference["params"].keys()
        worst = max(relative_difference(reference["params"][k], run["params"][k]) for k in reference["params"])
        assert worst <= 1e-5, (schedule, worst)


def test_stand_in_shapes_follow_the_hidden_state_and_constants_once_seen_steady() -> None:
    hidden, rope = torch.empty(2, 16, 32), torch.empty(16, 4, 2)
    block = ShapeRelation(describe_call((hidden, rope), {}), TensorSpec((2, 16, 32), torch.float32))
    # The batch size also equals the rope table's last size: the hidden state's own dimension wins.
    assert block.predict(describe_call((torch.empty(3, 9, 32), torch.empty(9, 4, 2)), {})) == TensorSpec(
        (3, 9, 32), torch.float32)
    embedding = ShapeRelation(describe_call((torch.empty(2, 16, dtype=torch.long),), {}),
                              TensorSpec((2, 16, 64), torch.float32))
    longer = describe_call((torch.empty(2, 20, dtype=torch.long),), {})
    assert embedding.predict(longer) is None  # the width 64 follows no input: not trusted until seen steady
    embedding.observe(longer, TensorSpec((2, 20, 64), torch.float32))  # what the meta copy answered
    assert embedding.predict(describe_call((torch.empty(2, 7, dtype=torch.long),), {})) == TensorSpec(
        (2, 7, 64), torch.float32)
    flat = ShapeRelation(describe_call((hidden,), {}), TensorSpec((32, 32), torch.float32))
    flat.observe(describe_call((torch.empty(2, 9, 32),), {}), TensorSpec((18, 32), torch.float32))
    assert flat.predict(describe_call((torch.empty(2, 5, 32),), {})) is None  # B·T: the meta copy answers


def test_loss_terms_are_the_targets_a_mean_loss_averages_over() -> None:
    logits, labels = torch.randn(2, 5, 8), torch.tensor([[1, 2, -100, -100, -100], [3, 4, 5, 6, -100]])
    with counting_loss_terms() as terms:
        F.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1))
    assert terms.count == 6.0
    with counting_loss_terms() as summed:
        F.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1), reduction="sum")
    assert summed.count is None
    # Weighted by these counts, the microbatch means give the full batch's mean; their plain mean does not.
    parts = split_microbatches((logits, labels), 2)
    means = [F.cross_entropy(x.reshape(-1, 8), y.reshape(-1)) for x, y in parts]
    full = F.cross_entropy(logits.reshape(-1, 8), labels.reshape(-1))
    assert torch.allclose((2 * means[0] + 4 * means[1]) / 6, full)
    assert not torch.allclose((means[0] + means[1]) / 2, full)
