"""Meta-device init of models without ``reset_parameters()``: Hugging Face models through their ``_init_weights``,
values computed in ``__init__`` (rotary tables, masks, position ids, a norm's ones) recorded from the meta-device
construction (``lightning_hybrid.parallel.construction``), and the same full weights under FSDP2 and tensor
parallelism as on one device."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_hybrid.parallel.construction import recorded_values, recording_construction
from lightning_hybrid.parallel.initialization import init_weights, materialize_meta_module, module_seed
from tests.helpers import on_two_ranks
from tests.models import hugging_face_llama
from tests.zoo_hf import hugging_face_gpt2, hugging_face_qwen2

BUILDERS: dict[str, Callable[[dict[str, Any]], nn.Module]] = {
    "llama": hugging_face_llama, "qwen2": hugging_face_qwen2, "gpt2": hugging_face_gpt2,
}


def _meta(build: Callable[[], nn.Module]) -> tuple[nn.Module, dict[str, Callable[[], Tensor]]]:
    with recording_construction():
        with torch.device("meta"):
            model = build()
    return model, recorded_values(model)


def _values(model: nn.Module) -> dict[str, Tensor]:
    return {**dict(model.named_parameters(remove_duplicate=False)), **dict(model.named_buffers())}


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_meta_init_of_hugging_face_models_equals_eager_per_module_init(family: str) -> None:
    eager = BUILDERS[family]({})
    built_buffers = {name: b.clone() for name, b in eager.named_buffers()}
    init_weights(eager, seed=5)
    meta, recorded = _meta(lambda: BUILDERS[family]({}))
    assert materialize_meta_module(meta, "cpu", seed=5, recorded=recorded)
    expected, got = _values(eager), _values(meta)
    assert got.keys() == expected.keys()
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, rtol=0, atol=0, msg=name)
    # Rotary tables: exactly what the eager constructor computed (recorded, and HF's _init_weights agrees).
    assert built_buffers.keys() == ({"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
                                    if family != "gpt2" else set())
    for name, buffer in built_buffers.items():
        torch.testing.assert_close(got[name], buffer, rtol=0, atol=0, msg=name)


def test_hugging_face_init_follows_init_weights_per_module() -> None:
    meta, recorded = _meta(lambda: hugging_face_gpt2({}))
    materialize_meta_module(meta, "cpu", seed=2, recorded=recorded)
    block = meta.transformer.h[0]
    # GPT-2's _init_weights: Conv1D weights normal(0, 0.02) ... then the attention module rescales its c_proj to
    # 0.02 / sqrt(2 * n_layer), drawn under the attention module's seed.
    torch.manual_seed(module_seed(2, "transformer.h.0.attn"))
    scaled = torch.empty(32, 32).normal_(0, 0.02 / (2 * 4) ** 0.5)
    torch.testing.assert_close(block.attn.c_proj.weight, scaled, rtol=0, atol=0)
    assert 0.015 < float(block.attn.c_attn.weight.detach().std()) < 0.025
    assert float(block.attn.c_attn.bias.abs().max()) == 0.0 and torch.equal(block.ln_1.weight, torch.ones(32))
    assert meta.lm_head.weight is meta.transformer.wte.weight  # the tie survives materialization


class WithBuffers(nn.Module):
    """Values only ``__init__`` knows: a mask, position ids written through a view, a constant parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("mask", torch.full((5, 5), float("-inf")).triu(1))
        positions = torch.zeros(1, 6, dtype=torch.long)
        positions[0, 2:] = torch.arange(4) + 7
        self.register_buffer("positions", positions, persistent=False)
        self.scale = nn.Parameter(torch.ones(4) * 2)


def test_values_built_on_meta_are_recorded_exactly_and_random_ones_left_to_initializers() -> None:
    eager = WithBuffers()
    meta, recorded = _meta(WithBuffers)
    assert sorted(recorded) == ["mask", "positions", "scale"]  # proj's weight/bias are random draws: not recorded
    assert materialize_meta_module(meta, "cpu", seed=1, recorded=recorded)
    for name in recorded:
        torch.testing.assert_close(getattr(meta, name), getattr(eager, name), rtol=0, atol=0)
    assert meta.positions.tolist() == [[0, 0, 7, 8, 9, 10]]
    torch.manual_seed(module_seed(1, "proj"))
    torch.testing.assert_close(meta.proj.weight, nn.Linear(4, 4).weight, rtol=0, atol=0)


def _sharded_meta_init(rank: int, results: dict, layout: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,))
    model, recorded = _meta(lambda: hugging_face_llama({}))
    for layer in model.model.layers:
        if layout == "tp2":
            parallelize_module(layer, mesh, {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
                                             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
                                             "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                             "mlp.down_proj": RowwiseParallel()})
        else:
            fully_shard(layer, mesh=mesh)
    if layout == "dp2":
        fully_shard(model, mesh=mesh)
    local = model.model.layers[0].self_attn.q_proj.weight.to_local().shape
    assert materialize_meta_module(model, "cpu", seed=9, recorded=recorded)
    full = {name: (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()
            for name, t in _values(model).items()}
    if rank == 0:
        results[layout] = (tuple(local), full)


@pytest.mark.slow
def test_meta_init_under_fsdp_and_tensor_parallelism_gives_the_single_device_weights() -> None:
    reference = hugging_face_llama({})
    init_weights(reference, seed=9)
    for layout in ("dp2", "tp2"):
        local_shape, full = on_two_ranks(_sharded_meta_init, layout)[layout]
        assert local_shape == (16, 32)  # each rank materialized half of q_proj
        for name, tensor in _values(reference).items():
            torch.testing.assert_close(full[name], tensor, rtol=0, atol=0, msg=f"{layout} {name}")
