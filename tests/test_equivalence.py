"""Every parallel layout must train to the same numbers as plain single-process Lightning.

Each case compares a plain single-process reference run of ``tests/equivalence.py`` (cached per session, see
``conftest.py``) with a run under the layout (one launch per layout trains every model): every logged micro-batch
loss, the validation loss and every full parameter after 6 AdamW steps with gradient clipping and gradient
accumulation, within 1e-5 relative in fp32.

The fast tests check the harness itself: the reference is reproducible bit for bit, training moves every
parameter far more than the tolerance (so the comparison cannot pass trivially), the reference data order is
the one Lightning's injected ``DistributedSampler`` produces, and the comparison does fail on a small change.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.conftest import ReferenceFn
from tests.equivalence import DistributedOrderSampler
from tests.helpers import assert_equivalent, cached_runs, relative_difference, run_script, run_sweep
from tests.models import MODEL_NAMES, RandomTokenDataset, build_module

RTOL = 1e-5


@dataclass(frozen=True)
class Layout:
    """One parallel layout: HybridStrategy degrees and the number of processes."""

    name: str
    devices: int
    dp: int = 1
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    zero: int = 3

    @property
    def dp_size(self) -> int:
        """Data-parallel world size: what the reference's data order depends on."""
        return self.dp * self.dp_replicate

    def script_args(self) -> list[str]:
        return [
            f"--dp={self.dp}",
            f"--tp={self.tp}",
            f"--pp={self.pp}",
            f"--dp-replicate={self.dp_replicate}",
            f"--zero={self.zero}",
            f"--devices={self.devices}",
        ]


LAYOUTS = [
    Layout("dp2", devices=2, dp=2),
    Layout("tp2", devices=2, tp=2),
    Layout("dp2xtp2", devices=4, dp=2, tp=2),
    Layout("hsdp2x2", devices=4, dp=2, dp_replicate=2),
    Layout("dp2xtp2-zero2", devices=4, dp=2, tp=2, zero=2),
]


# ----------------------------------------------------------------------------------------------------------------
# The equivalence tests (multi-process, slow)
# ----------------------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory: pytest.TempPathFactory):
    """``layout_runs(name)``: ``{model: result}`` for every model under that layout (or ``"ddp"``: Lightning's
    DDP over 2 ranks), from one launch."""
    args = {layout.name: layout.script_args() for layout in LAYOUTS}
    args["ddp"] = ["--strategy", "ddp", "--dp", 2, "--devices", 2]

    def run(name: str, folder: Path) -> dict[str, dict]:
        results = run_sweep([*args[name], "--out", folder / "parallel.pt"], [{"model": m} for m in MODEL_NAMES])
        return dict(zip(MODEL_NAMES, results))

    return cached_runs(run, tmp_path_factory, "layout")


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_layout_matches_reference(model: str, layout: Layout, reference_run: ReferenceFn, layout_runs) -> None:
    reference = reference_run(model, layout.dp_size)
    parallel = layout_runs(layout.name)[model]
    assert parallel["world_size"] == layout.devices
    assert_equivalent(reference, parallel, rtol=RTOL)
    # test() and predict() after fit reuse the strategy's mesh: no process groups (and their threads) added.
    after_fit, after_evaluation = parallel["process_groups"]
    assert after_fit > 1 and after_evaluation == after_fit


@pytest.mark.slow
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_ddp_matches_reference(model: str, reference_run: ReferenceFn, layout_runs) -> None:
    """Lightning's own DDP must match the reference: validates the harness (data order, loss logging, gather)."""
    reference = reference_run(model, 2)
    ddp = layout_runs("ddp")[model]
    report = assert_equivalent(reference, ddp, rtol=RTOL)
    # DDP differs from the reference only by summation order; keep a margin so the 1e-5 budget is meaningful.
    assert report["param_max_rel"] < RTOL / 5


# ----------------------------------------------------------------------------------------------------------------
# The harness itself (fast: in-process or one reference subprocess each)
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", MODEL_NAMES)
def test_reference_is_deterministic_and_trains(model: str, reference_run: ReferenceFn, tmp_path: Path) -> None:
    first = reference_run(model, 2)
    second = run_script(["--model", model, "--reference", "--dp", 2, "--out", tmp_path / "again.pt"])

    # Bit-identical across two fresh processes.
    assert first["losses"] == second["losses"]
    assert first["val_losses"] == second["val_losses"]
    assert first["params"].keys() == second["params"].keys()
    for name, tensor in first["params"].items():
        assert torch.equal(tensor, second["params"][name]), name

    # The run did what the comparison assumes: 6 optimizer steps of 2 micro-batches, one validation, finite.
    assert first["global_step"] == 6 and len(first["losses"]) == 12 and len(first["val_losses"]) == 1
    assert all(torch.isfinite(torch.tensor(first["losses"])))

    # Every parameter moved far more than the tolerance, so an implementation that skipped updates (or a
    # gather that returned initial weights) cannot pass by accident.
    initial = build_module(model).state_dict()
    assert initial.keys() == first["params"].keys()
    moved = {name: relative_difference(initial[name], first["params"][name]) for name in initial}
    assert min(moved.values()) > 100 * RTOL, moved


def test_reference_gradient_clipping_is_active(reference_run: ReferenceFn, tmp_path: Path) -> None:
    """Clipping must change the numbers, or the equivalence tests would not check the global gradient norm."""
    clipped = reference_run("gpt", 2)
    unclipped = run_script(["--model", "gpt", "--reference", "--dp", 2, "--gradient-clip-val", 0,
                            "--out", tmp_path / "unclipped.pt"])
    moved = max(relative_difference(clipped["params"][n], unclipped["params"][n]) for n in clipped["params"])
    assert moved > 100 * RTOL


@pytest.mark.parametrize("dp_size", [1, 2, 4])
@pytest.mark.parametrize("num_samples", [64, 30])  # 30: DistributedSampler pads to a multiple of dp_size
def test_reference_order_matches_distributed_sampler(dp_size: int, num_samples: int) -> None:
    """Global batch k == concat over ranks r of rank r's batch k, written out independently of the sampler code."""
    dataset = RandomTokenDataset(num_samples)
    per_rank = 8 // dp_size
    sampler = DistributedOrderSampler(dataset, dp_size, per_rank, seed=0)
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        reference_batches = [batch.tolist() for batch in DataLoader(range(num_samples), batch_size=8, sampler=sampler)]

        perm = torch.randperm(num_samples, generator=torch.Generator().manual_seed(epoch)).tolist()
        total = -(-num_samples // dp_size) * dp_size
        perm += perm[: total - num_samples]  # DistributedSampler's padding (drop_last=False)
        rank_lists = [perm[rank::dp_size] for rank in range(dp_size)]
        expected = [
            [index for rank in range(dp_size) for index in rank_lists[rank][start : start + per_rank]]
            for start in range(0, len(rank_lists[0]), per_rank)
        ]
        assert reference_batches == expected


def test_assert_equivalent_detects_small_differences(reference_run: ReferenceFn) -> None:
    reference = reference_run("gpt", 2)
    assert_equivalent(reference, reference, rtol=RTOL)

    name = "model.blocks.1.attn.qkv.weight"
    perturbed = {**reference, "params": dict(reference["params"])}
    tensor = perturbed["params"][name].clone()
    tensor[5, 3] += 1e-4 * tensor.abs().max()  # one entry, 10x the tolerance
    perturbed["params"][name] = tensor
    with pytest.raises(AssertionError, match=name.replace(".", r"\.")):
        assert_equivalent(reference, perturbed, rtol=RTOL)

    shifted = {**reference, "losses": [loss * (1 + 1e-4) for loss in reference["losses"]]}
    with pytest.raises(AssertionError, match="train losses differ"):
        assert_equivalent(reference, shifted, rtol=RTOL)

    missing = {**reference, "params": {k: v for k, v in reference["params"].items() if k != name}}
    with pytest.raises(AssertionError, match="state dict keys differ"):
        assert_equivalent(reference, missing, rtol=RTOL)

    drifted = {**reference, "replica_max_abs_diff": 1e-7}  # two ranks' copies of one parameter disagree
    with pytest.raises(AssertionError, match="ranks holding the same parameter differ by up to 1.000e-07"):
        assert_equivalent(reference, drifted, rtol=RTOL)
