"""Options and bad input of ``HybridStrategy`` that are decided before any process starts."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from lightning_hybrid import HybridStrategy, ParallelDims
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.glue.precision import precision_plugin_for
from lightning_hybrid.parallel.grad_norm import clip_grad_norm_
from tests.models import build_module


def test_registered_as_hybrid() -> None:
    assert StrategyRegistry["hybrid"]["strategy"] is HybridStrategy
    trainer = Trainer(accelerator="cpu", devices=1, strategy="hybrid", logger=False)
    assert isinstance(trainer.strategy, HybridStrategy)


def test_dims_infer_dp_and_name_the_mesh_sizes() -> None:
    dims = ParallelDims(world_size=16, tp=2, pp=2, dp_replicate=2)
    assert dims.dp == 2 and dims.data_parallel_size == 4
    assert dims.sizes == {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}


def test_cp_ranks_join_the_sharding_dimension_but_not_the_batches() -> None:
    dims = ParallelDims(world_size=16, tp=2, cp=2, dp_replicate=2)
    assert dims.dp == 2 and dims.data_parallel_size == 4 and dims.gradient_ranks == 8
    assert dims.sizes == {"pp": 1, "dp_replicate": 2, "dp_shard": 4, "tp": 2}
    with pytest.raises(ValueError, match=r"tp=2 × pp=1 × dp_replicate=1 × cp=4 = 8 does not divide the world size 12"):
        ParallelDims(world_size=12, tp=2, cp=4)


def test_what_cp_does_not_combine_with_yet_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match=r"cp=0\) is invalid: cp must be a positive integer"):
        HybridStrategy(cp=0)
    with pytest.raises(ValueError, match=r"cp=2, compile=...\) is not supported yet: drop compile, or use cp=1"):
        HybridStrategy(cp=2, compile=True)
    with pytest.raises(ValueError, match=r"cp=2\) with tp='auto' or pp='auto'"):
        HybridStrategy(cp=2, tp="auto")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(world_size=8, dp=3, tp=2), r"dp=3 × tp=2 × pp=1 × dp_replicate=1 = 6, but the world size .* is 8"),
        (dict(world_size=6, tp=4), r"tp=4 × pp=1 × dp_replicate=1 = 4 does not divide the world size 6"),
        (dict(world_size=4, tp=0), r"tp=0\) is invalid: tp must be a positive integer"),
        (dict(world_size=4, dp="two"), r"dp='two'\) is invalid: dp must be a positive integer or 'auto'"),
        (dict(world_size=4, dp_replicate=1.5), r"dp_replicate=1.5\) is invalid"),
    ],
)
def test_bad_degrees(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kwargs)


def test_world_size_mismatch_is_reported_when_the_trainer_is_built() -> None:
    with pytest.raises(ValueError, match=r"dp=2 × tp=2 .* = 4, but the world size \(devices × num_nodes\) is 2"):
        Trainer(accelerator="cpu", devices=2, strategy=HybridStrategy(dp=2, tp=2), logger=False)


def test_bad_options_fail_at_construction() -> None:
    with pytest.raises(ValueError, match=r"zero=1\) is not offered.*Use zero=2"):
        HybridStrategy(zero=1)
    with pytest.raises(ValueError, match=r"zero=4\) is invalid: choose 2 or 3"):
        HybridStrategy(zero=4)
    with pytest.raises(ValueError, match=r"pp=0\) is invalid: pp must be a positive integer"):
        HybridStrategy(pp=0)
    with pytest.raises(ValueError, match=r"tp=-1\) is invalid"):
        HybridStrategy(tp=-1)
    with pytest.raises(ValueError, match=r"offload='cpu'\) is invalid: pass True \(CPU offload\) or False"):
        HybridStrategy(offload="cpu")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        # Lightning's own check for its ModelParallelStrategy family answers first for these.
        ("16-mixed", r"does not support .*precision='16-mixed'.*Choose a different precision among: 32-true"),
        ("64-true", r"does not support .*precision='64-true'.*Choose a different precision among: 32-true"),
    ],
)
def test_unsupported_precision_names_the_supported_ones(precision: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), precision=precision, logger=False)


def test_a_precision_plugin_the_strategy_cannot_serve_names_the_supported_flags() -> None:
    # Reached when a plugin instance is passed (Lightning checks only the flag): ModelParallelStrategy's own four.
    with pytest.raises(ValueError, match=r"does not support precision='16-mixed'. Choose one of 32-true, bf16-mixed,"
                                         r" bf16-true, 16-true"):
        precision_plugin_for("16-mixed")


def test_pytorch_lightning_trainer_rejects_the_lightning_strategy_by_name() -> None:
    import pytorch_lightning  # the test extra installs it (lightning depends on it today, but need not)

    with pytest.raises(ValueError, match=r"HybridStrategy is built on `lightning.pytorch`.*Import Trainer and LightningModule from lightning.pytorch"):
        pytorch_lightning.Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(), logger=False)


def test_block_list_is_found_by_structure_not_name() -> None:
    assert find_block_list(build_module("gpt"))[0] == "model.blocks"
    assert find_block_list(build_module("llama"))[0] == "model.layers"
    nested = nn.Module()
    nested.transformer = nn.Module()
    nested.transformer.h = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
    nested.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2)])  # same class, fewer: not the trunk
    assert find_block_list(nested)[0] == "transformer.h"


class _Composite(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)


def test_a_dict_of_unlike_parts_is_not_a_block_list_and_every_list_of_composite_blocks_joins_the_trunk() -> None:
    litgpt_like = nn.Module()  # litgpt's GPT: transformer = ModuleDict(wte=..., h=ModuleList(...), ln_f=...)
    litgpt_like.transformer = nn.ModuleDict(dict(wte=nn.Embedding(8, 4), h=nn.ModuleList(_Composite(4) for _ in range(2)),
                                                  ln_f=nn.LayerNorm(4)))
    assert find_block_list(litgpt_like)[0] == "transformer.h"
    encoder_decoder = nn.Module()
    encoder_decoder.encoder = nn.ModuleList(_Composite(4) for _ in range(2))
    encoder_decoder.decoder = nn.ModuleList(_Composite(6) for _ in range(3))
    path, blocks = find_block_list(encoder_decoder)
    assert path == "encoder,decoder" and len(blocks) == 5
    assert [blocks.name(i) for i in (0, 1, 2, 4)] == ["encoder.0", "encoder.1", "decoder.0", "decoder.2"]
    assert blocks[3] is encoder_decoder.decoder[1]
    assert blocks.contains_name("decoder.1.inner.weight") and not blocks.contains_name("decoders.1")
    assert find_block_list(encoder_decoder, "decoder, encoder")[1].name(0) == "decoder.0"


def test_block_list_errors_say_how_to_name_it() -> None:
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"no nn.ModuleList/nn.Sequential/nn.ModuleDict holds two or more blocks.*"
                                         r"HybridStrategy\(blocks='path.to.block_list'\)"):
        find_block_list(flat)
    with pytest.raises(ValueError, match=r"blocks='model.trunk'\).*has no submodule"):
        find_block_list(build_module("gpt"), "model.trunk")
    with pytest.raises(ValueError, match=r"must name non-empty nn.ModuleList, nn.Sequential or nn.ModuleDict containers.*got LayerNorm"):
        find_block_list(build_module("gpt"), "model.ln_f")


def test_clip_grad_norm_over_plain_tensors_matches_torch() -> None:
    torch.manual_seed(0)
    ours, theirs = [nn.Parameter(torch.randn(5, 3)) for _ in range(2)], None
    theirs = [nn.Parameter(p.detach().clone()) for p in ours]
    for p, q in zip(ours, theirs):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    total = clip_grad_norm_(ours, 0.5)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    assert torch.allclose(total, expected)
    for p, q in zip(ours, theirs):
        assert torch.allclose(p.grad, q.grad)
    assert float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in ours]))) == pytest.approx(0.5, rel=1e-5)


def test_consolidated_checkpoints_are_refused_with_pipelining() -> None:
    with pytest.raises(ValueError, match=r"would write only the first pipeline stage's parameters"):
        HybridStrategy(pp=2, save_distributed_checkpoint=False)
