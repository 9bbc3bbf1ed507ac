"""The setup probe runs the step once for every reader and leaves no trace: random streams, buffers."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_hybrid.probe.blocks import find_block_list
from lightning_hybrid.probe.step_probe import StepProbe, leaving_no_trace


class Noisy(nn.Module):
    """Dropout, BatchNorm, a buffer the step replaces and an expanded one it only reads."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.drop = nn.Dropout(0.5)
        self.register_buffer("steps", torch.zeros(()))
        self.register_buffer("positions", torch.arange(4.0).expand(8, -1), persistent=False)
        self.runs = 0

    def forward(self, x: Tensor) -> Tensor:
        self.runs += 1
        self.steps = self.steps + 1  # replaced, not written in place
        x = self.drop(self.norm(x)) + self.positions[: x.shape[0]]
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _probe(model: Noisy, prepare=lambda: None) -> StepProbe:
    _, blocks = find_block_list(model)
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    return StepProbe(model, blocks, lambda microbatches: model(batch.tensor_split(microbatches)[0]),
                     torch.device("cpu"), prepare=prepare)


def test_the_record_is_taken_once_and_leaves_the_random_stream_and_buffers() -> None:
    model = Noisy()
    torch.manual_seed(3)
    rng = torch.get_rng_state()
    buffers = {name: value.clone() for name, value in model.named_buffers()}
    steps, positions = model.steps, model.positions
    probe = _probe(model)
    record = probe.record()
    assert probe.record() is record and model.runs == 1
    assert torch.equal(torch.get_rng_state(), rng)  # the dropout mask was drawn from a forked stream
    assert model.steps is steps and model.positions is positions
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name
    assert float(model.norm.num_batches_tracked) == 0


def test_timing_runs_take_the_first_microbatch_and_are_isolated_too() -> None:
    model = Noisy()
    probe = _probe(model)
    sizes = []
    model.blocks[0].register_forward_hook(lambda module, args, output: sizes.append(args[0].shape[0]))
    rng = torch.get_rng_state()
    with probe.isolated(), torch.enable_grad():
        probe.run(4).backward()
    assert sizes == [2] and model.blocks[0].weight.grad is not None
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(model.norm.running_mean, torch.zeros(4))


def test_what_the_caller_prepares_happens_once_and_outside_the_isolation() -> None:
    # The loop's own data iterator is started early for the probe: its seed draw must stay, as if the loop drew it.
    model = Noisy()
    drawn = []
    probe = _probe(model, prepare=lambda: drawn.append(torch.randint(0, 2**30, ()).item()))
    torch.manual_seed(5)
    probe.record()
    with probe.isolated():
        pass
    assert len(drawn) == 1
    torch.manual_seed(5)
    torch.randint(0, 2**30, ())
    after_one_draw = torch.get_rng_state()
    other = _probe(Noisy(), prepare=lambda: torch.randint(0, 2**30, ()))
    torch.manual_seed(5)
    other.record()
    assert torch.equal(torch.get_rng_state(), after_one_draw)


def test_leaving_no_trace_puts_back_values_written_in_place() -> None:
    model = Noisy()
    with leaving_no_trace(model, torch.device("cpu")):
        model.norm.running_var.mul_(3)
        torch.rand(5)
    assert torch.equal(model.norm.running_var, torch.ones(4))
