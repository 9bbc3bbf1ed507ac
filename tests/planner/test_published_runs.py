"""The planner against published runs: Narayanan et al. 2021, Table 1 (GPT 1.7B → 1T on 32 → 3072 A100-80GB), each
row's released configuration (benchmarks/planner_megatron.py), and torchtitan's FSDP2 runs on 64 A100s
(benchmarks/planner_torchtitan.py). Arithmetic only."""

from __future__ import annotations

import pytest

from benchmarks.planner_megatron import TABLE_1, Row, a100_cluster, best_variant, predict, tflops_per_gpu
from benchmarks.planner_torchtitan import A100_RUNS, Run, a100, tokens_per_gpu
from benchmarks.planner_torchtitan import predict as predict_torchtitan


@pytest.mark.parametrize("row", TABLE_1, ids=lambda row: f"{row.billions:g}B")
def test_predicted_throughput_is_within_15_percent_of_the_published(row: Row) -> None:
    ratio = tflops_per_gpu(row, predict(row)) / row.published_tflops
    assert 0.85 <= ratio <= 1.15


def test_every_published_configuration_fits_with_buffers_allocated_on_arrival() -> None:
    # Receive buffers are allocated when a message is about to arrive and freed after use: at most one activation
    # posted ahead and two gradients per rank, b·s·h each, whatever the microbatches (280 at 530B, 512 at 1T).
    assert all(predict(row).feasible for row in TABLE_1)
    for row in TABLE_1[4:]:
        memory = predict(row).memory
        b_s_h = row.micro_batch * 2048 * row.hidden * 2
        assert memory.receive_buffers <= 3 * b_s_h
    trillion = predict(TABLE_1[-1]).memory
    assert trillion.total < 32 * 2**30 < a100_cluster(TABLE_1[-1]).usable_memory


@pytest.mark.parametrize("row", TABLE_1, ids=lambda row: f"{row.billions:g}B")
def test_the_best_layout_that_fits_on_each_rows_degrees_is_within_15_percent(row: Row) -> None:
    best = best_variant(row)
    assert best is not None and 0.85 <= tflops_per_gpu(row, best) / row.published_tflops <= 1.15


#: torchtitan's A100 rows (benchmarks/planner_torchtitan.py), with the published tokens/s per GPU
#: (docs/performance.md @0413364) and the band of predicted / published. "selective op" rows are priced with
#: torchtitan's policy (every other matmul recomputed). Missed: the Llama 2 70B selective-op row at local batch 1,
#: published no faster per token than full recomputation at local batch 2 (353), where the planner gives 1.16× that.
A100_AS_PUBLISHED = {
    ("Llama 3 8B", "selective layer"): (2904, 0.85, 1.15),
    ("Llama 3 8B", "selective op"): (2973, 0.85, 1.15),
    ("Llama 3 70B", "full"): (331, 0.85, 1.15),
    ("Llama 2 13B", "no"): (2162, 0.85, 1.15),
    ("Llama 2 13B", "selective layer"): (1914, 0.85, 1.15),
    ("Llama 2 13B", "selective op"): (1904, 0.85, 1.15),
    ("Llama 2 70B", "selective op"): (355, 1.15, 1.25),
    ("Llama 2 70B", "full"): (353, 0.85, 1.15),
}


@pytest.mark.parametrize("run", [run for run in A100_RUNS if (run.name, run.published_as) in A100_AS_PUBLISHED],
                         ids=lambda run: f"{run.name}-{run.published_as}")
def test_torchtitans_fsdp2_throughput_on_a100s_is_predicted_in_its_band(run: Run) -> None:
    published, low, high = A100_AS_PUBLISHED[run.name, run.published_as]
    result = predict_torchtitan(run, a100(run))
    assert run.published == published
    assert result.feasible and low <= tokens_per_gpu(run, result) / published <= high


def test_a_published_moe_run_is_priced_with_its_all_to_all_where_hybrid_strategy_places_it() -> None:
    """Qwen3-235B-A22B on 256 H100s (benchmarks/planner_moe.py): the published degrees (ep 8 × tp 2) span two nodes
    in HybridStrategy's mesh, so their all-to-all crosses InfiniBand; ep 8 without tp stays in a node. The compute
    term for the published work is below the published step, which also holds what the planner does not price."""
    from benchmarks.planner_moe import PUBLISHED_STEP_S, QWEN3_235B, predict

    assert QWEN3_235B.total_parameters == pytest.approx(235.1e9, rel=1e-3)
    active = QWEN3_235B.layers * QWEN3_235B.active_parameters_per_block + QWEN3_235B.outside_block_parameters
    assert active == pytest.approx(22.2e9, rel=0.01)  # "A22B"
    across, within = predict("dp128 tp2 ep8 acc4 z3 ac"), predict("dp256 tp1 ep8 acc2 z3 ac")
    assert across.feasible and within.feasible
    assert across.time.experts > 10 * within.time.experts  # 50 GB/s between nodes, 450 GB/s inside one
    assert 0.5 * PUBLISHED_STEP_S < within.time.compute < PUBLISHED_STEP_S
