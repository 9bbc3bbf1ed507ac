"""Context parallelism's collectives on two ranks: the exchanged attention computes, on each rank's part of the
sequence, the rows of attention over the whole sequence (causal, grouped-query heads repeated when they do not
divide over the ranks, a per-head mask cut to each rank's heads), with the whole sequence's gradients; the split and
gather around a block scale gradients so that their mean over the ranks is the whole sequence's gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_hybrid.context_parallel.attention import ExchangedAttention
from lightning_hybrid.context_parallel.exchange import ContextGroup, gather_sequence, split_sequence
from tests.helpers import on_two_ranks, relative_difference

BATCH, HEADS, LENGTH, DIM = 2, 4, 8, 6


def _group(rank: int) -> ContextGroup:
    return ContextGroup(dist.group.WORLD, rank, 2)


def _attention(rank: int, results: dict, kv_heads: int, masked: bool) -> None:
    torch.manual_seed(0)  # both ranks draw the same whole sequence
    query = torch.randn(BATCH, HEADS, LENGTH, DIM)
    key, value = torch.randn(2, BATCH, kv_heads, LENGTH, DIM)
    weight = torch.randn(BATCH, HEADS, LENGTH, DIM)
    mask = torch.randn(BATCH, HEADS, LENGTH, LENGTH) if masked else None
    options = {"attn_mask": mask} if masked else {"is_causal": True}
    whole = [t.clone().requires_grad_() for t in (query, key, value)]
    expected = F.scaled_dot_product_attention(*whole, enable_gqa=kv_heads != HEADS, **options)
    (expected * weight).sum().backward()
    rows = slice(rank * LENGTH // 2, (rank + 1) * LENGTH // 2)
    local = [t[:, :, rows].clone().requires_grad_() for t in (query, key, value)]
    group = _group(rank)
    output = ExchangedAttention(group).sdpa(*local, enable_gqa=kv_heads != HEADS, **options)
    (output * weight[:, :, rows]).sum().backward()  # the ranks' losses add up to the whole one
    # Relative to each tensor's largest entry: a key's gradient sums over the query heads it serves (up to ~10 here),
    # where fp32 rounding of another summation order alone reaches 1e-6 absolute.
    results[rank] = {
        "output": relative_difference(output, expected[:, :, rows]),
        "gradients": max(relative_difference(part.grad, full.grad[:, :, rows]) for part, full in zip(local, whole)),
        "bytes": group.bytes_sent["all_to_all"],
    }


@pytest.mark.parametrize(("kv_heads", "masked"), [(4, False), (2, False), (1, False), (4, True)],
                         ids=["heads-causal", "gqa-divides", "gqa-repeated", "per-head-mask"])
def test_exchanged_attention_gives_each_rank_its_rows_of_whole_sequence_attention(kv_heads: int, masked: bool) -> None:
    results = on_two_ranks(_attention, kv_heads, masked)
    for rank in (0, 1):
        assert results[rank]["output"] < 1e-6 and results[rank]["gradients"] < 1e-6, results[rank]
    # Forward: q, k, v and the output, each (2, 4 heads, 4 positions, 6) floats here, half of it to the other rank;
    # keys and values repeated to the 4 query heads when 1 head cannot be dealt to 2 ranks.
    sent_heads = HEADS + 2 * (kv_heads if kv_heads % 2 == 0 else HEADS) + HEADS
    assert results[0]["bytes"] == sent_heads * BATCH * (LENGTH // 2) * DIM * 4 // 2


def _split_and_gather(rank: int, results: dict) -> None:
    torch.manual_seed(0)
    whole, weight = torch.randn(BATCH, LENGTH, DIM, requires_grad=True), torch.randn(BATCH, LENGTH, DIM)
    group = _group(rank)
    local = split_sequence(whole, 1, group)
    gathered = gather_sequence(3 * local, 1, group)
    (gathered * weight).sum().backward()  # every rank the same loss of the same gathered tensor
    results[rank] = {"local": local.shape, "gathered": torch.equal(gathered, 3 * whole.detach()),
                     "gradient": (whole.grad - 3 * weight).abs().max().item(),
                     "bytes": group.bytes_sent["all_gather"]}


def test_split_and_gather_give_the_whole_sequence_and_its_gradient_on_every_rank() -> None:
    results = on_two_ranks(_split_and_gather)
    for rank in (0, 1):
        assert results[rank]["local"] == (BATCH, LENGTH // 2, DIM) and results[rank]["gathered"]
        assert results[rank]["gradient"] < 1e-6
        assert results[rank]["bytes"] == BATCH * (LENGTH // 2) * DIM * 4  # its part, to the one other rank


def test_a_sequence_split_into_unequal_parts_is_refused_naming_the_fix() -> None:
    group = ContextGroup(None, 0, 4)
    with pytest.raises(ValueError, match=r"got a sequence of 10 positions. Pad the sequences to a multiple of 4"):
        split_sequence(torch.zeros(1, 10, 2), 1, group)


def _installed_block(rank: int, results: dict) -> None:
    import copy
    import warnings

    from torch import nn

    from lightning_hybrid.context_parallel.apply import install_context_parallel, plan_context_parallel
    from lightning_hybrid.probe.blocks import BlockList
    from tests.context_parallel.test_plan import _Block, _custom_call

    torch.manual_seed(0)
    block = _Block(positional=True)  # the mask, dropout and causality passed by position
    reference = copy.deepcopy(block)
    blocks = BlockList("layers", nn.ModuleList([block]))
    install_context_parallel(plan_context_parallel(blocks, {0: _custom_call()}, 2), blocks, [0], _group(rank))
    found = {}
    for length in (12, 13):  # 13 positions do not split into 2 equal parts
        torch.manual_seed(length)
        hidden, angles = torch.randn(2, length, 16), torch.randn(length, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            difference = (block(hidden, angles) - reference(hidden, angles)).abs().max().item()
        found[length] = (difference, [str(warning.message) for warning in caught])
    results[rank] = found


def test_an_installed_block_equals_the_whole_block_and_runs_whole_a_length_it_cannot_split() -> None:
    results = on_two_ranks(_installed_block)
    for rank in (0, 1):
        (split, none), (whole, warned) = results[rank][12], results[rank][13]
        assert split < 1e-5 and whole < 1e-6 and not none
        assert warned == ["HybridStrategy(cp=2): 'layers.0' ran whole on every cp rank: a sequence of 13 positions"
                          " does not split into 2 equal parts (pad sequences to a multiple of 2). The numbers are"
                          " right; the memory is not divided."]
