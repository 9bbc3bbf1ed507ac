"""How the strategy runs Lightning's step methods (``lightning_hybrid.glue.steps``): a step that calls the module itself
is routed through the root's ``__call__`` once only, and the previous step's gradients are dropped exactly where
Lightning would zero them after the step."""

from __future__ import annotations


import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_hybrid import HybridStrategy
from lightning_hybrid.glue.steps import RootStepRouter


class _Net(LightningModule):
    def __init__(self, calls_itself: bool = True) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 1)
        self.calls_itself = calls_itself
        self.grads_at_step_start: list[bool] = []  # whether every gradient was None when training_step began

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.grads_at_step_start.append(all(p.grad is None for p in self.parameters()))
        (x,) = batch
        return (self(x) if self.calls_itself else self.layer(x)).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("calls_itself", [True, False])
def test_a_step_that_calls_the_module_itself_goes_through_its_call_once_only(calls_itself: bool) -> None:
    module, router = _Net(calls_itself), RootStepRouter()
    strategy = SingleDeviceStrategy(device=torch.device("cpu"))
    calls: list[None] = []
    module.register_forward_pre_hook(lambda *_: calls.append(None))
    batch = (torch.ones(2, 4),)
    per_step = []
    for step in range(3):
        before = len(calls)
        router.run(strategy, module, "training_step", batch, step)
        per_step.append(len(calls) - before)
    # First step: redirected (1) plus the step's own self(x) (1); then the step's own call alone. A step that
    # never calls the module is redirected every time, so the root's hooks still fire once.
    assert per_step == ([2, 1, 1] if calls_itself else [1, 1, 1])


class _ReadsGradients(Callback):
    def on_before_zero_grad(self, trainer: Trainer, pl_module: LightningModule, optimizer: object) -> None:
        pass  # a callback that may read the gradients Lightning is about to zero: they must still be there


class _KeepsGradients(_Net):
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        pass  # accumulates over every step: nothing may drop the gradients


@pytest.mark.usefixtures("one_process_fit")
@pytest.mark.parametrize("case", ["default", "accumulation", "zero_grad_overridden", "callback_reads"])
def test_the_previous_steps_gradients_are_dropped_only_where_lightning_zeroes_them(case: str) -> None:
    module = _KeepsGradients() if case == "zero_grad_overridden" else _Net()
    trainer = Trainer(accelerator="cpu", devices=1, strategy=HybridStrategy(monitor=False), max_steps=4,
                      accumulate_grad_batches=2 if case == "accumulation" else 1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[_ReadsGradients()] if case == "callback_reads" else [])
    data = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=2)
    trainer.fit(module, data)
    expected = {"default": [True] * 4, "accumulation": [True, False] * 4,
                "zero_grad_overridden": [True, False, False, False], "callback_reads": [True, False, False, False]}
    assert module.grads_at_step_start == expected[case]
