"""A rank that died, told plainly to the ranks that outlive it.

When one process of the job dies (SIGKILL, out of memory, a segfault, a lost node), the others learn it at their next
collective as a backend error from deep inside whatever they were doing, e.g. gloo's ``Connection closed by peer
[127.0.0.1]:54491. This is typically caused by a remote worker crashing ... GLHF!``. :func:`explain_lost_rank`
(the strategy's ``on_exception``) rewrites such an error's message in place, so the traceback every survivor
prints ends with what happened: which rank noticed, at which step and in which part of it, that another process
ended and this one stops too, and where training resumes from.

Example::

    try:
        trainer.fit(model)
    except RuntimeError as error:    # the strategy already did this on every surviving rank
        explain_lost_rank(error, trainer.lightning_module, trainer.global_rank)
        raise
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Optional

#: What the process-group backends say when the process at the other end of a connection is gone.
LOST_PEER_PHRASES = (
    "Connection closed by peer",  # gloo: the peer's socket closed (its process exited or was killed)
    "Connection reset by peer",  # gloo: the same, seen while reading
    "Broken pipe",  # gloo: seen while writing
    "remote process exited or there was a network error",  # NCCL
)

#: Innermost first: the first of these functions found walking the traceback outwards names the part of the step.
PHASES = {
    "training_step": "the training step (forward)",
    "backward": "the backward pass",
    "clip_gradients": "gradient clipping (optimizer step)",
    "optimizer_step": "the optimizer step",
    "save_checkpoint": "a checkpoint save",
    "load_checkpoint": "a checkpoint load",
    "validation_step": "a validation step",
}


def is_lost_peer(exception: BaseException) -> bool:
    """Whether ``exception`` says that another rank of the process group is gone."""
    return any(phrase in str(exception) for phrase in LOST_PEER_PHRASES)


def phase_of(exception: BaseException) -> str:
    """The part of training the exception interrupted, read from its traceback."""
    for frame in reversed(traceback.extract_tb(exception.__traceback__)):
        if frame.name in PHASES:
            return PHASES[frame.name]
    return "training"


def attached_trainer(module: Optional[Any]) -> Optional[Any]:
    """The Trainer ``module`` (a LightningModule) is attached to, or None (its ``trainer`` property raises then)."""
    try:
        return module.trainer if module is not None else None
    except RuntimeError:
        return None


def resume_advice(trainer: Optional[Any]) -> str:
    """Where a restarted run continues from: ``ckpt_path="last"``'s checkpoint when one is complete."""
    last = [Path(callback.last_model_path) for callback in getattr(trainer, "checkpoint_callbacks", [])
            if getattr(callback, "last_model_path", "")]
    complete = [path for path in last if path.exists()]  # a save that was interrupted left only <name>.partial
    if not complete:
        return ("No complete checkpoint with save_last=True exists: a restart begins at step 0"
                " (ModelCheckpoint(every_n_train_steps=N, save_last=True) writes them).")
    newest = max(complete, key=lambda path: path.stat().st_mtime)
    return (f'Resume with ckpt_path="last" (now {newest}); torchrun --max-restarts or SLURM --requeue restart'
            " the job by themselves (recipes/launch/).")


def explain_lost_rank(exception: BaseException, module: Optional[Any], rank: int) -> None:
    """If ``exception`` is a lost connection to another rank, replace its message by one that says so (the
    backend's first line kept at the end); other exceptions are left as they are. ``module`` is the
    LightningModule being trained (its Trainer gives the step and the checkpoints)."""
    if not is_lost_peer(exception):
        return
    trainer = attached_trainer(module)
    step = getattr(trainer, "global_step", None)
    where = f"at step {step}, in {phase_of(exception)}" if step is not None else f"in {phase_of(exception)}"
    backend = str(exception).strip().splitlines()[0]
    exception.args = (
        f"HybridStrategy rank {rank}: another rank of this job is gone (noticed {where}): its process ended"
        f" (killed, out of memory or crashed; its own log says why), so this rank stops too. {resume_advice(trainer)}"
        f" The backend reported: {backend}",
    )
