"""Expert parallelism in training, against single-process Lightning: ep over all four data-parallel ranks (one
expert per rank), ep smaller than dp (each expert's weights FSDP2-sharded over the ranks holding it), HSDP, Qwen3-MoE
with dense ``mlp_only_layers``, Hugging Face checkpoints read into the expert shards (eagerly built and on the meta
device), and what TensorBoard shows (tokens per expert, imbalance, all-to-all traffic)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import SHORT_RUN, assert_equivalent, run_sweep, scalars
from tests.models import build_module

pytestmark = pytest.mark.slow

#: Qwen3-MoE with its first and third blocks dense (``mlp_only_layers``): blocks of two structures, one with experts.
QWEN3_DENSE_FIRST = {"model": "hf_qwen3_moe", "module": {"config": {"mlp_only_layers": [0, 2]}}}
#: DeepSeek-V3 routing by groups: each token's experts chosen among the best of 2 groups of 2 (``n_group``,
#: ``topk_group``) after the correction bias is added to the scores.
DEEPSEEK_GROUPED = {"model": "hf_deepseek_v3", "module": {"config": {"n_group": 2, "topk_group": 1}}}
#: One launch on four ranks: the model entry, the strategy's degrees.
ENTRIES = [
    ({"model": "hf_mixtral"}, {"ep": 4}),
    ({"model": "mixed_moe"}, {"ep": 4}),
    (QWEN3_DENSE_FIRST, {"ep": 2}),                                  # dp 4 = 2 ranks per expert × ep 2
    (DEEPSEEK_GROUPED, {"dp": 2, "dp_replicate": 2, "ep": 2}),           # HSDP
]


#: Mixtral with its load-balancing loss added to the step's (``output_router_logits``), logged as ``aux_loss``. That
#: loss couples a rank's tokens (the share each expert gets of them), so a data-parallel run averages the ranks'
#: losses where one device computes one over the whole batch: the same layout without ep is its reference.
MIXTRAL_AUX = {"model": "hf_mixtral", "module": {"config": {"output_router_logits": True}}}
AUX_ENTRIES = [{**MIXTRAL_AUX, "ep": 4}, {**MIXTRAL_AUX, "ep": 1}]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict:
    folder = tmp_path_factory.mktemp("ep")
    references = run_sweep(["--reference", "--dp", 4, "--devices", 1, *SHORT_RUN, "--out", folder / "ref.pt"],
                           [model for model, _ in ENTRIES])
    runs = run_sweep(["--dp", 4, "--devices", 4, *SHORT_RUN, "--tensorboard", folder / "tb", "--out", folder / "run.pt"],
                     [{**model, **degrees} for model, degrees in ENTRIES] + AUX_ENTRIES)
    return {"references": references, "runs": runs[:len(ENTRIES)], "aux": runs[len(ENTRIES):],
            "tensorboard": folder / "tb"}


@pytest.mark.parametrize("index", range(len(ENTRIES)), ids=[f"{m['model']}-{d}" for m, d in ENTRIES])
def test_expert_parallel_training_equals_one_device(index: int, four_ranks: dict) -> None:
    assert_equivalent(four_ranks["references"][index], four_ranks["runs"][index], rtol=1e-5)


def test_the_load_balancing_loss_is_the_routers_own(four_ranks: dict) -> None:
    """Mixtral's auxiliary loss in the step: under ep 4 the losses (auxiliary included), the logged ``aux_loss`` and
    every parameter equal the same data-parallel run without ep; the loss is no constant."""
    spread, whole = four_ranks["aux"]
    assert_equivalent(whole, spread, rtol=1e-5)  # the metric values compared include step:aux_loss
    logged = spread["metric_values"]["step:aux_loss"]
    assert len(logged) >= 4 and len(set(logged)) > 1 and all(1.0 < value < 4.0 for value in logged)


def test_tensorboard_shows_tokens_per_expert_imbalance_and_all_to_all_traffic(four_ranks: dict) -> None:
    logged = scalars(next((four_ranks["tensorboard"] / "0").rglob("events.out.tfevents.*")).parent)
    steps = {step for step, _ in logged["experts/imbalance_over_experts"]}
    assert len(steps) >= 3
    # Mixtral: 4 blocks, each token choosing 2 of 4 experts; a batch of 8 sequences of 16 tokens.
    tokens = [dict(logged[f"experts/tokens_per_batch/expert_{e}"]) for e in range(4)]
    for step in steps:
        assert sum(per_expert[step] for per_expert in tokens) == pytest.approx(4 * 2 * 8 * 16)
    assert all(1.0 <= value < 4.0 for _, value in logged["experts/imbalance_over_experts"])
    assert all(1.0 <= value < 4.0 for _, value in logged["experts/imbalance_over_ranks"])  # one expert per rank
    # Per block a rank sends at most its 2 sequences × 16 tokens × 2 choices and returns the results of the other 3
    # ranks' choices of its expert, rows of 32 floats of 4 bytes, forward and backward.
    bound = 4 * (64 + 3 * 64) * 32 * 4 * 2
    assert all(0 < value <= bound for _, value in logged["experts/all_to_all_bytes_per_batch"])
    assert all(0 < value < 1 for _, value in logged["experts/all_to_all_forward_share_of_step"])


def test_a_hugging_face_checkpoint_is_read_into_the_experts_shards(tmp_path: Path) -> None:
    """``weights=``: each rank reads its experts' slices; on the meta device no rank ever holds every expert."""
    folder = tmp_path / "pretrained"
    build_module("hf_qwen3_moe", seed=7).model.save_pretrained(folder)
    reference = run_sweep(["--reference", "--dp", 2, "--devices", 1, *SHORT_RUN, "--out", tmp_path / "ref.pt"],
                          [{"model": "hf_qwen3_moe", "module": {"pretrained": str(folder)}}])[0]
    runs = run_sweep(["--dp", 2, "--devices", 2, *SHORT_RUN, "--out", tmp_path / "run.pt"],
                     [{"model": "hf_qwen3_moe", "ep": 2, "weights": str(folder), "module": module}
                      for module in ({}, {"init": "meta"})])
    for result in runs:
        for name, tensor in reference["initial_params"].items():
            assert result["initial_params"][name].equal(tensor), name
        assert_equivalent(reference, result, rtol=1e-5)
