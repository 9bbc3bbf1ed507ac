"""Stage splitting: tracing a step, balancing blocks by cost, placing modules outside the blocks, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.pipeline.dispatch import ActiveStage, UnitDispatcher, make_shadows
from lightning_hybrid.pipeline.semantics import muted_logs
from lightning_hybrid.pipeline.split import balanced_split, check_block_runs, plan_split
from lightning_hybrid.probe.shapes import TensorSpec, describe_call
from lightning_hybrid.probe.record import AFTER, BEFORE, TRUNK, record_step
from tests.models import build_module


def _trace(module: nn.Module):
    path, blocks = find_block_list(module)
    inputs = torch.randint(0, 64, (2, 16))
    with muted_logs(module):
        trace = record_step(module, blocks, lambda: module.training_step((inputs, inputs), 0))
    return path, blocks, trace


@pytest.mark.parametrize(
    ("costs", "stages", "first", "last", "expected"),
    [
        ([1, 1, 1, 1], 2, 0.0, 0.0, [2, 2]),
        ([1, 1, 1, 1], 2, 0.0, 1.5, [3, 1]),  # the head's cost moves a block to the first stage
        ([1, 1, 1, 1], 2, 1.5, 0.0, [1, 3]),
        ([4, 1, 1, 1, 1], 2, 0.0, 0.0, [1, 4]),
        ([1, 1, 1, 1, 1, 1, 1, 1], 4, 0.0, 0.0, [2, 2, 2, 2]),
        ([1, 1, 1], 3, 10.0, 10.0, [1, 1, 1]),  # every stage keeps at least one block
        ([1, 1, 1, 1, 1], 2, 0.0, 0.0, [3, 2]),  # ties keep more blocks early
    ],
)
def test_balanced_split(costs, stages, first, last, expected):
    assert balanced_split(costs, stages, first, last) == expected


def test_trace_places_embeddings_first_and_head_last_and_counts_block_flops():
    module = build_module("llama", config={"n_layers": 4})
    _, blocks, trace = _trace(module)
    assert trace.outer_calls == {
        "model.tok_embeddings": {BEFORE},
        "model.norm": {AFTER},
        "model.output": {AFTER},
    }
    assert trace.parameter_reads == {
        "model.tok_embeddings.weight": {BEFORE}, "model.norm.weight": {AFTER}, "model.output.weight": {AFTER}
    }
    # What the stand-ins answer with: each unit's output for the traced inputs' shapes.
    block_call = describe_call((torch.empty(2, 16, 32), torch.empty(16, 4, 2)), {})
    assert trace.outputs.predict("model.layers.0", block_call) == TensorSpec((2, 16, 32), torch.float32)
    assert trace.outputs.predict("model.output", describe_call((torch.empty(2, 16, 32),), {})) == TensorSpec(
        (2, 16, 64), torch.float32)
    # Other lengths and batch sizes: a block's output follows its hidden-state input.
    shorter = describe_call((torch.empty(3, 9, 32), torch.empty(9, 4, 2)), {})
    assert trace.outputs.predict("model.layers.0", shorter) == TensorSpec((3, 9, 32), torch.float32)
    # One block's forward FLOPs, counted by hand (2 FLOPs per multiply-add): q, k, v, o projections and the SwiGLU
    # MLP. Attention itself adds nothing here: torch's FLOP counter has no formula for the CPU flash-attention
    # kernel that scaled_dot_product_attention picks on this machine.
    tokens, dim, kv_dim, ffn = 2 * 16, 32, 16, 64
    projections = 2 * tokens * (dim * dim + 2 * dim * kv_dim + dim * dim)
    mlp = 2 * tokens * 3 * dim * ffn
    assert trace.block_flops == [projections + mlp] * 4
    assert trace.flops_before == 0  # an embedding lookup multiplies nothing
    assert trace.flops_after == 2 * tokens * dim * 64  # the output projection to the 64-token vocabulary


def test_plan_split_assigns_every_unit_once():
    module = build_module("gpt", config={"num_layers": 4})
    path, blocks, trace = _trace(module)
    split = plan_split(module, path, blocks, trace, num_stages=2)
    assert split.blocks_per_stage == [2, 2]
    stages = {unit.name: unit.stage for unit in split.units}
    assert stages == {
        "model.blocks.0": 0, "model.blocks.1": 0, "model.blocks.2": 1, "model.blocks.3": 1,
        "model.tok_emb": 0, "model.pos_emb": 0, "model.ln_f": 1, "model.head": 1,
    }
    owned = {name for name, _ in module.named_parameters()}
    covered = {f"{unit.name}.{n}" for unit in split.units for n, _ in module.get_submodule(unit.name).named_parameters()}
    assert covered == owned


def test_explicit_split_overrides_and_is_checked():
    module = build_module("gpt", config={"num_layers": 4})
    path, blocks, trace = _trace(module)
    assert plan_split(module, path, blocks, trace, 2, blocks_per_stage=[3, 1]).blocks_per_stage == [3, 1]
    for bad in ([2, 1], [4, 0], [1, 1, 2]):
        with pytest.raises(ValueError, match=r"pp_split=.*each at least 1, adding up to the 4 blocks"):
            plan_split(module, path, blocks, trace, 2, blocks_per_stage=bad)


def test_more_stages_than_blocks_is_refused():
    module = build_module("gpt")  # 2 blocks
    path, blocks, trace = _trace(module)
    with pytest.raises(ValueError, match=r"4 pipeline stages .* need at least 4 blocks, but 'model.blocks' has 2"):
        plan_split(module, path, blocks, trace, num_stages=4)


def test_a_weight_tied_across_the_trunk_lives_on_both_stages():
    module = build_module("gpt", config={"num_layers": 4})
    module.model.head.weight = module.model.tok_emb.weight  # GPT-2 style tying
    path, blocks, trace = _trace(module)
    split = plan_split(module, path, blocks, trace, num_stages=3)
    units = {unit.name: unit for unit in split.units}
    # Both modules are held where the shared weight is read; each computes only where the step calls it.
    assert (units["model.tok_emb"].stages, units["model.tok_emb"].computes_on) == ((0, 2), (0,))
    assert (units["model.head"].stages, units["model.head"].computes_on) == ((0, 2), (2,))
    assert split.parameter_stages["model.tok_emb.weight"] == split.parameter_stages["model.head.weight"] == (0, 2)
    assert split.parameter_stages["model.pos_emb.weight"] == (0,) and split.direct == {}


def test_parameters_held_next_to_the_blocks_live_where_they_are_read():
    module = build_module("gpt", config={"num_layers": 4})
    module.model.scale = nn.Parameter(torch.ones(()))
    module.model.unused = nn.Parameter(torch.ones(()))
    forward = module.model.forward
    module.model.forward = lambda idx: forward(idx) * module.model.scale  # read after the blocks
    path, blocks, trace = _trace(module)
    split = plan_split(module, path, blocks, trace, num_stages=2)
    assert split.direct == {"model.scale": (1,), "model.unused": (0,)}


def test_a_module_called_between_blocks_lives_on_every_stage():
    module = build_module("gpt", config={"num_layers": 4})
    blocks, norm = module.model.blocks, module.model.ln_f
    module.model.forward = lambda idx: module.model.head(norm(
        blocks[3](blocks[2](norm(blocks[1](blocks[0](module.model.tok_emb(idx))))))))
    path, _, trace = _trace(module)
    assert trace.outer_calls["model.ln_f"] == {TRUNK, AFTER}
    units = {unit.name: unit for unit in plan_split(module, path, find_block_list(module)[1], trace, 2).units}
    assert units["model.ln_f"].stages == units["model.ln_f"].computes_on == (0, 1)


def test_block_called_twice_is_refused():
    module = build_module("gpt", config={"num_layers": 2})
    inner = module.model.forward

    def twice(idx):  # ALBERT-style weight sharing: the trunk runs twice
        module.model.blocks[0](module.model.tok_emb(idx))
        return inner(idx)

    module.model.forward = twice
    _, _, trace = _trace(module)
    with pytest.raises(ValueError, match=r"each block must run exactly once per step.*\{0: 2\}"):
        check_block_runs(trace.block_runs)


def test_stand_ins_answer_from_the_trace_when_a_block_is_handed_an_object():
    # Hugging Face decoders hand every block a key/value cache, even in training. A stand-in for a block answers from
    # the setup trace, and for a call the trace does not derive from its meta-device copy: Mixtral's experts kernel,
    # grouped_mm, has a meta kernel that accepts bf16 only, run on bf16 copies (probe/meta_step.py).
    module = build_module("hf_mixtral")
    path, blocks, trace = _trace(module)
    split = plan_split(module, path, blocks, trace, num_stages=2)
    dispatcher = UnitDispatcher(split, make_shadows(module, split), trace.outputs, torch.device("cpu"), None)
    args, kwargs = trace.block_calls[0]
    assert type(kwargs["cache"]).__name__ == "DynamicCache"
    index = [unit.name for unit in split.units].index(blocks.name(0))
    dispatcher.active = ActiveStage(1, split.block_range(1), is_first=False, is_last=True, received=())
    stand_in = dispatcher.call(index, None, args, kwargs)  # stage 1 running: block 0 stands in
    assert stand_in.shape == (2, 16, 32) and not stand_in.any()
    other = dispatcher.call(index, None, (args[0][:1],), {**kwargs, "attention_mask": None})
    assert other.shape == (1, 16, 32) and other.dtype == torch.float32 and not other.any()


def test_a_block_module_called_from_outside_is_held_where_it_is_called_and_its_weights_shared() -> None:
    from tests.probe.test_record import OutsideCall

    model = OutsideCall()
    path, blocks = find_block_list(model)
    record = record_step(model, blocks, lambda: model(torch.randn(2, 8)))
    split = plan_split(model, path, blocks, record, 2, [2, 1])
    assert split.held_inside == {"blocks.0.up": (1,)}  # blocks.1.down is called before the trunk, on its own stage 0
    assert split.parameter_stages["blocks.0.up.weight"] == (0, 1) and "blocks.1.down.weight" not in split.parameter_stages
