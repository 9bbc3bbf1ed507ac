"""The message a surviving rank prints when another rank's process is gone (single process: the exception alone)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning_hybrid.resilience.lost_rank import explain_lost_rank

GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:54491."
        " This is typically caused by a remote worker crashing. Check the logs of the remote worker before reporting"
        " an error. GLHF!")


def _raised_in_optimizer_step(error: BaseException) -> BaseException:
    def optimizer_step() -> None:
        def clip_gradients() -> None:
            raise error
        clip_gradients()

    with pytest.raises(type(error)) as caught:
        optimizer_step()
    return caught.value


class _Module:
    """A LightningModule's ``trainer`` property: the Trainer, or RuntimeError when none is attached."""

    def __init__(self, trainer: object = None) -> None:
        self._trainer = trainer

    @property
    def trainer(self) -> object:
        if self._trainer is None:
            raise RuntimeError("not attached to a `Trainer`")
        return self._trainer


def test_lost_peer_says_where_it_was_noticed_and_which_checkpoint_resumes(tmp_path: Path) -> None:
    last = tmp_path / "last.ckpt"
    last.mkdir()
    callbacks = [SimpleNamespace(last_model_path=str(last)), SimpleNamespace(last_model_path="")]
    error = _raised_in_optimizer_step(RuntimeError(GLOO))
    explain_lost_rank(error, _Module(SimpleNamespace(global_step=9, checkpoint_callbacks=callbacks)), rank=3)
    assert str(error) == (
        "HybridStrategy rank 3: another rank of this job is gone (noticed at step 9, in gradient clipping (optimizer"
        " step)): its process ended (killed, out of memory or crashed; its own log says why), so this rank stops too."
        f' Resume with ckpt_path="last" (now {last}); torchrun --max-restarts or SLURM --requeue restart the job by'
        f" themselves (recipes/launch/). The backend reported: {GLOO}"
    )


def test_without_a_complete_checkpoint_or_a_trainer_the_message_says_a_restart_begins_at_step_0(
    tmp_path: Path,
) -> None:
    error = RuntimeError("Read error [127.0.0.1]:23984: Connection reset by peer.")
    explain_lost_rank(error, _Module(), rank=0)
    assert str(error).startswith("HybridStrategy rank 0: another rank of this job is gone (noticed in training)")
    assert "No complete checkpoint with save_last=True exists: a restart begins at step 0" in str(error)
    partial_only = SimpleNamespace(global_step=2, checkpoint_callbacks=[
        SimpleNamespace(last_model_path=str(tmp_path / "last.ckpt"))])  # its save was cut short: never renamed
    error = RuntimeError(GLOO)
    explain_lost_rank(error, _Module(partial_only), rank=0)
    assert "noticed at step 2, in training)" in str(error) and "a restart begins at step 0" in str(error)


def test_other_errors_are_left_as_they_are() -> None:
    error = _raised_in_optimizer_step(ValueError("Expected input batch_size (4) to match target batch_size (8)"))
    explain_lost_rank(error, _Module(SimpleNamespace(global_step=1, checkpoint_callbacks=[])), rank=0)
    assert str(error) == "Expected input batch_size (4) to match target batch_size (8)"
