"""Meta-device models: each rank materializes only its shards, and the values equal a single-device
initialization with the same seed (``lightning_hybrid.parallel.initialization``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_hybrid import HybridStrategy
from lightning_hybrid.parallel.initialization import init_weights, materialize_meta_module, module_seed
from tests.conftest import META_INIT_LAYERS, ReferenceFn
from tests.helpers import assert_equivalent, on_two_ranks
from tests.models import GPTConfig, LlamaConfig, RandomTokenDataset, TinyGPT, TinyLlama, build_module

RTOL = 1e-5


def _meta_gpt(layers: int) -> nn.Module:
    with torch.device("meta"):
        return TinyGPT(GPTConfig(num_layers=layers))


def test_a_module_value_depends_on_the_seed_and_its_name_only() -> None:
    small, large = _meta_gpt(2), _meta_gpt(4)
    assert materialize_meta_module(small, "cpu", seed=7) and materialize_meta_module(large, "cpu", seed=7)
    # Two more blocks exist in `large` (and are initialized too), yet the shared modules got the same values.
    for name, tensor in small.state_dict().items():
        torch.testing.assert_close(large.state_dict()[name], tensor, rtol=0, atol=0)
    # Distinct modules of the same shape get distinct draws, and another seed gives other values.
    assert not torch.equal(large.blocks[0].attn.qkv.weight, large.blocks[1].attn.qkv.weight)
    other = _meta_gpt(2)
    materialize_meta_module(other, "cpu", seed=8)
    assert not torch.equal(other.blocks[0].attn.qkv.weight, small.blocks[0].attn.qkv.weight)
    assert module_seed(7, "blocks.0.attn.qkv") != module_seed(7, "blocks.1.attn.qkv")


def test_initialization_follows_each_modules_reset_parameters() -> None:
    model = _meta_gpt(2)
    materialize_meta_module(model, "cpu", seed=3)
    qkv = model.blocks[0].attn.qkv
    bound = 1 / qkv.in_features**0.5  # nn.Linear's default: kaiming-uniform weight and bias within ±1/sqrt(fan_in)
    assert qkv.weight.abs().max() <= bound and qkv.bias.abs().max() <= bound
    assert qkv.weight.std() > bound / 2  # really drawn, not left at zeros
    torch.testing.assert_close(model.ln_f.weight, torch.ones(32))  # LayerNorm.reset_parameters: ones
    # The same draw as running the module's own reset_parameters under its seed.
    torch.manual_seed(module_seed(3, "blocks.0.attn.qkv"))
    expected = nn.Linear(32, 96)
    torch.testing.assert_close(qkv.weight, expected.weight, rtol=0, atol=0)


def test_eager_models_are_left_alone() -> None:
    model = TinyGPT(GPTConfig())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert not materialize_meta_module(model, "cpu", seed=3)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_a_tensor_nothing_initializes_is_named_in_the_error() -> None:
    # Built on meta outside any recording: RMSNorm's torch.ones is lost, and RMSNorm has no reset_parameters().
    with torch.device("meta"):
        model = TinyLlama(LlamaConfig())
    model.to_empty(device="cpu")
    with pytest.raises(ValueError, match=r"initial values of layers\.0\.attention_norm\.weight \(RMSNorm\), .*norm\.weight"
                                         r" \(RMSNorm\): their modules define no reset_parameters"):
        init_weights(model, seed=0)


def test_a_lightning_module_hook_initializes_what_nothing_else_does() -> None:
    class Root(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            with torch.device("meta"):
                self.model = TinyLlama(LlamaConfig())

        def init_module_weights(self, module: nn.Module) -> None:
            if type(module).__name__ == "RMSNorm":
                nn.init.constant_(module.weight, 3.0)

    root = Root()
    assert materialize_meta_module(root, "cpu", seed=4)
    torch.testing.assert_close(root.model.norm.weight, torch.full((32,), 3.0), rtol=0, atol=0)
    # The hook writes nothing to the linears: their reset_parameters() runs, under their own seed.
    torch.manual_seed(module_seed(4, "model.output"))
    torch.testing.assert_close(root.model.output.weight, nn.Linear(32, 64, bias=False).weight, rtol=0, atol=0)


def test_tensors_a_checkpoint_fills_afterwards_are_not_initialized() -> None:
    # HybridStrategy(weights=...): what the checkpoint loads next would only be overwritten (and initializing a
    # sharded tensor makes a full-size temporary of it: the last stage's head peaked at 1.9x its share).
    model = _meta_gpt(2)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.ln_f.weight.fill_(7.0)
        model.blocks[0].attn.qkv.weight.fill_(7.0)
    skip = {"ln_f.weight", "blocks.0.attn.qkv.weight"}
    init_weights(model, seed=3, skip=skip)
    assert torch.equal(model.ln_f.weight, torch.full((32,), 7.0))  # LayerNorm writes only skipped tensors: not run
    qkv = model.blocks[0].attn.qkv  # its initializer also writes the bias, which is not skipped: it runs
    assert qkv.bias.abs().max() <= 1 / 32**0.5 and qkv.bias.std() > 0


def _local_parts(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_hybrid._compat import StridedShard
    from lightning_hybrid.parallel.initialization import _keep_local_part

    mesh = init_device_mesh("cpu", (2,))
    full = torch.arange(30.0).reshape(6, 5)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    part = _keep_local_part(full, sharded)
    strided = distribute_tensor(full, mesh, [StridedShard(0, split_factor=3)])
    results[rank] = dict(view=part.untyped_storage().data_ptr() == full.untyped_storage().data_ptr(),
                         part=torch.equal(part, sharded.to_local()),
                         strided=torch.equal(_keep_local_part(full, strided), strided.to_local()))


def test_the_local_part_of_a_full_value_is_a_view_of_it_where_the_shard_is_a_box() -> None:
    # A box of the full tensor needs no copy (the redistribution from Replicate cloned it: one more shard-size
    # temporary at materialization's peak); a strided shard still goes through DTensor's redistribution.
    results = on_two_ranks(_local_parts)
    assert results == {0: dict(view=True, part=True, strided=True), 1: dict(view=True, part=True, strided=True)}


@pytest.mark.slow
@pytest.mark.parametrize(("layout", "dp_size"), [("dp2_tp2", 2), ("tp2_pp2", 1)])
def test_meta_model_materialized_per_rank_equals_single_device_init(
    layout: str, dp_size: int, reference_run: ReferenceFn, meta_init_runs
) -> None:
    reference = reference_run("gpt", dp_size, META_INIT_LAYERS, "per_module", short=True)
    model_bytes = sum(t.numel() * t.element_size() for t in reference["initial_params"].values())
    for result in meta_init_runs(layout):
        # No rank holds the whole model: 4 ranks split it 4 ways (dp × tp, or tp × pp), up to replicated norm
        # weights, FSDP padding and uneven stages.
        assert max(result["rank_local_parameter_bytes"]) < 0.3 * model_bytes, result["rank_local_parameter_bytes"]
        # Bit-identical initial values on every shard (tensor-parallel fused qkv, FSDP shards, pipeline stages) ...
        assert result["initial_params"].keys() == reference["initial_params"].keys()
        for name, tensor in reference["initial_params"].items():
            torch.testing.assert_close(result["initial_params"][name], tensor, rtol=0, atol=0, msg=name)
        # ... and the same training from there.
        assert_equivalent(reference, result, rtol=RTOL)


class _States(Callback):
    """The module's state when training starts (after the strategy materialized it) and when it ends."""

    def __init__(self) -> None:
        self.start: dict[str, Tensor] = {}
        self.end: dict[str, Tensor] = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.start = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.end = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}


def _fit_meta_llama(where: str) -> tuple[_States, list[str]]:
    """Two steps of a TinyLlama built on the meta device ``where`` Lightning documents it: in ``configure_model``
    or under ``trainer.init_module(empty_init=True)``; returns its states and every warning's text."""
    states = _States()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=False), max_steps=2, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[states])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if where == "init_module":
            with trainer.init_module(empty_init=True):
                module: Any = build_module("llama", init="eager")
            assert {p.device.type for p in module.parameters()} == {"meta"}
        else:
            module = build_module("llama", init="meta")
        trainer.fit(module, DataLoader(RandomTokenDataset(8, seed=1), batch_size=4))
    return states, [str(w.message) for w in caught]


@pytest.mark.usefixtures("one_process_fit")
def test_a_model_built_under_init_module_equals_one_built_in_configure_model_and_neither_warns() -> None:
    under_init_module, warned = _fit_meta_llama("init_module")
    in_configure_model, warned_too = _fit_meta_llama("configure_model")
    # Lightning warns that init_module "cannot fully support" a strategy that overrides model_sharded_context.
    assert not [w for w in warned + warned_too if "init_module" in w or "configure_model" in w], warned + warned_too
    # RMSNorm's torch.ones (no reset_parameters) is recomputed from the recorded construction, both ways ...
    norms = [k for k in under_init_module.start if k.endswith("norm.weight")]
    assert len(norms) == 2 * 2 + 1 and all(torch.equal(under_init_module.start[k], torch.ones(32)) for k in norms)
    # ... and the whole model starts and trains bit for bit alike.
    for start_or_end in ("start", "end"):
        a, b = getattr(under_init_module, start_or_end), getattr(in_configure_model, start_or_end)
        assert a.keys() == b.keys()
        for name, tensor in a.items():
            torch.testing.assert_close(tensor, b[name], rtol=0, atol=0, msg=name)
    assert not torch.equal(under_init_module.end["model.output.weight"], under_init_module.start["model.output.weight"])
