"""``HybridStrategy(loss_parallel=True)``: the cross-entropy of an unmodified step computed from logits that stay
sharded over the vocabulary, with torch's :func:`~torch.distributed.tensor.parallel.loss_parallel`.

Under tp the head is column-parallel over the vocabulary (:mod:`lightning_hybrid.tensor_parallel.vocab`). By default
its logits are all-gathered so that the user's loss receives plain, full logits; at a vocabulary of 128k they are
the largest activation of a step (batch × sequence × vocabulary on every tp rank, and the log-softmax saved for
backward as large again). With ``loss_parallel=True`` the head's output stays a DTensor sharded on its last
dimension and :func:`sharded_logits` runs each step method, and the backward, inside ``loss_parallel()``:
``F.cross_entropy(logits.view(-1, V), targets.view(-1))`` then combines per-rank maxima and sums (two all-reduces
of one value per token) instead of gathering the logits. Lightning is handed plain tensors: what the step returns
(the loss, a ``Replicate`` DTensor, keeps its autograd graph) and every value passed to ``self.log``. Any other use
of the logits receives the sharded DTensor; DTensor's own errors about it (a plain tensor mixed in, an operation
without a sharding rule) are re-raised saying so.

Example::

    require_sharded_head(options.loss_parallel, vocab)   # at setup: the head must be sharded over the vocabulary
    with sharded_logits(lightning_module, enabled=True) as plain:
        loss = plain(lightning_module.training_step(batch, 0))   # a plain tensor, backpropagating into the shards
    with sharded_logits(lightning_module, enabled=True):
        loss.backward()
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from lightning_hybrid.tensor_parallel.vocab import VocabLayers

#: Phrases of DTensor's errors about an operand or an operation it cannot handle.
_DTENSOR_ERRORS = ("DTensor", "Sharding propagation failed", "sharding strategy")


def require_sharded_head(loss_parallel_on: bool, vocab: Optional[VocabLayers]) -> None:
    """Stop at setup if ``loss_parallel=True`` but the head stays whole (``vocab``: what
    :func:`~lightning_hybrid.parallel.parallelize.find_vocab` found; ``None`` when nothing is sharded, tp = 1)."""
    if not loss_parallel_on or (vocab is not None and vocab.head is not None):
        return
    reason = vocab.reason if vocab is not None else "tp=1 shards nothing"
    raise ValueError(
        f"HybridStrategy(loss_parallel=True) needs the language-model head sharded over the vocabulary, but it stays"
        f" whole ({reason}). Drop loss_parallel, or make the head shardable: a plain nn.Linear run after the blocks"
        " whose output width is the token embedding's vocabulary, divisible by tp, not named in tp_plan."
    )


def plain(value: Any) -> Any:
    """``value`` (a tensor or a collection of them) with every DTensor replaced by its full value as a plain tensor,
    keeping the autograd graph (a ``Replicate`` one needs no communication; a sharded one is gathered)."""
    return apply_to_collection(value, DTensor, lambda tensor: tensor.full_tensor())


@contextlib.contextmanager
def sharded_logits(module: nn.Module, enabled: bool) -> Iterator[Callable[[Any], Any]]:
    """Run a step method or its backward with logits sharded over the vocabulary (``enabled``; otherwise nothing
    changes): inside ``loss_parallel()``, with ``module.log`` logging DTensors as plain tensors and DTensor errors
    explained. Yields the conversion to apply to the step's output (:func:`plain`; the identity when disabled).
    Re-entrant: a manual ``self.manual_backward(loss)`` inside ``training_step`` runs in the step's context."""
    if not enabled or isinstance(vars(module).get("log"), _PlainLog):
        yield plain if enabled else _unchanged
        return
    # An instance attribute shadows LightningModule.log (and serves log_dict, which calls self.log) for this call.
    own_log = vars(module).get("log")
    module.log = _PlainLog(module.log)
    try:
        with loss_parallel():
            yield plain
    except RuntimeError as error:  # NotImplementedError included
        if not any(phrase in str(error) for phrase in _DTENSOR_ERRORS):
            raise
        raise RuntimeError(
            f"{error}\nHybridStrategy(loss_parallel=True) keeps the logits a DTensor sharded over the vocabulary"
            " (tensor-parallel ranks), and this operation cannot take it. Pass loss_parallel=False (logits gathered,"
            " plain), or make the value a plain tensor first with .full_tensor() (on the logits, it gathers them)."
        ) from error
    finally:
        if own_log is None:
            del module.log
        else:
            module.log = own_log


class _PlainLog:
    """``LightningModule.log`` receiving DTensor values as plain tensors: Lightning's result collection stacks and
    reduces them with plain tensors, which a DTensor refuses."""

    def __init__(self, log: Callable[..., None]) -> None:
        self._log = log

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self._log(name, plain(value), *args, **kwargs)


def _unchanged(value: Any) -> Any:
    return value
