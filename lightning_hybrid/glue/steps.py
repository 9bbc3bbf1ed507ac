"""How the strategy runs Lightning's step methods (:func:`run_step_method`): through the pipeline, or on the module
with FSDP2's root hooks once per step (:class:`RootStepRouter`) and the logits sharded under ``loss_parallel``; no
gradients kept alive that Lightning is about to zero (:func:`free_stale_gradients`); a pipelined step's gradients
added where Lightning's ``backward`` would put them (:func:`pipelined_backward`).

Example::

    router = RootStepRouter()
    free_stale_gradients(trainer, lightning_module)     # before a training step Lightning zeroes after
    loss = run_step_method(strategy, router, "training_step", batch, batch_idx)
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from lightning_hybrid._compat import call_through_module
from lightning_hybrid.tensor_parallel.loss_parallel import sharded_logits


def run_step_method(strategy: Any, router: "RootStepRouter", method: str, *args: Any, **kwargs: Any) -> Any:
    """``strategy.lightning_module.<method>(*args, **kwargs)`` as the layout runs it: over the pipeline's stages and
    microbatches, else on the module (its FSDP2 root's hooks once, see :class:`RootStepRouter`), the logits kept
    sharded under ``loss_parallel``."""
    module = strategy.lightning_module
    if strategy.pipeline is not None:
        return strategy.pipeline.run_step(method, *args, **kwargs)
    with sharded_logits(module, strategy.options.loss_parallel) as plain:
        if isinstance(module, FSDPModule):
            return plain(router.run(strategy, module, method, *args, **kwargs))
        return plain(getattr(module, method)(*args, **kwargs))


def pipelined_backward(strategy: Any, closure_loss: Tensor) -> Tensor:
    """Lightning's ``backward`` of a pipelined training step: the schedule already ran every microbatch's backward
    inside ``training_step`` and Lightning's ``zero_grad`` came after that, so the step's gradients are added now,
    where ``loss.backward()`` would have put them, between the strategy's and the precision plugin's hooks."""
    module = strategy.lightning_module
    strategy.pre_backward(closure_loss)
    closure_loss = strategy.precision_plugin.pre_backward(closure_loss, module)
    strategy.pipeline.add_step_gradients()
    closure_loss = strategy.precision_plugin.post_backward(closure_loss, module)
    strategy.post_backward(closure_loss)
    return closure_loss


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
