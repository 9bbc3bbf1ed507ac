"""Context parallelism in training, against single-process Lightning: a Llama-style decoder with grouped-query
attention and rotary positions (Hugging Face's, eager and sdpa attention through its attention interface, and a
custom one calling ``F.scaled_dot_product_attention``), sliding-window attention (Qwen2), left-padded batches (an
mask, the padded targets ignored by the loss), a state-space model kept whole, Mixtral (its load-balancing loss,
read through hooks inside the blocks, keeps them whole; its experts also spread over the cp ranks, ep 2), activation
checkpointing and a meta-device model — under cp2, cp4, dp2 × cp2, cp2 × tp2 and cp2 × pp2."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import SHORT_RUN, assert_equivalent, run_sweep

pytestmark = pytest.mark.slow

#: Qwen2 with every layer attending to the 4 previous positions only (the mask Hugging Face builds for it).
SLIDING = {"model": "hf_qwen2", "module": {"config": {"use_sliding_window": True, "sliding_window": 4,
                                                      "max_window_layers": 0}}}
#: Hugging Face Llama given an attention mask of left padding (0 to 3 positions per sample), the padded targets
#: ignored: the loss is the mean over the others.
PADDED = {"model": "hf_llama", "module": {"left_padding": True}}
#: The same with every target in the loss (a mean over all tokens): what a pipeline's microbatches do not change.
PADDED_MASK_ONLY = {"model": "hf_llama", "module": {"left_padding": True, "ignore_padded": False}}
#: Hugging Face's sdpa implementation (its own F.scaled_dot_product_attention, not taken twice), with padding.
SDPA_PADDED = {"model": "hf_llama", "module": {"left_padding": True, "config": {"attn_implementation": "sdpa"}}}
HF_LLAMA, LLAMA = {"model": "hf_llama"}, {"model": "llama"}
MIXTRAL_AUX = {"model": "hf_mixtral", "module": {"config": {"output_router_logits": True}}}
#: (the run's model, its single-device reference, the strategy's degrees), per launch.
TWO_RANKS = [
    (HF_LLAMA, HF_LLAMA, {"cp": 2}),
    (LLAMA, LLAMA, {"cp": 2}),
    (SLIDING, SLIDING, {"cp": 2}),
    (PADDED, PADDED, {"cp": 2}),
    (SDPA_PADDED, SDPA_PADDED, {"cp": 2}),
    ({"model": "hf_mamba"}, {"model": "hf_mamba"}, {"cp": 2}),  # a selective scan: its blocks stay whole
    ({"model": "hf_mixtral"}, {"model": "hf_mixtral"}, {"cp": 2}),
    ({"model": "hf_mixtral"}, {"model": "hf_mixtral"}, {"cp": 2, "ep": 2}),  # the experts over the two cp ranks
    # The load-balancing loss reads every router's logits through hooks inside the blocks: they stay whole.
    (MIXTRAL_AUX, MIXTRAL_AUX, {"cp": 2}),
    ({"model": "hf_llama", "module": {"config": {"use_cache": False}}}, HF_LLAMA,
     {"cp": 2, "activation_checkpointing": "every"}),
    ({"model": "hf_llama", "module": {"init": "meta"}}, {"model": "hf_llama", "module": {"init": "per_module"}},
     {"cp": 2}),
]
FOUR_RANKS = [
    (HF_LLAMA, HF_LLAMA, {"dp": 1, "cp": 4}),  # 2 key/value heads for 4 ranks: repeated to the 4 query heads
    (LLAMA, LLAMA, {"dp": 1, "cp": 4}),
    (PADDED, PADDED, {"dp": 1, "cp": 4}),
    (SLIDING, SLIDING, {"dp": 1, "cp": 4}),
    (HF_LLAMA, HF_LLAMA, {"dp": 1, "cp": 2, "tp": 2}),
    (LLAMA, LLAMA, {"dp": 1, "cp": 2, "tp": 2}),
    (SLIDING, SLIDING, {"dp": 1, "cp": 2, "tp": 2}),
    (PADDED, PADDED, {"dp": 1, "cp": 2, "tp": 2}),
    (HF_LLAMA, HF_LLAMA, {"dp": 1, "cp": 2, "pp": 2}),
    (SLIDING, SLIDING, {"dp": 1, "cp": 2, "pp": 2}),
    # A loss normalised over each microbatch's unpadded targets is refused under pp, with or without cp (the
    # pipeline's setup check): the padded model keeps its targets here.
    (PADDED_MASK_ONLY, PADDED_MASK_ONLY, {"dp": 1, "cp": 2, "pp": 2}),
]
#: dp 2 × cp 2. The padded model's loss is a mean over each data-parallel rank's own unpadded tokens, which one
#: device's mean over the whole batch is not: its reference is dp 2 without cp (dp 2 × tp 2, in the same launch).
DATA_PARALLEL = [
    (HF_LLAMA, HF_LLAMA, {"dp": 2, "cp": 2}),
    (LLAMA, LLAMA, {"dp": 2, "cp": 2}),
    (SLIDING, SLIDING, {"dp": 2, "cp": 2}),
    (PADDED, None, {"dp": 2, "cp": 2}),
    (PADDED, None, {"dp": 2, "tp": 2}),
]


def _launch(folder: Any, devices: int, dp: int, entries: list) -> tuple[list, list]:
    references = run_sweep(["--reference", "--dp", dp, "--devices", 1, *SHORT_RUN, "--out", folder / "ref.pt"],
                           [reference for _, reference, _ in entries if reference is not None])
    runs = run_sweep(["--dp", dp, "--devices", devices, *SHORT_RUN, "--out", folder / "run.pt"],
                     [{**model, **degrees} for model, _, degrees in entries])
    return references, runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    return _launch(tmp_path_factory.mktemp("cp2"), 2, 1, TWO_RANKS)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    return _launch(tmp_path_factory.mktemp("cp4"), 4, 1, FOUR_RANKS)


@pytest.fixture(scope="module")
def data_parallel(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    return _launch(tmp_path_factory.mktemp("dp2cp2"), 4, 2, DATA_PARALLEL)


def _ids(entries: list) -> list[str]:
    return [f"{model['model']}{'-' + '-'.join(model['module']) if 'module' in model else ''}-"
            + "-".join(f"{key}{value}" for key, value in degrees.items()) for model, _, degrees in entries]


@pytest.mark.parametrize("index", range(len(TWO_RANKS)), ids=_ids(TWO_RANKS))
def test_cp2_trains_like_one_device(index: int, two_ranks: tuple[list, list]) -> None:
    references, runs = two_ranks
    assert_equivalent(references[index], runs[index], rtol=1e-5)


@pytest.mark.parametrize("index", range(len(FOUR_RANKS)), ids=_ids(FOUR_RANKS))
def test_cp4_and_cp2_with_tp_or_pp_train_like_one_device(index: int, four_ranks: tuple[list, list]) -> None:
    references, runs = four_ranks
    assert_equivalent(references[index], runs[index], rtol=1e-5)


@pytest.mark.parametrize("index", range(3), ids=_ids(DATA_PARALLEL[:3]))
def test_dp2_cp2_trains_like_one_device(index: int, data_parallel: tuple[list, list]) -> None:
    references, runs = data_parallel
    assert_equivalent(references[index], runs[index], rtol=1e-5)


def test_dp2_cp2_with_padding_trains_like_dp2_without_cp(data_parallel: tuple[list, list]) -> None:
    _, runs = data_parallel
    assert_equivalent(runs[4], runs[3], rtol=1e-5)
