"""``HybridStrategy(loss_parallel=True)`` (:mod:`lightning_hybrid.tensor_parallel.loss_parallel`): where it is refused and
what the message says, the step context (``self.log`` shadowed for the step only, re-entrant, DTensor errors
explained), and on two ranks that the loss computed from the sharded logits backpropagates into the shards as the
whole model's does and reaches ``self.log`` as a plain tensor. Training equivalence: dp2 × tp2 here (the first
dp2 × tp2 entry of ``conftest.META_INIT_LAYOUTS``, a launch shared with the initialization and checkpointing
tests), tp2 in ``tests/test_zoo.py`` (an ``hf_qwen2`` entry of the zoo's tp2 launch)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor

from lightning_hybrid import HybridStrategy
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.tensor_parallel.loss_parallel import require_sharded_head, sharded_logits
from lightning_hybrid.glue.model_parallel_compat import accept_user_parallelism
from lightning_hybrid.tensor_parallel.vocab import VocabLayers
from tests.conftest import META_INIT_LAYERS, ReferenceFn
from tests.helpers import assert_equivalent, on_two_ranks
from tests.models import build_module


@pytest.mark.parametrize(("options", "message"), [
    (dict(tp=2, loss_parallel="yes"), r"loss_parallel='yes'\) is invalid: pass True"),
    (dict(tp=1, loss_parallel=True), r"tp=1 shards nothing: pass tp=N \(N > 1\) or drop loss_parallel"),
    (dict(tp=2, shard_vocab=False, loss_parallel=True), r"head stays whole.*Pass shard_vocab=True or drop"),
    (dict(tp=2, pp=2, loss_parallel=True), r"pp=2\) is not supported: with a pipeline the loss is computed on the"
                                           r" last stage inside the pipeline schedule. Drop loss_parallel"),
    (dict(tp=2, pp="auto", loss_parallel=True), r"pp='auto'\) is not supported"),
])
def test_loss_parallel_is_refused_where_the_logits_cannot_be_sharded(options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HybridOptions(**options)


def test_loss_parallel_is_an_opt_in_of_the_strategy() -> None:
    assert HybridStrategy(tp=2).options.loss_parallel is False
    assert HybridStrategy(tp=2, loss_parallel=True).options.loss_parallel is True
    assert HybridOptions(tp="auto", loss_parallel=True).loss_parallel  # the chosen tp is checked at setup


def test_setup_stops_when_the_head_stays_whole() -> None:
    whole = VocabLayers("model.embed", None, False, "no head of the vocabulary's width after the blocks")
    with pytest.raises(ValueError, match=r"needs the language-model head sharded over the vocabulary, but it stays"
                                         r" whole \(no head of the vocabulary's width after the blocks\)\. Drop"):
        require_sharded_head(True, whole)
    with pytest.raises(ValueError, match=r"stays whole \(tp=1 shards nothing\)"):
        require_sharded_head(True, None)  # tp="auto" chose tp=1
    require_sharded_head(True, VocabLayers("model.embed", "model.head"))
    require_sharded_head(False, whole)
    with pytest.raises(ValueError, match=r"loss_parallel=\) are applied while the strategy shards the model.*"
                                         r"compute your loss inside torch's loss_parallel\(\)"):
        accept_user_parallelism(build_module("gpt"), HybridOptions(tp=2, loss_parallel=True), torch.device("cpu"))


class _Logged(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[str, object]] = []

    def log(self, name: str, value: object, *args: object, **kwargs: object) -> None:  # type: ignore[override]
        self.logged.append((name, value))


def test_the_step_context_shadows_log_for_the_step_only() -> None:
    module = _Logged()
    with sharded_logits(module, enabled=False) as convert:
        assert "log" not in vars(module) and convert(module) is module
    with sharded_logits(module, enabled=True):
        wrapper = module.log
        with sharded_logits(module, enabled=True):  # manual_backward inside training_step: the same context
            assert module.log is wrapper
        assert module.log is wrapper
        module.log("train_loss", torch.tensor(2.0))
    assert "log" not in vars(module) and module.logged == [("train_loss", torch.tensor(2.0))]
    own = module.log = lambda *args, **kwargs: None  # an instance attribute the module had is given back
    with sharded_logits(module, enabled=True):
        assert module.log is not own
    assert module.log is own


def test_dtensor_errors_in_the_step_say_the_logits_are_sharded() -> None:
    module = _Logged()
    mixed = "aten.eq.Tensor got mixed torch.Tensor and DTensor, need to convert all torch.Tensor to DTensor"
    with pytest.raises(RuntimeError, match=r"(?s)got mixed.*loss_parallel=True\) keeps the logits a DTensor"
                                           r" sharded over the vocabulary.*Pass loss_parallel=False") as raised:
        with sharded_logits(module, enabled=True):
            raise RuntimeError(mixed)
    assert str(raised.value.__cause__) == mixed
    with pytest.raises(RuntimeError, match=r"^unrelated$"):
        with sharded_logits(module, enabled=True):
            raise RuntimeError("unrelated")
    assert "log" not in vars(module)


def _step_on_sharded_logits(rank: int, results: dict) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from lightning_hybrid.tensor_parallel.vocab import find_vocab_layers, shard_vocab_layers
    from lightning_hybrid.probe.record import record_step

    module = build_module("gpt")
    reference = copy.deepcopy(module)
    tokens, targets = torch.randint(0, 64, (2, 2, 16), generator=torch.Generator().manual_seed(1))
    blocks = find_block_list(module)[1]
    vocab = find_vocab_layers(module, blocks, record_step(module, blocks, lambda: module(tokens)), 2, {})
    applied = shard_vocab_layers(module, vocab, init_device_mesh("cpu", (2,)), keep_logits_sharded=True)
    logged: list[tuple[str, object]] = []
    module.log = lambda name, value, *args, **kwargs: logged.append((name, value))  # Lightning's, recorded
    with sharded_logits(module, enabled=True) as plain:
        logits = module(tokens)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        module.log("train_loss", loss, sync_dist=True)
        module.log_dict({"val_loss": loss})
        returned = plain({"loss": loss})["loss"]
    with sharded_logits(module, enabled=True):
        returned.backward()
    expected = F.cross_entropy(reference(tokens).flatten(0, 1), targets.flatten())
    expected.backward()
    with pytest.raises(RuntimeError) as accuracy_error, sharded_logits(module, enabled=True):
        (module(tokens).argmax(-1) == targets).float().mean()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)  # collective: every rank
             for name, p in module.named_parameters()}
    if rank == 0:
        results.update(
            applied=applied, logits=(type(logits) is DTensor and logits.placements == (Shard(2),)),
            loss=abs(returned.item() - expected.item()) / expected.item(), returned_plain=type(returned) is Tensor,
            logged=[(name, type(value) is Tensor, float(value)) for name, value in logged],
            accuracy_error=str(accuracy_error.value), expected_loss=expected.item(),
            grads=max(float((grads[n] - p.grad).abs().max() / p.grad.abs().max())
                      for n, p in reference.named_parameters()))


@pytest.mark.slow
def test_the_loss_of_sharded_logits_backpropagates_and_is_logged_plain() -> None:
    results = on_two_ranks(_step_on_sharded_logits)
    assert results["applied"] == {"model.head": "colwise (vocab, logits sharded)", "model.tok_emb": "rowwise (vocab)"}
    assert results["logits"] and results["returned_plain"]
    assert results["loss"] < 1e-6 and results["grads"] < 1e-5
    loss = pytest.approx(results["expected_loss"], rel=1e-6)
    assert results["logged"] == [("train_loss", True, loss), ("val_loss", True, loss)]
    # argmax over the sharded vocabulary works (DTensor gathers it); comparing with plain targets does not.
    assert "got mixed torch.Tensor and DTensor" in results["accuracy_error"]
    assert "loss_parallel=True) keeps the logits a DTensor sharded over the vocabulary" in results["accuracy_error"]


@pytest.mark.slow
def test_loss_parallel_under_data_and_tensor_parallelism_trains_like_single_device(
        reference_run: ReferenceFn, meta_init_runs) -> None:
    result = next(run for run in meta_init_runs("dp2_tp2") if run["sweep_entry"].get("loss_parallel"))
    assert result["tp_plan"]["model.head"] == "colwise (vocab, logits sharded)"
    assert_equivalent(reference_run("gpt", 2, META_INIT_LAYERS, "per_module", short=True), result, rtol=1e-5)
