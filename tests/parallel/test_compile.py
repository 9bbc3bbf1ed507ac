"""``HybridStrategy(compile=True)``: blocks compiled in place, torch's own block classes compiled too, blocks the
module compiled itself left alone, and compiled training under dp2, tp2, pp2 (1F1B and a zero-bubble schedule)
and dp2×tp2×pp2 equal to single-process Lightning, compiled or not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.parallel.compile import compile_blocks
from lightning_hybrid.parallel.parallelize import check_compile_layout, find_blocks
from tests.conftest import ReferenceFn
from tests.helpers import assert_equivalent, param_extended_if, run_script, run_sweep
from tests.models import GPTConfig, TinyGPT

#: Dynamo alone (no inductor): what is compiled, and how often, without seconds of code generation per test.
EAGER_BACKEND = {"backend": "eager"}


@pytest.mark.parametrize(("value", "arguments"), [(False, None), (True, {}), ({"mode": "max-autotune"},
                                                                             {"mode": "max-autotune"})])
def test_compile_option(value: object, arguments: dict | None) -> None:
    assert HybridOptions(compile=value).compile_arguments == arguments
    assert HybridStrategy(compile=value).options.compile_arguments == arguments


@pytest.mark.parametrize(("value", "message"), [
    ("yes", r"compile='yes'\) is invalid: pass True \(torch.compile every block\), False, or a dict of torch.compile"
            r" keyword arguments \(backend, disable, dynamic, fullgraph, .*mode, .*options"),
    (1, r"compile=1\) is invalid: pass True"),
    ({"mode": "default", "modes": "x"}, r"compile=\{'mode': 'default', 'modes': 'x'\}\): modes are not torch.compile"
                                        r" arguments; the dict takes backend, disable"),
])
def test_bad_compile_values_are_refused(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridStrategy(compile=value)  # type: ignore[arg-type]


def test_compiling_needs_a_block_list() -> None:
    with pytest.raises(ValueError, match="block"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), HybridOptions(compile=True))


def test_checkpointing_over_data_and_tensor_sharded_parameters_is_refused_when_compiling() -> None:
    options = HybridOptions(tp=2, compile=True, activation_checkpointing="every")
    with pytest.raises(ValueError, match=r"activation_checkpointing=...\) with tp > 1 and FSDP2 .* cannot be compiled"):
        check_compile_layout(options, tp=2, sharded=True)
    check_compile_layout(options, tp=2, sharded=False)  # tp2 alone and dp2 alone compile (the slow test trains both)
    check_compile_layout(options, tp=1, sharded=True)


def _frames_compiled(model: nn.Module, x: torch.Tensor) -> int:
    """Frames Dynamo compiled for a forward and backward of ``model`` (fresh caches)."""
    torch._dynamo.reset()
    counters.clear()
    model(x).sum().backward()
    return counters["frames"]["ok"]


def test_blocks_are_compiled_in_place_and_train_the_same() -> None:
    torch.manual_seed(0)
    eager = TinyGPT(GPTConfig())
    compiled = TinyGPT(GPTConfig())
    compiled.load_state_dict(eager.state_dict())
    classes = [type(block) for block in compiled.blocks]
    assert compile_blocks(compiled, "blocks", list(compiled.blocks), EAGER_BACKEND) == (2, 0)
    # the same objects, classes and names: FSDP2, state dicts and zero-bubble schedules see eager blocks
    assert [type(block) for block in compiled.blocks] == classes
    assert compiled.state_dict().keys() == eager.state_dict().keys()
    x = torch.randint(0, 64, (2, 16))
    assert _frames_compiled(compiled, x) == 1  # one graph for both blocks of the class
    eager(x).sum().backward()
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=0, msg=name)  # backend "eager": same kernels


@pytest.mark.parametrize("make_block", [lambda: nn.Linear(8, 8),
                                        lambda: nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)])
def test_blocks_whose_forward_is_torchs_own_are_compiled_too(make_block) -> None:
    torch.manual_seed(0)
    blocks = nn.ModuleList(make_block() for _ in range(2))
    x = torch.randn(2, 3, 8, requires_grad=True)  # as a block input inside a model: one graph serves both
    expected = blocks[1](blocks[0](x))
    plain = make_block()
    plain.compile(**EAGER_BACKEND)
    assert _frames_compiled(plain, x) == 0  # what in-place compilation alone does: Dynamo skips torch's files
    assert compile_blocks(blocks, "", list(blocks), EAGER_BACKEND) == (2, 0)
    assert _frames_compiled(nn.Sequential(*blocks), x) == 1
    torch.testing.assert_close(blocks[1](blocks[0](x)), expected)
    assert isinstance(blocks[0], type(plain))  # a subclass: isinstance checks and state dict keys unchanged


def test_blocks_the_module_compiled_itself_are_left_as_they_are() -> None:
    model = TinyGPT(GPTConfig(num_layers=4))
    model.blocks[0].compile(backend="aot_eager")
    model.blocks[1] = torch.compile(model.blocks[1], backend="aot_eager")
    model.blocks[2].mlp.compile(backend="aot_eager")
    users = model.blocks[0]._compiled_call_impl
    assert compile_blocks(model, "blocks", list(model.blocks), EAGER_BACKEND) == (1, 3)
    assert model.blocks[0]._compiled_call_impl is users
    assert model.blocks[2]._compiled_call_impl is None and model.blocks[3]._compiled_call_impl is not None
    # a compiled model around the blocks: none is compiled again
    whole = TinyGPT(GPTConfig())
    whole.compile(backend="aot_eager")
    assert compile_blocks(whole, "blocks", list(whole.blocks), EAGER_BACKEND) == (0, 2)
    assert all(block._compiled_call_impl is None for block in whole.blocks)


# ------------------------------------------------------------------------------------ multi-rank equivalence
LAYERS = 4  # four stages for the zero-bubble schedule (two per pipeline rank)
#: One launch per data-parallel size: dp2 alone; tp2, pp2 and a zero-bubble pp2 (the reference's data order is
#: that of one data-parallel rank); dp2×tp2×pp2.
LAUNCHES = {
    "dp1": (["--devices", 2], [
        {"tp": 2, "activation_checkpointing": "selective"},
        {"tp": 2, "module": {"compile_blocks": True}},  # the module compiles its blocks itself
        {"pp": 2},
        {"pp": 2, "pp_schedule": "zbv_zero_bubble", "activation_checkpointing": "every", "module": {"init": "meta"}},
    ]),
    "dp2": (["--dp", 2, "--devices", 2], [{"activation_checkpointing": "every"}]),
    # Dynamo and AOTAutograd trace the blocks' DTensor, FSDP2 and pipeline-stage calls here; inductor's code
    # generation, which the layout does not change (dp1 runs it under tp2 and pp2), would cost 8 ranks on 2 cores
    # about 80 s of C++ compilation.
    "dp2_tp2_pp2": (["--dp", 2, "--tp", 2, "--pp", 2, "--devices", 8],
                    [{"pp_schedule": "interleaved_1f1b", "compile": {"backend": "aot_eager"}}]),
}
#: 8 ranks on 2 cores (48 s); the layouts it combines are compiled in the default suite (dp1's tp2 and pp2, dp2).
EXTENDED = {"dp2_tp2_pp2"}


@pytest.mark.slow
@pytest.mark.parametrize("launch", [param_extended_if(launch in EXTENDED, launch) for launch in LAUNCHES])
def test_compiled_training_equals_single_device(launch: str, reference_run: ReferenceFn, tmp_path: Path) -> None:
    """Compiled fp32 differs from eager fp32 by rounding only: inductor fuses elementwise ops and reorders a few
    reductions. Measured against the eager reference, the worst parameter after six steps differs by 7e-7 and the
    losses by 2e-7, as much as any parallel layout does eagerly, so the suite's rtol=1e-5 holds unchanged."""
    arguments, entries = LAUNCHES[launch]
    dp_size = 2 if "--dp" in arguments else 1
    results = run_sweep(["--model", "gpt", "--layers", LAYERS, *arguments, "--out", tmp_path / "run.pt"],
                        [{"compile": True, **entry} for entry in entries])
    for entry, result in zip(entries, results):
        init = entry.get("module", {}).get("init", "eager")
        assert_equivalent(reference_run("gpt", dp_size, LAYERS, "per_module" if init == "meta" else init), result)
        assert min(result["rank_compiled_frames"]) >= 1, entry  # every rank really ran compiled blocks
    if launch == "dp1":
        compiled_reference = run_script(["--model", "gpt", "--layers", LAYERS, "--reference", "--module-kwargs",
                                         '{"compile_blocks": true}', "--out", tmp_path / "reference.pt"])
        assert compiled_reference["rank_compiled_frames"] == [1]
        for result in results[:3]:
            assert_equivalent(compiled_reference, result)
