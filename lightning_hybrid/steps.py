"""How the strategy runs Lightning's step methods: FSDP2's root hooks once per step (:class:`RootStepRouter`) and
no gradients kept alive that Lightning is about to zero (:func:`free_stale_gradients`).

Example::

    router = RootStepRouter()
    free_stale_gradients(trainer, lightning_module)     # before a training step Lightning zeroes after
    loss = router.run(strategy, lightning_module, "training_step", batch, batch_idx)
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_hybrid._compat import call_through_module


class RootStepRouter:
    """Runs a LightningModule's step so that the hooks of its FSDP2 root fire once per step.

    FSDP2 gathers the root's parameters (embeddings, final norm, head) in the root's ``__call__``, but Lightning
    calls ``training_step`` directly, so a step that reaches the model through ``self.model(...)`` only would use
    them sharded. Routing the step through the root's ``__call__`` (Lightning's forward redirection) fixes that but,
    for the usual step that calls ``self(...)``, runs the hooks nested: the inner call leaves the root's group
    idle, the outer one reshards it, and backward all-gathers it a second time (+1 all-gather of the root per step,
    measured in BENCHMARKS.md). So each step method runs through ``__call__`` once while a hook counts the root's
    calls; a method that calls the module itself is then called directly, and its own ``self(...)`` gathers.
    """

    def __init__(self) -> None:
        self._calls_itself: dict[str, bool] = {}

    def run(self, strategy: Any, module: nn.Module, method: str, *args: Any, **kwargs: Any) -> Any:
        """``module.<method>(*args, **kwargs)``, inside ``module.__call__`` (with ``strategy``'s forward
        redirection) unless the method is known to call the module itself."""
        calls_itself = self._calls_itself.get(method)
        if calls_itself:
            return getattr(module, method)(*args, **kwargs)
        if calls_itself is False:
            return call_through_module(strategy, module, method, *args, **kwargs)
        calls: list[None] = []
        counting = module.register_forward_pre_hook(lambda *_: calls.append(None))
        try:
            output = call_through_module(strategy, module, method, *args, **kwargs)
        finally:
            counting.remove()
        self._calls_itself[method] = len(calls) > 1  # the redirected call itself is one
        return output


def free_stale_gradients(trainer: Trainer, module: LightningModule) -> None:
    """Drop the previous step's gradients before a training step that Lightning zeroes them after.

    Lightning's automatic optimization runs ``training_step`` → ``zero_grad`` → ``backward``, so the gradients the
    last ``optimizer.step()`` used are alive through the forward pass, where activations peak (one gradient per
    parameter: +6.3 MiB at dp2 in BENCHMARKS.md's comparison, and through the whole step under pp, whose backward
    runs inside ``training_step``). A hand-written loop frees them after ``optimizer.step()``. They are dropped here
    only where nothing can tell: the first batch of an accumulation window (Lightning zeroes then), automatic
    optimization, and no ``optimizer_zero_grad`` or ``on_before_zero_grad`` overridden by the module or a callback.
    """
    accumulation = trainer.accumulate_grad_batches
    if (not module.automatic_optimization or trainer.fit_loop.epoch_loop.batch_idx % accumulation != 0
            or is_overridden("optimizer_zero_grad", module, LightningModule)
            or is_overridden("on_before_zero_grad", module, LightningModule)
            or any(is_overridden("on_before_zero_grad", callback, Callback) for callback in trainer.callbacks)):
        return
    for parameter in module.parameters():
        parameter.grad = None
