"""FSDP2 options (``lightning_hybrid.parallel.fsdp``): the gradient reduction dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_hybrid import HybridStrategy
from lightning_hybrid.parallel.fsdp import mixed_precision_policy
from tests.helpers import run_sweep, scalars


def test_the_reduction_dtype_is_fp32_unless_bf16_is_asked_for() -> None:
    assert mixed_precision_policy("32-true").reduce_dtype is None  # the parameters' own dtype
    assert mixed_precision_policy("bf16-mixed").reduce_dtype == torch.float32
    assert mixed_precision_policy("bf16-mixed", "bf16").reduce_dtype == torch.bfloat16
    assert mixed_precision_policy("32-true", "bf16").param_dtype is None  # computing stays in fp32
    assert [HybridStrategy(reduce_dtype=name).options.reduce_dtype
            for name in ("bf16", "bfloat16", torch.bfloat16, "fp32", "float32", None)] == ["bf16"] * 3 + ["fp32"] * 2 + [None]
    with pytest.raises(ValueError, match=r"reduce_dtype='fp16'\) is not a gradient reduction dtype: pass 'bf16'"):
        HybridStrategy(reduce_dtype="fp16")


@pytest.mark.slow
def test_bf16_gradient_reduction_halves_the_reduce_scatter_and_trains_close_to_fp32(tmp_path: Path) -> None:
    runs = run_sweep(["--model", "gpt", "--dp", 2, "--devices", 2, "--steps", 4, "--tensorboard", tmp_path / "tb",
                      "--out", tmp_path / "run.pt"], [{}, {"reduce_dtype": "bf16"}])
    comm = [{tag.split("/")[-1]: values[0][1] for tag, values in scalars(tmp_path / "tb" / str(i) / "version_0").items()
             if tag.startswith("comm/bytes")} for i in range(2)]
    fp32, bf16 = comm
    assert bf16["reduce_scatter"] * 2 == fp32["reduce_scatter"] > 0
    assert bf16["all_gather"] == fp32["all_gather"]  # parameters are gathered in their own dtype
    losses = [run["losses"] for run in runs]
    assert losses[0][0] == losses[1][0]  # the first loss comes before any reduction
    assert losses[1] == pytest.approx(losses[0], rel=1e-3)  # bf16-rounded gradient sums, then fp32 updates
    assert losses[1] != losses[0]  # the reduction did run in bf16
