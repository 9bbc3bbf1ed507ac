"""The replica check (``HybridStrategy(check_replicas_every_n_steps=N)``, :mod:`lightning_hybrid.resilience.replicas`):
fingerprints and the dimensions each parameter is replicated over on one process; on 4 gloo ranks, one copy
perturbed by one ulp is named (tensor, kind, ranks) identically on every rank, and a checked fit trains exactly like
an unchecked one."""

from __future__ import annotations

import os
import statistics
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.data import DataLoader

from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.resilience import replicas
from lightning_hybrid.resilience.replicas import (
    Divergence, ReplicaCheck, ReplicaDivergence, divergences, fingerprint, replicated_dims, report, spanned_dims,
)
from tests.helpers import on_ranks
from tests.models import RandomTokenDataset, build_module

ROOT_NAMES = ("pp", "dp_replicate", "dp_shard", "tp")
#: 8 ranks, no pipeline: rank = 4 × dp_replicate + 2 × dp_shard + tp.
HSDP_TP = torch.arange(8).reshape(1, 2, 2, 2)


# ------------------------------------------------------------------------------------------------- fingerprint
def test_the_fingerprint_is_the_integer_sums_of_the_16_bit_words() -> None:
    # 1.0f is 0x3F800000: little-endian words 0x0000 and 0x3F80 = 16256, weighted by positions 1 and 2.
    assert fingerprint(torch.tensor([1.0])).tolist() == [16256, 2 * 16256]
    assert fingerprint(torch.tensor([1.0, 1.0])).tolist() == [2 * 16256, (2 + 4) * 16256]
    assert fingerprint(torch.tensor([3], dtype=torch.uint8)).tolist() == [3, 3]  # odd byte count: bytes
    assert fingerprint(torch.empty(0)).tolist() == [0, 0]


def test_one_ulp_anywhere_and_a_swap_change_the_fingerprint() -> None:
    values = torch.randn(600_000, generator=torch.Generator().manual_seed(0))  # 1.2 M words: two chunks
    reference = fingerprint(values)
    assert torch.equal(fingerprint(values.clone()), reference)
    for index in (0, 7, 599_999):  # first chunk, and the second
        nudged = values.clone()
        nudged[index] = torch.nextafter(nudged[index], torch.tensor(float("inf")))
        assert not torch.equal(fingerprint(nudged), reference)
    swapped = values.clone()
    swapped[[3, 4]] = values[[4, 3]]
    assert fingerprint(swapped)[0] == reference[0] and fingerprint(swapped)[1] != reference[1]
    half = values[:1001].to(torch.bfloat16)
    assert fingerprint(half).tolist() != fingerprint(torch.nextafter(half, half + 1)).tolist()


# ---------------------------------------------------------------------------------------- replicated dimensions
def test_placements_decide_which_dimensions_a_parameter_is_replicated_over() -> None:
    data_tp = HSDP_TP[0]  # FSDP2's mesh under HSDP × tp: (dp_replicate, dp_shard, tp)
    sharded = (Replicate(), Shard(0), Shard(0))
    assert replicated_dims(5, HSDP_TP, ROOT_NAMES, sharded, data_tp) == ("dp_replicate",)
    norm = (Replicate(), Shard(0), Replicate())  # a LayerNorm tensor parallelism keeps whole
    assert replicated_dims(5, HSDP_TP, ROOT_NAMES, norm, data_tp) == ("dp_replicate", "tp")
    # A mesh over the flattened data ranks (of this rank's tp coordinate) leaves tp uncovered: replicated there.
    flat_data = torch.tensor([1, 3, 5, 7])
    assert replicated_dims(5, HSDP_TP, ROOT_NAMES, (Shard(0),), flat_data) == ("tp",)
    assert replicated_dims(5, HSDP_TP, ROOT_NAMES, (Replicate(),), flat_data) == ("dp_replicate", "dp_shard", "tp")
    assert replicated_dims(5, HSDP_TP, ROOT_NAMES) == ("dp_replicate", "dp_shard", "tp")  # a plain tensor
    # Pipeline stages hold different parameters; size-1 dimensions replicate nothing.
    pipelined = torch.arange(4).reshape(2, 1, 1, 2)
    assert replicated_dims(3, pipelined, ROOT_NAMES) == ("tp",)
    assert replicated_dims(3, pipelined, ROOT_NAMES, (Shard(0), Shard(0)), pipelined[1, 0]) == ()


def test_spanned_dimensions_are_those_the_ranks_coordinates_differ_in() -> None:
    assert spanned_dims([1, 5], HSDP_TP, ROOT_NAMES) == {"dp_replicate"}
    assert spanned_dims([0, 3, 4], HSDP_TP, ROOT_NAMES) == {"dp_replicate", "dp_shard", "tp"}
    assert spanned_dims([2], HSDP_TP, ROOT_NAMES) == set()


# ------------------------------------------------------------------------------------------------- the report
def _records(norm_prints: list[tuple[int, int]], key_of: Any = lambda rank: ()) -> list[list[Any]]:
    return [[(("model.ln.weight",), ("tp",), key_of(rank), prints)] for rank, prints in enumerate(norm_prints)]


def test_the_copy_that_disagrees_with_the_majority_is_named() -> None:
    found = divergences(_records([(1, 2), (1, 3), (1, 2), (1, 2)]))
    assert found == [Divergence(("model.ln.weight",), ("tp-replicated",), ranks=(1,), majority=(0, 2, 3))]
    assert divergences(_records([(1, 2)] * 4)) == []
    message = report(found, step=7)
    assert "after optimizer step 7" in message
    assert "model.ln.weight (tp-replicated): rank(s) 1 differ from ranks 0, 2, 3 (the majority)" in message


def test_two_copies_that_differ_have_no_majority_and_other_copy_keys_are_not_compared() -> None:
    found = divergences(_records([(1, 2), (1, 3)]))
    assert found == [Divergence(("model.ln.weight",), ("tp-replicated",), ranks=(0, 1), majority=())]
    assert "ranks 0, 1 hold 2 copies with no majority agreeing" in report(found, 1)
    # Ranks 0, 1 hold one shard and ranks 2, 3 another: only copies with the same key must agree.
    assert divergences(_records([(1, 2), (1, 2), (5, 6), (5, 6)], lambda rank: (("dp_shard", rank // 2),))) == []


# --------------------------------------------------------------------------------------------- option & callback
@pytest.mark.parametrize("value", [0, -3, 2.5, True, "10"])
def test_the_option_takes_a_positive_integer_or_none(value: Any) -> None:
    with pytest.raises(ValueError, match=r"check_replicas_every_n_steps=.* must be a positive integer or None"):
        HybridOptions(check_replicas_every_n_steps=value)
    assert HybridOptions(check_replicas_every_n_steps=5).check_replicas_every_n_steps == 5
    assert HybridOptions().check_replicas_every_n_steps is None


def test_the_callback_checks_after_every_nth_optimizer_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    checked: list[int] = []
    monkeypatch.setattr(replicas, "plan_checks", lambda module, mesh, shared: "plan")
    monkeypatch.setattr(replicas, "check_replicas", lambda plan, device, step: checked.append(step))
    trainer = SimpleNamespace(global_step=0, strategy=SimpleNamespace(device_mesh=None, root_device="cpu"))
    callback = ReplicaCheck(every_n_steps=2)
    callback.on_train_start(trainer, None)
    for step in (0, 1, 1, 2, 2, 3, 4, 4):  # global steps after each micro-batch, accumulating 2 at times
        trainer.global_step = step
        callback.on_train_batch_end(trainer, None, None, None, 0)
    assert checked == [2, 4] and callback.last_checked_step == 4


# --------------------------------------------------------------------------------------------------- 4 ranks
def _fit(module: Any, folder: str, **strategy: Any) -> Any:
    from lightning.pytorch import Trainer

    from lightning_hybrid import HybridStrategy

    trainer = Trainer(accelerator="cpu", devices=4, strategy=HybridStrategy(monitor=False, **strategy), max_steps=3,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=folder)
    trainer.fit(module, DataLoader(RandomTokenDataset(num_samples=16), batch_size=2))
    return trainer


def _full(module: Any) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in module.named_parameters()}


def _perturbed_check(rank: int, trainer: Any, name: str, at_rank: int) -> Any:
    """Check with ``name``'s local copy on ``at_rank`` one ulp larger in its first element; restore it after.
    Returns the divergences every rank raised, with the message."""
    local = _local_data(trainer.lightning_module, name) if rank == at_rank else torch.zeros(1)
    kept = local[0].clone()
    local[0] = torch.nextafter(kept, torch.tensor(float("inf")))
    plan = replicas.plan_checks(trainer.lightning_module, trainer.strategy.device_mesh,
                                trainer.strategy.pipeline.shared if trainer.strategy.pipeline else ())
    try:
        replicas.check_replicas(plan, torch.device("cpu"), step=3)
        return None
    except ReplicaDivergence as error:
        return [(d.names, d.kinds, d.ranks, d.majority) for d in error.divergences], str(error)
    finally:
        local[0] = kept


def _local_data(module: Any, name: str) -> torch.Tensor:
    """The flat local data of parameter ``name`` (a view: writing to it changes the parameter)."""
    parameter = dict(module.named_parameters())[name]
    return (parameter.to_local() if isinstance(parameter, DTensor) else parameter).detach().view(-1)


def _check_cost_ms(trainer: Any) -> float:
    plan = replicas.plan_checks(trainer.lightning_module, trainer.strategy.device_mesh)
    seconds = []
    for _ in range(10):
        start = time.perf_counter()
        replicas.check_replicas(plan, torch.device("cpu"), step=3)
        seconds.append(time.perf_counter() - start)
    return 1e3 * statistics.median(seconds)


def _on_four_ranks(rank: int, results: dict, folder: str) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="4", NODE_RANK="0")
    torch.set_num_threads(1)
    checked = _fit(build_module("gpt"), folder, dp_replicate=2, tp=2, check_replicas_every_n_steps=1)
    unchecked = _fit(build_module("gpt"), folder, dp_replicate=2, tp=2)
    cases = {
        "hsdp": _perturbed_check(rank, checked, "model.blocks.0.mlp.fc_in.weight", at_rank=1),
        "tp_norm": _perturbed_check(rank, checked, "model.blocks.1.ln_2.weight", at_rank=1),
        "unperturbed": _perturbed_check(rank, checked, "model.ln_f.weight", at_rank=-1),
        "check_ms": _check_cost_ms(checked),
    }
    pipelined = _fit(build_module("tied", config={"n_layers": 2}), folder, tp=2, pp=2, check_replicas_every_n_steps=1)
    cases["tied"] = _perturbed_check(rank, pipelined, "model.embed.weight", at_rank=2)
    cases["pp_norm"] = _perturbed_check(rank, pipelined, "model.blocks.0.norm1.weight", at_rank=0)
    checks = [c for c in checked.callbacks + pipelined.callbacks if isinstance(c, ReplicaCheck)]
    results[rank] = dict(cases, checked_steps=[c.last_checked_step for c in checks])
    params = (_full(checked.lightning_module), _full(unchecked.lightning_module))  # collective: on every rank
    if rank == 0:
        results["params"] = params


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[Any, Any]:
    start = time.perf_counter()
    results = on_ranks(4, _on_four_ranks, str(tmp_path_factory.mktemp("replicas")))
    costs = ", ".join(f"{results[rank]['check_ms']:.2f}" for rank in range(4))
    print(f"[replicas] 4-rank launch {time.perf_counter() - start:.1f}s; one check at HSDP2 × tp2 (tiny GPT):"
          f" {costs} ms per rank")
    return results


@pytest.mark.slow
def test_a_checked_fit_passes_and_trains_exactly_like_an_unchecked_one(four_ranks: dict) -> None:
    checked, unchecked = four_ranks["params"]
    assert checked.keys() == unchecked.keys()
    assert all(torch.equal(checked[name], unchecked[name]) for name in checked)
    for rank in range(4):
        assert four_ranks[rank]["checked_steps"] == [3, 3]  # both checked fits ran their checks to the last step
        assert four_ranks[rank]["unperturbed"] is None


@pytest.mark.slow
@pytest.mark.parametrize("case, expected", [
    # Column-sharded over tp: two HSDP copies of each shard, ranks 1 and 3 (dp_replicate 0 and 1, tp 1).
    ("hsdp", (("model.blocks.0.mlp.fc_in.weight",), ("HSDP replica",), (1, 3), ())),
    # Kept whole by tensor parallelism: four copies (2 replicas × 2 tp ranks), three agreeing.
    ("tp_norm", (("model.blocks.1.ln_2.weight",), ("HSDP replica", "tp-replicated"), (1,), (0, 2, 3))),
    # Tied embedding and head, held on both stages and sharded over the vocabulary there: each shard has two
    # copies, on ranks 0 (stage 0) and 2 (stage 1) with tp coordinate 0, so no majority.
    ("tied", (("model.embed.weight", "model.head.weight"), ("tied copy across pipeline stages",), (0, 2), ())),
    # Kept whole by tensor parallelism on stage 0 (ranks 0, 1), no other copy: two copies, no majority.
    ("pp_norm", (("model.blocks.0.norm1.weight",), ("tp-replicated",), (0, 1), ())),
])
def test_one_perturbed_copy_is_named_on_every_rank(four_ranks: dict, case: str, expected: tuple) -> None:
    found, message = four_ranks[0][case]
    assert found == [expected]
    assert all(four_ranks[rank][case] == (found, message) for rank in range(4))  # every rank raised the same
    assert expected[0][0] in message
