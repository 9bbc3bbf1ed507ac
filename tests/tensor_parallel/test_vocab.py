"""The token embedding and head sharded over the vocabulary (:mod:`lightning_hybrid.tensor_parallel.vocab`): which
modules are found, from structure and one traced forward, what stays whole and why, and (on two ranks) that a
tied Hugging Face pair keeps one sharded weight and computes what the whole model does. Training equivalence under
tp2 and tp2 × pp2, with the local shapes checked, is in ``tests/test_zoo.py``."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.probe.record import record_step
from lightning_hybrid.tensor_parallel.vocab import VocabLayers, find_vocab_layers
from tests.helpers import on_two_ranks
from tests.models import build_module


def _found(module: nn.Module, tp: int = 2, tp_plan: dict | None = None) -> VocabLayers:
    _, blocks = find_block_list(module)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    return find_vocab_layers(module, blocks, record_step(module, blocks, lambda: module(tokens)), tp, tp_plan or {})


@pytest.mark.parametrize(("name", "embedding", "head", "tied"), [
    ("gpt", "model.tok_emb", "model.head", False),  # the position embedding runs before the blocks too
    ("tied", "model.embed", "model.head", True),
    ("hf_gpt2", "model.transformer.wte", "model.lm_head", True),
    ("hf_bert", "model.bert.embeddings.word_embeddings", "model.cls.predictions.decoder", True),
    ("gpt_seq64", "model.tok_emb", "model.head", False),  # the position table has the vocabulary's 64 rows too
])
def test_the_embedding_and_head_are_found_by_structure(name: str, embedding: str, head: str, tied: bool) -> None:
    module = build_module("gpt", config={"seq_len": 64}) if name == "gpt_seq64" else build_module(name)
    assert _found(module) == VocabLayers(embedding, head, tied, "")


class _HandTiedLM(nn.Module):
    """The head computed by hand from the embedding's weight: a sharded weight would meet plain activations."""

    def __init__(self, vocab: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.linear(x, self.embed.weight)


def test_what_cannot_be_sharded_stays_whole_with_the_reason() -> None:
    found = _found(_HandTiedLM())
    assert found.embedding is None and found.head is None
    assert "no head of the vocabulary's width" in found.reason and "embeddings none" in found.reason
    uneven = _found(build_module("llama"), tp=3)
    assert (uneven.embedding, uneven.head) == (None, None)
    assert uneven.reason == "tp=3 does not divide the vocabulary of 'model.tok_embeddings' (64)"
    # The user's tp_plan entry wins; two embeddings then remain and none is taken for the vocabulary.
    user = _found(build_module("gpt"), tp_plan={"model.head": "replicate"})
    assert (user.embedding, user.head) == (None, None) and "model.tok_emb" in user.reason


class _ScaledEmbedding(nn.Embedding):
    """Gemma's word embedding: the lookup times sqrt(width), in a forward of its own."""

    def forward(self, tokens: Tensor) -> Tensor:
        return super().forward(tokens) * self.embedding_dim ** 0.5


class _ScaledEmbeddingLM(_HandTiedLM):
    def __init__(self) -> None:
        super().__init__()
        self.embed = _ScaledEmbedding(64, 16)
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_an_embedding_with_a_forward_of_its_own_stays_whole_and_is_named() -> None:
    found = _found(_ScaledEmbeddingLM())
    assert (found.embedding, found.head) == (None, None)
    assert found.reason.endswith("; not considered: 'embed' (_ScaledEmbedding), an nn.Embedding subclass with a"
                                 " forward of its own, which the vocabulary-sharded lookup is not proven for")


def test_shard_vocab_must_be_a_bool() -> None:
    assert HybridOptions(tp=2).shard_vocab is True
    with pytest.raises(ValueError, match=r"shard_vocab='no'\) is invalid: pass True"):
        HybridOptions(tp=2, shard_vocab="no")  # type: ignore[arg-type]


def _tied_gpt2_sharded(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.tensor_parallel.vocab import shard_vocab_layers

    module = build_module("hf_gpt2")
    reference = copy.deepcopy(module)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    applied = shard_vocab_layers(module, _found(module), mesh)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    logits, expected = module(tokens), reference(tokens)
    F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    F.cross_entropy(expected.flatten(0, 1), tokens.flatten()).backward()
    gpt2, whole = module.model, reference.model
    weight, expected_grad = gpt2.transformer.wte.weight, whole.transformer.wte.weight.grad
    grad = weight.grad.full_tensor()  # collective: every rank
    if rank == 0:
        results.update(
            applied=applied, same_weight=gpt2.lm_head.weight is weight, local=tuple(weight.to_local().shape),
            plain_logits=type(logits) is Tensor,
            logits=float((logits - expected).abs().max() / expected.abs().max()),
            grad=float((grad - expected_grad).abs().max() / expected_grad.abs().max()))


@pytest.mark.slow
def test_a_tied_pair_keeps_one_sharded_weight_and_computes_the_same() -> None:
    results = on_two_ranks(_tied_gpt2_sharded)
    assert results["applied"] == {"model.lm_head": "colwise (vocab, logits gathered) tied",
                                  "model.transformer.wte": "rowwise (vocab) tied"}
    assert results["same_weight"] and results["local"] == (32, 32) and results["plain_logits"]
    assert results["logits"] < 1e-6 and results["grad"] < 1e-5


class _SharedLookupsLM(nn.Module):
    """T5's layout: encoder and decoder each look tokens up with their own module holding the one table of
    ``shared`` (which the step never calls), and the head is tied to it too."""

    def __init__(self) -> None:
        super().__init__()
        self.shared, self.encoder_embed, self.decoder_embed = (nn.Embedding(64, 16) for _ in range(3))
        self.encoder_embed.weight = self.decoder_embed.weight = self.shared.weight
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)
        self.head.weight = self.shared.weight

    def forward(self, tokens: Tensor) -> Tensor:
        memory = self.blocks[0](self.encoder_embed(tokens))
        return self.head(self.blocks[1](self.decoder_embed(tokens.roll(1, dims=1)) + memory))


def _shared_lookups_sharded(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_hybrid.tensor_parallel.vocab import shard_vocab_layers

    torch.manual_seed(0)
    module = _SharedLookupsLM()
    reference = copy.deepcopy(module)
    applied = shard_vocab_layers(module, _found(module), init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)))
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    logits, expected = module(tokens), reference(tokens)
    logits.square().sum().backward()
    expected.square().sum().backward()
    grad = module.shared.weight.grad.full_tensor()
    if rank == 0:
        results.update(applied=applied, logits=float((logits - expected).abs().max() / expected.abs().max()),
                       one_weight=len({id(m.weight) for m in (module.shared, module.encoder_embed,
                                                             module.decoder_embed, module.head)}),
                       grad=float((grad - reference.shared.weight.grad).abs().max()
                                  / reference.shared.weight.grad.abs().max()))


@pytest.mark.slow
def test_every_lookup_module_holding_the_sharded_table_looks_up_its_rows() -> None:
    results = on_two_ranks(_shared_lookups_sharded)
    assert results["applied"] == {"head": "colwise (vocab, logits gathered) tied",
                                  "encoder_embed": "rowwise (vocab) tied", "shared": "rowwise (vocab) tied",
                                  "decoder_embed": "rowwise (vocab) tied"}
    assert results["one_weight"] == 1 and results["logits"] < 1e-6 and results["grad"] < 1e-5
