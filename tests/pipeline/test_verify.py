"""The pipeline's setup verification, single-process parts: dropout switched off, the unsplit step's loss and
gradients, a step that microbatching changes refused before anything is split (the multi-rank comparison is in
``tests/pipeline/test_skip_values.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_hybrid.pipeline.split import StageSplit, Unit
from lightning_hybrid.pipeline.verify import NoDropout, PipelineMismatch, held_parameter_names, unsplit_step
from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.probe.step_probe import StepProbe


class Net(nn.Module):
    def __init__(self, batch_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 6)
        self.norm = nn.BatchNorm1d(6) if batch_norm else nn.Identity()
        self.blocks = nn.ModuleList([nn.Linear(6, 6), nn.Linear(6, 6)])
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        x = F.dropout(self.norm(self.embed(x)), 0.5, self.training)
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).square().mean()


def _probe(model: Net, batch: Tensor) -> StepProbe:
    _, blocks = find_block_list(model)
    model.training_step = lambda b, index: model(b)
    return StepProbe(model, blocks, lambda microbatches: model(batch), torch.device("cpu"),
                     run_on=lambda work: work(batch))


def _split() -> StageSplit:
    units = [Unit("blocks.0", 0, (0,), (0,)), Unit("blocks.1", 1, (1,), (1,)), Unit("embed", None, (0,), (0,)),
             Unit("head", None, (1,), (1,))]
    return StageSplit(2, [1, 1], units, parameter_stages={"embed.weight": (0,), "embed.bias": (0,),
                                                          "head.weight": (1,), "head.bias": (1,)})


def test_dropout_is_an_identity_inside_no_dropout() -> None:
    x = torch.randn(64, 8)
    with NoDropout():
        assert torch.equal(F.dropout(x, 0.5, True), x) and torch.equal(nn.Dropout(0.3).train()(x), x)
        q = torch.randn(1, 2, 4, 8)
        attention = F.scaled_dot_product_attention(q, q, q, None, 0.9)
    assert torch.allclose(attention, F.scaled_dot_product_attention(q, q, q))
    assert not torch.equal(F.dropout(x, 0.5, True), x)


def test_the_unsplit_step_gives_the_held_parameters_gradients_and_leaves_none_behind() -> None:
    torch.manual_seed(0)
    model, batch = Net(), torch.randn(8, 4)
    reference = unsplit_step(_probe(model, batch), _split(), stage_ids=[1], accumulation=2, microbatches=2)
    assert set(reference.gradients) == {"blocks.1.weight", "blocks.1.bias", "head.weight", "head.bias"}
    assert all(p.grad is None for p in model.parameters())
    model.eval()  # dropout off: what NoDropout made of the step
    loss = model(batch)
    loss.backward()
    assert reference.loss == pytest.approx(float(loss.detach()), rel=1e-6)
    assert torch.allclose(reference.gradients["head.weight"], model.head.weight.grad / 2)


def test_a_step_that_microbatching_changes_is_refused_with_what_to_do() -> None:
    torch.manual_seed(0)
    model, batch = Net(batch_norm=True), torch.randn(8, 4)
    with pytest.raises(PipelineMismatch, match=r"another loss on them than on the whole batch.*BatchNorm.*"
                                               r"pp_microbatches=1.*verify_pipeline=False"):
        unsplit_step(_probe(model, batch), _split(), stage_ids=[0], accumulation=1, microbatches=2)
    assert torch.equal(model.norm.running_mean, torch.zeros(6))  # the probe's runs left no trace
    unsplit_step(_probe(model, batch), _split(), stage_ids=[0], accumulation=1, microbatches=1)


def test_held_parameters_follow_units_and_reads() -> None:
    assert held_parameter_names(Net(), _split(), [0]) == {"blocks.0.weight", "blocks.0.bias", "embed.weight",
                                                          "embed.bias"}
