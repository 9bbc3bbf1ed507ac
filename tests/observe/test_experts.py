"""The monitor's expert-parallel figures from every rank's counts: tokens per expert, imbalance, traffic."""

from __future__ import annotations

import pytest

from lightning_hybrid.observe.experts import expert_metrics


def test_tokens_imbalance_and_traffic_combine_every_ranks_counts() -> None:
    per_rank = [
        {"blocks.1.experts": ([6, 0, 1, 1], 2, 100, 0.1)},   # tokens per expert, ep, bytes sent, seconds
        {"blocks.1.experts": ([2, 2, 2, 2], 2, 300, 0.3)},
        None,                                                # a rank of another pipeline stage, without experts
    ]
    metrics = expert_metrics(per_rank, batches=2, seconds=2.0, tensor_parallel=1)
    assert [metrics[f"experts/tokens_per_batch/expert_{e}"] for e in range(4)] == [4.0, 1.0, 1.5, 1.5]
    assert metrics["experts/imbalance_over_experts"] == pytest.approx(8 / 4)       # busiest expert over the mean
    assert metrics["experts/imbalance_over_ranks"] == pytest.approx(10 / 8)        # ep rank 0 holds experts 0-1
    assert metrics["experts/all_to_all_bytes_per_batch"] == 150.0                  # the rank that sends the most
    assert metrics["experts/all_to_all_forward_share_of_step"] == pytest.approx(0.1)
    halved = expert_metrics(per_rank, batches=2, seconds=2.0, tensor_parallel=2)  # tp ranks route the same tokens
    assert halved["experts/tokens_per_batch/expert_0"] == 2.0
    assert expert_metrics([None, None], batches=2, seconds=2.0, tensor_parallel=1) == {}
