"""Code written for Lightning's ``ModelParallelStrategy`` runs unchanged under ``HybridStrategy`` (see
``lightning_hybrid/glue/model_parallel_compat.py``): ``configure_model`` sees Lightning's 2-D mesh ``(data_parallel,
tensor_parallel)``, ``"auto"`` has Lightning's meaning, a module that parallelizes itself needs no block list,
``precision="16-true"`` is accepted, and training gives ModelParallelStrategy's numbers (and one device's).

The multi-process checks share one launch of 2 gloo ranks, in which every Trainer runs in turn.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hybrid import HybridStrategy
from lightning_hybrid.mesh import ParallelDims, lightning_view
from lightning_hybrid.glue.model_parallel_compat import (
    keep_given_degrees,
    mesh_degrees,
    stop_watching,
    watch_reads,
)
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.glue.precision import HybridHalfPrecision
from tests.helpers import on_two_ranks

WIDTH = 16
DATA = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
OUR_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


class FeedForward(nn.Module):
    """SwiGLU, as in Lightning's own tests of ModelParallelStrategy: three linears and no block list."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(F.silu(self.w1(x)) * self.w2(x))


class Plain(LightningModule):
    """A module with no parallelism code: the strategy parallelizes it. Records what it sees."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = FeedForward()
        self.losses: list[float] = []
        self.seen: dict[str, Any] = {}

    def training_step(self, batch: torch.Tensor) -> torch.Tensor:
        loss = self.model(batch).pow(2).mean()
        self.losses.append(float(loss))
        return loss

    def on_train_start(self) -> None:
        self.seen["names_in_training"] = self.device_mesh.mesh_dim_names
        self.seen["dtype"] = self.model.w1.weight.dtype
        self.seen["dtensor"] = isinstance(self.model.w1.weight, DTensor)
        self.seen["fsdp"] = any(isinstance(m, FSDPModule) for m in self.modules())
        self.seen["root_fsdp"] = isinstance(self, FSDPModule)  # the strategy's own FSDP2 root

    def train_dataloader(self) -> DataLoader:
        return DataLoader(DATA, batch_size=2)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class ReadsTheMesh(Plain):
    """Reads ``self.device_mesh`` in ``configure_model`` and applies nothing (Lightning's ``BoringModel`` test)."""

    def configure_model(self) -> None:
        mesh = self.device_mesh
        self.seen.update(names=mesh.mesh_dim_names, shape=tuple(mesh.shape), ranks=mesh.mesh.tolist())


class SelfParallel(ReadsTheMesh):
    """Written for ModelParallelStrategy: tensor parallelism and FSDP2 applied in ``configure_model``."""

    def configure_model(self) -> None:
        super().configure_model()
        tp_mesh, dp_mesh = self.device_mesh["tensor_parallel"], self.device_mesh["data_parallel"]
        parallelize_module(self.model, tp_mesh, {"w1": ColwiseParallel(), "w2": ColwiseParallel(),
                                                 "w3": RowwiseParallel()})
        for layer in (self.model.w1, self.model.w2, self.model.w3):
            fully_shard(layer, mesh=dp_mesh)


def _fit(module: Plain, strategy: Any, folder: str, precision: str = "32-true") -> dict[str, Any]:
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, precision=precision, max_epochs=1,
                      logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=folder)
    trainer.fit(module)
    full = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
            for name, p in module.model.named_parameters()}
    losses: list[list[float] | None] = [None, None]
    dist.all_gather_object(losses, module.losses)
    return dict(module.seen, losses=losses, params=full, strategy=trainer.strategy)


def _reference(data_parallel: int) -> dict[str, Any]:
    """One device, no Lightning: the same model, loss and optimizer, each step on the samples all data-parallel
    ranks take in it (Lightning shuffles a distributed training loader, seed 0)."""
    torch.manual_seed(0)
    model = FeedForward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    orders = [list(DistributedSampler(DATA, data_parallel, rank, shuffle=True, seed=0)) for rank in range(data_parallel)]
    losses = []
    for step in range(len(orders[0]) // 2):
        loss = model(DATA[[i for order in orders for i in order[2 * step:2 * step + 2]]]).pow(2).mean()
        losses.append(float(loss))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _scenarios(rank: int, results: dict, folder: str) -> None:
    # Lightning takes processes started with these variables as launched already, and joins their group.
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE="2", NODE_RANK="0")
    torch.set_num_threads(1)
    runs = {}
    for name, dp, tp in (("1x2", 1, 2), ("2x1", 2, 1)):
        runs[f"hybrid_{name}"] = _fit(SelfParallel(), HybridStrategy(dp=dp, tp=tp), folder)
        runs[f"lightning_{name}"] = _fit(SelfParallel(), ModelParallelStrategy(dp, tp), folder)
    runs["hybrid_auto"] = _fit(SelfParallel(), HybridStrategy(dp="auto", tp="auto"), folder)
    runs["lightning_auto"] = _fit(SelfParallel(), ModelParallelStrategy(), folder)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runs["reads_only"] = _fit(ReadsTheMesh(), HybridStrategy(dp=2), folder)
    runs["reads_only"]["warnings"] = [str(w.message) for w in caught]
    runs["hybrid_16"] = _fit(SelfParallel(), HybridStrategy(dp=2, tp=1), folder, precision="16-true")
    runs["lightning_16"] = _fit(SelfParallel(), ModelParallelStrategy(2, 1), folder, precision="16-true")
    runs["plain_16"] = _fit(Plain(), HybridStrategy(dp=2), folder, precision="16-true")
    try:
        _fit(SelfParallel(), HybridStrategy(pp=2), folder)
        runs["pp2_error"] = None
    except ValueError as error:
        runs["pp2_error"] = str(error)
    if rank == 0:
        for run in runs.values():
            strategy = run.pop("strategy", None) if isinstance(run, dict) else None
            if isinstance(strategy, HybridStrategy):
                run.update(options=(strategy.options.dp, strategy.options.tp), estimate=strategy.layout_estimate,
                           strategy_names=strategy.device_mesh.mesh_dim_names)
        results.update(runs, reference_1=_reference(1), reference_2=_reference(2))
    else:
        results["rank1_seen"] = {key: runs[key]["names"] for key in ("hybrid_1x2", "hybrid_2x1")}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return on_two_ranks(_scenarios, str(tmp_path_factory.mktemp("model_parallel")))


# ---------------------------------------------------------------------------------------------- one process
def test_auto_degrees_have_lightnings_meaning_until_a_layout_is_chosen() -> None:
    # ModelParallelStrategy(): tensor parallelism over one node's devices, data parallelism across nodes.
    assert mesh_degrees(HybridOptions(dp="auto", tp="auto"), 4, 4) == {"dp": "auto", "tp": 4, "pp": 1,
                                                                        "dp_replicate": 1}
    assert ParallelDims(8, **mesh_degrees(HybridOptions(dp="auto", tp="auto"), 8, 4)).sizes["dp_shard"] == 2
    assert mesh_degrees(HybridOptions(dp=2, tp="auto"), 8, 8)["tp"] == 4  # what a fixed dp leaves
    assert mesh_degrees(HybridOptions(tp=2, pp="auto"), 4, 4)["pp"] == 1
    assert mesh_degrees(HybridOptions(dp=1, tp=1, pp="auto"), 2, 2)["pp"] == 2  # once 1: "dp × tp × pp = 1, but 2"
    assert mesh_degrees(HybridOptions(tp=2), 4, 4) == {**HybridOptions(tp=2).degrees, "ep": 1, "cp": 1}  # fixed: as given
    assert mesh_degrees(HybridOptions(ep=2), 4, 4)["ep"] == 2
    kept = keep_given_degrees(HybridOptions(dp="auto", tp="auto"), ParallelDims(4, tp=4))
    assert (kept.dp, kept.tp, kept.pp, kept.chooses_layout) == (1, 4, 1, False)


def test_16_true_is_served_with_fp16_parameters() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), precision="16-true", logger=False)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, HybridHalfPrecision) and plugin.precision == "16-true"
    assert plugin.convert_module(nn.Linear(2, 2)).weight.dtype == torch.float16


def _watch_on_two_ranks(rank: int, results: dict) -> None:
    mesh = init_device_mesh("cpu", (1, 1, 1, 2), mesh_dim_names=OUR_DIMS)
    view = lightning_view(mesh)
    results[f"view{rank}"] = (view.mesh_dim_names, tuple(view.shape), isinstance(watch_reads(view), DeviceMesh))
    results[f"unread{rank}"] = stop_watching(view)
    watch_reads(view)
    results[f"size{rank}"] = view["tensor_parallel"].size()
    results[f"read{rank}"] = (stop_watching(view), type(view) is DeviceMesh, stop_watching(view))
    results[f"aliases{rank}"] = (mesh["tensor_parallel"].size(), mesh["data_parallel"].size())


@pytest.mark.slow
def test_the_module_mesh_is_lightnings_view_and_notes_being_read() -> None:
    results = on_two_ranks(_watch_on_two_ranks)
    for rank in (0, 1):
        assert results[f"view{rank}"] == (("data_parallel", "tensor_parallel"), (1, 2), True)
        assert results[f"unread{rank}"] is False
        assert results[f"size{rank}"] == 2
        assert results[f"read{rank}"] == (True, True, False)  # read once, then an ordinary DeviceMesh again
        assert results[f"aliases{rank}"] == (2, 1)  # our mesh answers Lightning's names too


# ---------------------------------------------------------------------------------------------- two ranks
@pytest.mark.slow
def test_configure_model_sees_lightnings_mesh(runs: dict[str, Any]) -> None:
    for name, shape in (("1x2", (1, 2)), ("2x1", (2, 1)), ("auto", (1, 2))):
        ours, lightning = runs[f"hybrid_{name}"], runs[f"lightning_{name}"]
        assert ours["names"] == lightning["names"] == ("data_parallel", "tensor_parallel")
        assert ours["shape"] == lightning["shape"] == shape
        assert ours["ranks"] == lightning["ranks"]  # same rank layout
        # A module that parallelized itself keeps Lightning's mesh; the strategy's answers both names.
        assert ours["names_in_training"] == ("data_parallel", "tensor_parallel")
        assert ours["strategy_names"] == OUR_DIMS
    assert runs["rank1_seen"] == {"hybrid_1x2": ("data_parallel", "tensor_parallel"),
                                  "hybrid_2x1": ("data_parallel", "tensor_parallel")}


@pytest.mark.slow
def test_auto_means_what_it_means_to_lightning_and_no_layout_is_planned(runs: dict[str, Any]) -> None:
    auto = runs["hybrid_auto"]
    assert auto["options"] == (1, 2) and auto["estimate"] is None
    assert auto["losses"] == runs["lightning_auto"]["losses"] == runs["lightning_1x2"]["losses"]


@pytest.mark.slow
def test_a_self_parallelizing_module_needs_no_block_list_and_trains_as_under_lightning(runs: dict[str, Any]) -> None:
    for name, reference in (("1x2", runs["reference_1"]), ("2x1", runs["reference_2"])):
        ours, lightning = runs[f"hybrid_{name}"], runs[f"lightning_{name}"]
        assert ours["dtensor"] and ours["fsdp"] and not ours["root_fsdp"]  # the module's own, nothing added
        assert ours["losses"] == lightning["losses"]  # the same code path: bit for bit
        for name_, tensor in ours["params"].items():
            assert torch.equal(tensor, lightning["params"][name_]), name_
        # One device on the global batch: the mean of the data-parallel ranks' losses.
        steps = [sum(step) / len(step) for step in zip(*ours["losses"])]
        assert len(steps) == len(reference["losses"])
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(steps, reference["losses"]))
        for name_, tensor in ours["params"].items():
            assert torch.allclose(tensor, reference["params"][name_], rtol=1e-5, atol=1e-6), name_


@pytest.mark.slow
def test_a_module_that_only_reads_the_mesh_is_left_alone_with_a_warning(runs: dict[str, Any]) -> None:
    run = runs["reads_only"]
    assert run["names"] == ("data_parallel", "tensor_parallel") and run["shape"] == (2, 1)
    assert not run["fsdp"] and not run["dtensor"]
    assert any("each of the 2 data-parallel ranks trains its own copy" in w for w in run["warnings"])


@pytest.mark.slow
def test_16_true_trains_in_fp16_like_lightning(runs: dict[str, Any]) -> None:
    ours, lightning, plain = runs["hybrid_16"], runs["lightning_16"], runs["plain_16"]
    assert ours["dtype"] == lightning["dtype"] == plain["dtype"] == torch.float16
    assert ours["losses"] == lightning["losses"]
    # Parallelized by the strategy (FSDP2 over both ranks) in fp16: one device's fp32 numbers within fp16 rounding.
    assert plain["root_fsdp"] and plain["names_in_training"] == OUR_DIMS
    steps = [sum(step) / len(step) for step in zip(*plain["losses"])]
    assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(steps, runs["reference_2"]["losses"]))


@pytest.mark.slow
def test_a_pipeline_on_top_of_a_self_parallelizing_module_is_refused(runs: dict[str, Any]) -> None:
    assert runs["pp2_error"] is not None and "HybridStrategy(pp=2) splits a model the strategy parallelizes" in (
        runs["pp2_error"])
