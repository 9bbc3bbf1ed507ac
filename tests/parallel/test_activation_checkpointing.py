"""Activation checkpointing per block: modes, what is recomputed, and equivalence with single-process Lightning
under tensor, data and pipeline parallelism (the pp=2 schedule sweep of ``test_pipeline.py`` runs the GPT with
checkpointing too)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.recompute import CheckpointPlan
from lightning_hybrid.parallel.activation_checkpointing import apply_activation_checkpointing
from tests.conftest import META_INIT_LAYERS, ReferenceFn
from tests.equivalence import ACCUMULATE_GRAD_BATCHES
from tests.helpers import SHORT_STEPS
from tests.models import GPTConfig, TinyGPT, build_module

#: Micro-batches of the meta-init runs (the short run): its optimizer steps × equivalence.py's accumulation.
ACCUMULATED_MICROBATCHES = SHORT_STEPS * ACCUMULATE_GRAD_BATCHES


@pytest.mark.parametrize(
    ("mode", "plan"),
    [(None, None), ("none", None), ("every", CheckpointPlan(1)), (1, CheckpointPlan(1)), (3, CheckpointPlan(3)),
     ("selective", CheckpointPlan(1, selective=True))],
)
def test_modes(mode: object, plan: CheckpointPlan | None) -> None:
    assert CheckpointPlan.resolve(mode) == plan
    assert HybridStrategy(activation_checkpointing=mode).checkpoint_plan == plan


def test_every_nth_counts_blocks_over_the_whole_model() -> None:
    assert [i for i in range(8) if CheckpointPlan(3).covers(i)] == [2, 5]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        (0, r"activation_checkpointing=0\) is invalid: an integer N checkpoints every N-th block and must be ≥ 1"),
        (-2, r"must be ≥ 1"),
        ("full", r"activation_checkpointing='full'\) is not a mode: use None .* 'every' .* 'selective'"),
        (True, r"activation_checkpointing=True\) is not a mode"),
    ],
)
def test_bad_modes_are_refused(mode: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridStrategy(activation_checkpointing=mode)


def _train_step_costs(mode: object) -> tuple[dict[str, torch.Tensor], int, int, int]:
    """Gradients, forward calls of the blocks' linears, bytes autograd saved outside checkpointed regions, and
    backward FLOPs, for one step of a 4-block GPT."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(num_layers=4))
    plan = CheckpointPlan.resolve(mode)
    if plan is not None:
        apply_activation_checkpointing(enumerate(model.blocks), plan)
    calls = [0]
    for block in model.blocks:
        for layer in block.modules():
            if isinstance(layer, nn.Linear):
                layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    saved = [0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved[0] += tensor.numel() * tensor.element_size()
        return tensor

    idx = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(idx).logsumexp(-1).mean()
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return grads, calls[0], saved[0], flops.get_total_flops()


def test_recomputation_changes_cost_not_numbers() -> None:
    grads, calls, saved, backward_flops = _train_step_costs(None)
    linears = 4 * 4  # 4 blocks of qkv, proj, fc_in, fc_out
    assert calls == linears
    for mode, recomputed_blocks in (("every", 4), (2, 2), ("selective", 4)):
        mode_grads, mode_calls, mode_saved, mode_flops = _train_step_costs(mode)
        for name, grad in grads.items():
            torch.testing.assert_close(mode_grads[name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")
        assert mode_calls == linears + 4 * recomputed_blocks, mode  # the blocks' layers run again in backward
        assert mode_saved < saved, mode  # checkpointed blocks keep their insides out of autograd's saved tensors
        if mode == "selective":
            assert mode_flops == backward_flops  # matmuls and attention are kept: backward recomputes no FLOPs
        else:
            assert mode_flops > backward_flops, mode  # recomputing the blocks' matmuls


def test_checkpointed_blocks_keep_names_and_copy() -> None:
    model = TinyGPT(GPTConfig())
    names = [name for name, _ in model.named_parameters()]
    apply_activation_checkpointing(enumerate(model.blocks), CheckpointPlan(1))
    assert [name for name, _ in model.named_parameters()] == names
    assert type(model.blocks[0]).__name__ == "CheckpointedGPTBlock"
    clone = copy.deepcopy(model.blocks[0])
    assert type(clone) is type(model.blocks[0]) and clone.attn is not model.blocks[0].attn


@pytest.mark.slow
def test_tensor_and_data_parallel_training_recomputes_every_block(reference_run: ReferenceFn, meta_init_runs) -> None:
    """dp=2 × tp=2 with "every" and "selective": equal numbers (checked in test_initialization), and each rank's
    training ran every block's linears once more per micro-batch than the reference."""
    reference = reference_run("gpt", 2, META_INIT_LAYERS, "per_module", short=True)
    (reference_calls,) = reference["rank_linear_calls"]
    block_linears = sum(isinstance(m, nn.Linear) for m in TinyGPT(GPTConfig()).blocks[0].modules())
    for result in meta_init_runs("dp2_tp2"):
        recomputed = ACCUMULATED_MICROBATCHES * block_linears * META_INIT_LAYERS
        assert result["rank_linear_calls"] == [reference_calls + recomputed] * 4, result["sweep_entry"]


@pytest.mark.slow
def test_every_nth_block_counts_across_pipeline_stages(meta_init_runs) -> None:
    """Interleaved 1F1B puts blocks 0, 2 on pipeline rank 0 (ranks 0, 1) and blocks 1, 3 on pipeline rank 1
    (ranks 2, 3); checkpointing every 2nd block picks 1 and 3, so only pipeline rank 1 recomputes: its two blocks'
    linears once more per micro-batch (4 per step). Its head adds only one linear call per micro-batch besides."""
    result = meta_init_runs("tp2_pp2")[0]
    assert result["sweep_entry"] == {"pp_schedule": "interleaved_1f1b", "microbatches": 4, "activation_checkpointing": 2}
    calls = result["rank_linear_calls"]
    assert calls[0] == calls[1] and calls[2] == calls[3]
    block_linears = sum(isinstance(m, nn.Linear) for m in TinyGPT(GPTConfig()).blocks[0].modules())
    recomputed = ACCUMULATED_MICROBATCHES * 4 * 2 * block_linears
    assert recomputed <= calls[2] - calls[0] < recomputed + ACCUMULATED_MICROBATCHES * 4 * 2


def test_selective_checkpointing_is_refused_with_zero_bubble_schedules() -> None:
    with pytest.raises(ValueError, match=r"'selective' cannot run under pp_schedule='zbv_zero_bubble'.*allows one backward"):
        HybridStrategy(pp=2, pp_schedule="zbv_zero_bubble", activation_checkpointing="selective")
    with pytest.warns(UserWarning, match="recomputes a checkpointed block once per weight-gradient pass"):
        HybridStrategy(pp=2, pp_schedule="interleaved_zero_bubble", activation_checkpointing="every")


@pytest.mark.parametrize("use_cache", [True, False])
def test_a_block_updating_a_cache_it_is_handed_is_refused_before_training(use_cache: bool) -> None:
    """A Hugging Face decoder built with ``use_cache=True`` appends to its key/value cache in every block's forward:
    checkpointed, the recomputed forward would see the cache grown (it failed in the first backward with a shape
    error). Refused at setup with the fix; without the cache the blocks are checkpointed."""
    from lightning_hybrid.parallel.activation_checkpointing import refuse_updated_arguments
    from lightning_hybrid.probe.blocks import find_block_list
    from lightning_hybrid.probe.record import record_step

    module = build_module("hf_qwen2", config={"use_cache": use_cache})
    _, blocks = find_block_list(module)
    calls = record_step(module, blocks, lambda: module(torch.randint(0, 64, (2, 16)))).block_calls
    if not use_cache:
        refuse_updated_arguments(blocks, calls, range(len(blocks)), CheckpointPlan(1))
        return
    with pytest.raises(ValueError, match=r"'model\.model\.layers\.0' updates the argument 'cache' it is called with \(a"
                                         r" key/value cache\).*config\.use_cache = False\) or without"):
        refuse_updated_arguments(blocks, calls, range(len(blocks)), CheckpointPlan(1))
