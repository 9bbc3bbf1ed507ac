"""Train a tiny test model for a few optimizer steps and save its losses and full parameters.

This is a SCRIPT, not a test module: a distributed fit needs one process per rank, so it cannot run inside the
pytest process. Run it directly and Lightning's subprocess launcher starts the extra ranks by re-executing
``sys.argv``; ``tests/helpers.py::run_script`` instead starts every rank at once with torchrun-style environment
variables, and ``tests/test_equivalence.py`` / ``tests/pipeline/test_pipeline.py`` compare the results.

Usage::

    # plain single-process Lightning; data order reproduces what a data-parallel size of 2 sees:
    python tests/equivalence.py --model gpt --reference --dp 2 --devices 1 --out /tmp/ref.pt
    # the same training with HybridStrategy (FSDP2 dp=2 x tensor-parallel tp=2 on 4 CPU processes):
    python tests/equivalence.py --model gpt --dp 2 --tp 2 --devices 4 --out /tmp/par.pt
    # two pipeline stages (4 blocks), interleaved 1F1B with two stages per rank:
    python tests/equivalence.py --model llama --pp 2 --layers 4 --devices 2 \
        --strategy-kwargs '{"pp_schedule": "interleaved_1f1b"}' --out /tmp/pp.pt
    # the harness's own check against Lightning's DDP:
    python tests/equivalence.py --model gpt --strategy ddp --dp 2 --devices 2 --out /tmp/ddp.pt

What makes the reference comparable to a parallel run
-----------------------------------------------------
* Same initial weights: the LightningModule seeds and builds the model in ``__init__``, in every process.
* Same data per optimizer micro-step. In a distributed run Lightning replaces the training sampler with
  ``DistributedSampler(shuffle=True, seed=PL_GLOBAL_SEED or 0, num_replicas=<data-parallel size>,
  rank=<data-parallel rank>)`` even though our DataLoader does not shuffle, and calls ``set_epoch(epoch)`` at
  every epoch start. Each rank loads ``batch_size = global_batch / dp_size`` samples. The reference (one
  process, no sampler injection) uses :class:`DistributedOrderSampler`, which yields, for every micro-step, the
  concatenation over data-parallel ranks of exactly the samples each rank's ``DistributedSampler`` yields at
  that micro-step, with ``batch_size = global_batch``. Tensor-parallel (and pipeline) ranks of one
  data-parallel rank see the same samples, so only the data-parallel size matters, and the reference for a
  layout is keyed by ``dp * dp_replicate`` (``dp_size`` below). (When the dataset size is a multiple of
  ``dp_size``, the strided split makes each global batch the same SET of samples for every ``dp_size``; only
  the order inside the batch differs, which changes the numbers by rounding alone. A different shuffle seed
  or a rank that loads the wrong shard changes the losses by ~1e-2.)
* Same loss: each rank's loss is the mean over an equal number of tokens, so the mean over ranks (what
  ``sync_dist=True`` logs, and what data-parallel gradient averaging differentiates) equals the reference's
  mean over the global batch.

What is saved (``torch.save`` on global rank 0)
-----------------------------------------------
``losses``        the logged ``train_loss`` after EVERY micro-batch (``accumulate_grad_batches`` of them per
                  optimizer step), read from ``trainer.callback_metrics`` in ``on_train_batch_end``. On a
                  parallel run this is the ``sync_dist`` mean over all ranks. This is the value compared: it is
                  stricter than a per-step value because each micro-batch's forward is checked on its own.
``tokens``        per micro-batch, the ``reduce_fx="sum"`` metric of tokens seen: the global batch's token count
                  if metrics are reduced over data-parallel ranks only (tensor-parallel copies not counted twice).
``step_outputs``  per micro-batch, ``outputs["loss"]`` as callbacks receive it in ``on_train_batch_end`` (rank 0;
                  with pipelining rank 0 does not compute the loss, the strategy hands it the last stage's).
``step_losses``   per optimizer step, the mean of its micro-batch losses (what the accumulated gradient
                  corresponds to); derived from ``losses``, saved for reports.
``val_losses``    the epoch-level ``val_loss`` of every validation run (one, after the first epoch).
``params``        the FULL (unsharded) state dict of the LightningModule after fit, on CPU.
``replica_max_abs_diff``  largest difference between ranks that hold the same parameter (0 when replicas and
                  gathered shards agree; a diagnostic for replicas that drifted apart).
``hook_calls``, ``grads_after_backward``, ``learning_rates``  how often ``on_before_backward``,
                  ``on_after_backward`` and ``on_before_optimizer_step`` fired (rank 0), whether every trained
                  parameter had a gradient in ``on_after_backward``, and the learning rate at each optimizer step.
``initial_params``  the full state dict when training starts (after the strategy initialized the model).
``rank_linear_calls``  per rank, how many times an ``nn.Linear`` ran during fit (activation checkpointing's
                  recomputation calls a block's layers again in backward); not counted under ``torch.compile``.
``rank_compiled_frames``  per rank, how many frames ``torch.compile`` compiled during fit (Dynamo's count).
``rank_local_parameter_bytes``  per rank, the bytes of parameter data it holds when training starts (its shards).
``rank_parameter_counts``  per rank, the global element count of the parameters it holds (pipeline stages hold
                  only their own).
``summary_parameters``  (total, trainable) parameters of the model summary printed at fit start: Lightning's own in
                  the reference, the strategy's whole-model one (every pipeline stage, tied weights once).
``rank_local_shapes``  per rank, ``{name: (local shape, global shape)}`` of its DTensor parameters after fit
                  (tied weights under each name).
``resumed_from``, ``checkpoint_seconds``  the checkpoint fit resumed from (``--ckpt-path last`` resolved) and rank 0's
                  wall seconds per checkpoint save and load.
``start_step``, ``restart_count``  the step training started at (the resumed checkpoint's) and, under ``torchrun
                  --max-restarts``, which attempt this was (0 for the first).
``num_nodes``, ``cluster_environment``  ``trainer.num_nodes`` and the class name of the cluster environment
                  Lightning chose (``TorchElasticEnvironment`` under torchrun, ``SLURMEnvironment`` under srun;
                  ``NoneType`` on one device: single-device strategies have none).
``rank_placement``  per global rank, where it runs and which mesh groups it is in: ``global_rank``, ``node_rank``,
                  ``local_rank`` (as Lightning sees them) and, under HybridStrategy, ``tp_ranks`` / ``pp_ranks``: the
                  global ranks of its tensor-parallel group and of its pipeline group.
``global_step``, ``args``, ``world_size``, ``wall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# The launcher re-executes this file as a script (``python tests/equivalence.py``), which puts ``tests/`` and not
# the repository root on ``sys.path``; add the root so ``tests.models`` and ``lightning_hybrid`` import.
_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(_REPO_ROOT))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402
from lightning.pytorch.utilities.model_summary import summarize  # noqa: E402
from torch import Tensor  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.checkpoint import FileSystemWriter  # noqa: E402
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: E402
from torch.utils.data import DataLoader, Dataset, Sampler  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402
from torch.utils.data.distributed import DistributedSampler  # noqa: E402

from tests.models import (  # noqa: E402
    ALL_MODEL_NAMES,
    LMLightningModule,
    RandomTokenDataset,
    LAYERS_FIELD,
    build_module,
    default_config,
)

ACCUMULATE_GRAD_BATCHES = 2
#: Below the accumulated gradient norm of these models (about 0.4 per step), so clipping acts on every step and a
#: wrong global norm (e.g. one mesh's norm only) changes the numbers.
GRADIENT_CLIP_VAL = 0.1


class DistributedOrderSampler(Sampler[int]):
    """Single-process sampler reproducing the union of what ``dp_size`` ``DistributedSampler`` ranks load.

    Used with ``DataLoader(batch_size=dp_size * per_rank_batch)``: global batch ``k`` is the concatenation over
    ranks ``r`` of rank ``r``'s micro-batch ``k``. The per-rank index lists come from torch's own
    ``DistributedSampler`` (shuffle, padding, ``rank::num_replicas`` striding and all), so the order cannot
    drift from what Lightning injects. Lightning calls ``set_epoch`` on ``dataloader.sampler`` at every epoch
    start, exactly as it does on the injected sampler.
    """

    def __init__(self, dataset: Dataset, dp_size: int, per_rank_batch: int, seed: int) -> None:
        self.dataset = dataset
        self.dp_size = dp_size
        self.per_rank_batch = per_rank_batch
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _rank_indices(self) -> list[list[int]]:
        per_rank = []
        for rank in range(self.dp_size):
            sampler = DistributedSampler(
                self.dataset, num_replicas=self.dp_size, rank=rank, shuffle=True, seed=self.seed
            )
            sampler.set_epoch(self.epoch)
            per_rank.append(list(sampler))
        return per_rank

    def __iter__(self) -> Iterator[int]:
        per_rank = self._rank_indices()
        num_samples = len(per_rank[0])  # equal on every rank (DistributedSampler pads)
        b = self.per_rank_batch
        for start in range(0, num_samples, b):
            for indices in per_rank:
                yield from indices[start : start + b]

    def __len__(self) -> int:
        return sum(len(indices) for indices in self._rank_indices())


class RecordCallback(pl.Callback):
    """Collects logged losses and, at the end of training, the full parameters (see module docstring).
    ``count_linear_calls=False`` leaves out ``rank_linear_calls``: under ``torch.compile`` the counting hook's
    integer would be a guard of every graph, recompiled at each call until Dynamo gives up and runs eagerly."""

    def __init__(self, count_linear_calls: bool = True) -> None:
        self.count_linear_calls = count_linear_calls
        self.losses: list[float] = []
        self.tokens: list[float] = []
        self.step_outputs: list[float] = []
        self.val_losses: list[float] = []
        self.params: dict[str, Tensor] = {}
        self.replica_max_abs_diff: float = 0.0
        self.hook_calls: dict[str, int] = {"on_before_backward": 0, "on_after_backward": 0, "on_before_optimizer_step": 0}
        self.grads_after_backward: list[bool] = []
        self.learning_rates: list[float] = []
        self.rank_parameter_counts: list[int] = []
        self.summary_parameters: tuple[int, int] = (0, 0)
        self.rank_local_shapes: list[dict[str, tuple]] = []
        self.initial_params: dict[str, Tensor] = {}
        self.rank_linear_calls: list[int] = []
        self.rank_compiled_frames: list[int] = []
        self._compiled_frames = 0
        self.rank_local_parameter_bytes: list[int] = []
        self.start_step = 0
        #: Single-process runs only: the total gradient norm before each optimizer step (before clipping), and the
        #: model FLOPs of the second batch (3 × its forward FLOPs, counted by torch's FlopCounterMode).
        self.grad_norms: list[float] = []
        self.model_flops = 0.0
        #: Values of the torchmetrics metrics the module logs (``--module-kwargs '{"log_metrics": true}'``), as
        #: Lightning shows them: ``"<when>:<name>"`` → one value per batch (step), epoch or validation.
        self.metric_values: dict[str, list[float]] = {}
        self._flop_counter: FlopCounterMode | None = None
        self._linear_calls = 0
        self._linear_hooks: list[Any] = []

    @staticmethod
    def _scalar(value: Any) -> float:
        # A strategy with a vocabulary-parallel loss could hand back a DTensor; compare its global value.
        full_tensor = getattr(value, "full_tensor", None)
        if callable(full_tensor):
            value = full_tensor()
        return float(torch.as_tensor(value).detach().cpu().double().item())

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # ``callback_metrics`` recomputes from the live results, so it already holds this batch's on_step value,
        # reduced over ranks at log time because of ``sync_dist=True``.
        self.losses.append(self._scalar(trainer.callback_metrics["train_loss"]))
        self.tokens.append(self._scalar(trainer.callback_metrics["tokens"]))
        self.step_outputs.append(self._scalar(outputs["loss"]))
        self._record_metrics(trainer, "step")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._record_metrics(trainer, "epoch")

    def _record_metrics(self, trainer: pl.Trainer, when: str) -> None:
        for name, value in trainer.callback_metrics.items():
            if name.endswith(("_acc", "_acc_step", "_acc_epoch", "aux_loss")):
                self.metric_values.setdefault(f"{when}:{name}", []).append(self._scalar(value))


    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.hook_calls["on_after_backward"] += 1
        trained = [p for p in pl_module.parameters() if p.requires_grad]  # a frozen parameter never has one
        self.grads_after_backward.append(all(p.grad is not None for p in trained))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.hook_calls["on_before_optimizer_step"] += 1
        self.learning_rates.append(optimizer.param_groups[0]["lr"])
        if trainer.world_size == 1:
            grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
            self.grad_norms.append(float(torch.nn.utils.get_total_norm(grads)))

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if trainer.world_size == 1 and batch_idx == 1:
            self._flop_counter = FlopCounterMode(display=False)
            self._flop_counter.__enter__()

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        self.hook_calls["on_before_backward"] += 1
        if self._flop_counter is not None:  # the forward is done: count it alone
            self._flop_counter.__exit__(None, None, None)
            self.model_flops = 3.0 * self._flop_counter.get_total_flops()
            self._flop_counter = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.val_losses.append(self._scalar(trainer.callback_metrics["val_loss"]))
            self._record_metrics(trainer, "validation")

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.start_step = trainer.global_step
        if trainer.global_rank == 0:  # what the crash tests read when a run ends before saving its result
            print(f"[equivalence] training starts at step {trainer.global_step}", flush=True)
        self._compiled_frames = counters["frames"]["ok"]
        self.initial_params, _ = self._full_parameters(pl_module)
        local = (p.to_local() if isinstance(p, DTensor) else p for p in pl_module.parameters())
        self.rank_local_parameter_bytes = _all_gather(sum(t.numel() * t.element_size() for t in local))
        # Every nn.Linear call during training, recomputations by activation checkpointing included.
        for module in pl_module.modules() if self.count_linear_calls else ():
            if isinstance(module, torch.nn.Linear):
                self._linear_hooks.append(module.register_forward_pre_hook(self._count_linear_call))

    def _count_linear_call(self, *_: Any) -> None:
        self._linear_calls += 1

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for hook in self._linear_hooks:
            hook.remove()
        self.rank_linear_calls = _all_gather(self._linear_calls)
        self.rank_compiled_frames = _all_gather(counters["frames"]["ok"] - self._compiled_frames)
        # Global element counts (a DTensor's numel is its global size): what each rank holds before data sharding.
        self.rank_parameter_counts = _all_gather(sum(p.numel() for p in pl_module.parameters()))
        self.summary_parameters = _summary_parameters(trainer, pl_module)
        self.rank_local_shapes = _all_gather({name: (tuple(p.to_local().shape), tuple(p.shape)) for name, p in
                                              pl_module.named_parameters(remove_duplicate=False)
                                              if isinstance(p, DTensor)})
        self.params, self.replica_max_abs_diff = self._full_parameters(pl_module)

    @staticmethod
    def _full_parameters(pl_module: pl.LightningModule) -> tuple[dict[str, Tensor], float]:
        """The full state dict on rank 0 (empty elsewhere), and the largest difference between ranks holding
        the same entry."""
        # Collective: every rank must call it. ``full_state_dict`` un-shards FSDP2 and DTensor parameters and
        # unwraps nothing it should not (DDP wraps a different object than ``pl_module``). ``cpu_offload=False``
        # on purpose: with ``cpu_offload=True`` only rank 0 keeps tensors, which would lose parameters that
        # live only on other ranks (pipeline stages). Each rank's dict is gathered and merged on rank 0 instead.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        local = {k: v.detach().cpu().clone() for k, v in get_model_state_dict(pl_module, options=options).items()}
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return local, 0.0
        world_size = dist.get_world_size()
        gathered: list[dict[str, Tensor]] | None = [{} for _ in range(world_size)] if dist.get_rank() == 0 else None
        dist.gather_object(local, gathered, dst=0)
        merged: dict[str, Tensor] = {}
        replica_max_abs_diff = 0.0
        for rank_dict in gathered or []:
            for name, tensor in rank_dict.items():
                if name in merged:
                    diff = (merged[name].double() - tensor.double()).abs().max().item() if tensor.numel() else 0.0
                    replica_max_abs_diff = max(replica_max_abs_diff, diff)
                else:
                    merged[name] = tensor
        return merged, replica_max_abs_diff


def _lightning_module(args: argparse.Namespace, trainer: pl.Trainer) -> pl.LightningModule:
    """The module to fit. ``init="init_module"``: built eagerly in ``__init__``, but under Lightning's
    ``trainer.init_module(empty_init=True)``, so on the meta device (the strategy materializes it)."""
    if args.user_parallel:
        return UserParallelModule(args.model, seed=args.seed)
    kwargs = {"init": args.init, **args.module_kwargs}
    config = {**kwargs.pop("config", {}), **({} if args.layers is None else {LAYERS_FIELD[args.model]: args.layers})}
    if kwargs["init"] != "init_module":
        return build_module(args.model, seed=args.seed, config=config, **kwargs)
    with trainer.init_module(empty_init=True):
        return build_module(args.model, seed=args.seed, config=config, **{**kwargs, "init": "eager"})


class UserParallelModule(LMLightningModule):
    """A module written for Lightning's ModelParallelStrategy: it applies FSDP2 itself in ``configure_model``."""

    def __init__(self, model: str, seed: int) -> None:
        super().__init__(model=model, seed=seed)

    def configure_model(self) -> None:
        from torch.distributed.fsdp import FSDPModule, fully_shard

        if isinstance(self.model, FSDPModule):
            return  # Lightning calls the hook again for trainer.test()/predict(); it must be idempotent
        data_mesh = self.trainer.strategy.data_mesh
        blocks = self.model.blocks if hasattr(self.model, "blocks") else self.model.layers
        for block in blocks:
            fully_shard(block, mesh=data_mesh)
        fully_shard(self.model, mesh=data_mesh)


class KillAt(pl.Callback):
    """Send this process ``signum`` at optimizer step ``step`` (``global_step`` when it starts; SIGKILL: a rank
    crashing there, SIGSTOP: a rank freezing): when the step's first batch starts (``where="step"``), inside its
    first forward (``"forward"``: when the model's last ``nn.Linear`` is called) or inside ``optimizer.step`` after
    the backward, before clipping and the update (``"optimizer"``)."""

    def __init__(self, where: str, step: int, signum: int) -> None:
        self.where, self.step, self.signum = where, step, signum

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step != self.step:
            return
        if self.where == "step":
            _signal_self(self.signum)
        if self.where == "forward":
            last_linear = [m for m in pl_module.modules() if isinstance(m, torch.nn.Linear)][-1]
            last_linear.register_forward_pre_hook(lambda *_: _signal_self(self.signum))

    def on_before_optimizer_step(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.where == "optimizer" and trainer.global_step == self.step:
            _signal_self(self.signum)


def _signal_self(signum: int) -> None:
    switch = "stop" if signum == signal.SIGSTOP else "kill"
    print(f"{switch} switch: {signal.Signals(signum).name} at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signum)


def kill_switch(spec: str, signum: int = signal.SIGKILL) -> pl.Callback:
    """The ``--kill RANK:WHERE:N`` (or, with SIGSTOP, ``--stop``) callback for this rank (a no-op on the others, and
    on attempts after the first under ``torchrun --max-restarts``, so the restarted job runs to the end)."""
    rank, where, count = spec.split(":")
    if int(os.environ.get("RANK", 0)) != int(rank) or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)) > 0:
        return pl.Callback()
    if where not in ("save", "write"):
        return KillAt(where, int(count), signum)
    if where == "write":
        # Die when this rank's N-th DCP write starts: with async_checkpoint, in the background thread while the
        # other ranks' writes are under way and training goes on.
        original_write, writes = FileSystemWriter.write_data, [0]

        def write_data(*write_args: Any, **write_kwargs: Any) -> Any:
            writes[0] += 1
            if writes[0] == int(count):
                _signal_self(signum)
            return original_write(*write_args, **write_kwargs)

        FileSystemWriter.write_data = write_data
        return pl.Callback()
    # Signalled when the N-th checkpoint save starts on this rank, while the other ranks are writing theirs.
    import lightning_hybrid.glue.checkpoint_io as strategy_module

    original, calls = strategy_module.save_sharded, [0]

    def save_sharded(*save_args: Any, **save_kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == int(count):
            _signal_self(signum)
        original(*save_args, **save_kwargs)

    strategy_module.save_sharded = save_sharded
    return pl.Callback()


def slow_down_writes(seconds: float) -> None:
    """Every DCP write on this rank starts ``seconds`` late (a slow file system), so training steps run while an
    asynchronous save is still writing."""
    original_write = FileSystemWriter.write_data

    def write_data(*write_args: Any, **write_kwargs: Any) -> Any:
        time.sleep(seconds)
        return original_write(*write_args, **write_kwargs)

    FileSystemWriter.write_data = write_data


def _time_checkpoint_io(strategy: Any) -> dict[str, list[float]]:
    """Wall seconds of each checkpoint save and load on this rank (recorded into the returned lists)."""
    seconds: dict[str, list[float]] = {"save": [], "load": []}
    for kind in seconds:
        method = getattr(strategy, f"{kind}_checkpoint")

        def timed(*call_args: Any, _method: Any = method, _kind: str = kind, **call_kwargs: Any) -> Any:
            start = time.perf_counter()
            result = _method(*call_args, **call_kwargs)
            seconds[_kind].append(time.perf_counter() - start)
            return result

        setattr(strategy, f"{kind}_checkpoint", timed)
    return seconds


def _summary_parameters(trainer: pl.Trainer, pl_module: pl.LightningModule) -> tuple[int, int]:
    """(total, trainable) parameters of the model summary: HybridStrategy's (collective), else Lightning's."""
    if hasattr(trainer.strategy, "pipeline"):  # HybridStrategy, imported lazily: the reference runs without it
        from lightning_hybrid.observe.parameter_counts import summarize_whole_model

        summary = summarize_whole_model(trainer, pl_module)
    else:
        summary = summarize(pl_module)
    return summary.total_parameters, summary.trainable_parameters


def _all_gather(value: Any) -> list[Any]:
    """Every rank's ``value``, on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def _rank_placement(trainer: pl.Trainer) -> dict[str, Any]:
    """Where this rank runs (as Lightning sees it) and the global ranks of its tensor-parallel and pipeline groups:
    what a multi-node test checks against the mesh order (tensor parallelism inside a node)."""
    placement: dict[str, Any] = {
        "global_rank": trainer.global_rank, "node_rank": trainer.node_rank, "local_rank": trainer.local_rank,
    }
    mesh = getattr(trainer.strategy, "device_mesh", None)  # HybridStrategy's 4-D mesh; DDP has none
    for dim in ("tp", "pp"):
        if mesh is not None and dim in (mesh.mesh_dim_names or ()):
            placement[f"{dim}_ranks"] = mesh[dim].mesh.flatten().tolist()
    return placement


def _gather_to_rank0(value: Any) -> list[Any]:
    """Every rank's ``value`` on rank 0 (``[value]`` in a single process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, gathered, dst=0)
    return gathered or []


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=ALL_MODEL_NAMES, default="gpt", help="or per --sweep entry")
    parser.add_argument("--reference", action="store_true", help="plain single-process Lightning (devices=1)")
    parser.add_argument("--strategy", choices=("hybrid", "ddp"), default="hybrid", help="parallel mode only")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel sharding degree")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    parser.add_argument("--dp-replicate", type=int, default=1, help="data-parallel replicas (HSDP when > 1)")
    parser.add_argument("--zero", type=int, default=None, help="HybridStrategy zero level (its default if unset)")
    parser.add_argument(
        "--strategy-kwargs", type=json.loads, default={}, help="extra HybridStrategy keyword arguments, as JSON"
    )
    parser.add_argument("--devices", type=int, default=1, help="processes per node")
    parser.add_argument("--num-nodes", type=int, default=1, help="Trainer(num_nodes=...): nodes of the launch")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps (max_steps)")
    parser.add_argument("--global-batch", type=int, default=8, help="samples per micro-step over all dp ranks")
    parser.add_argument("--num-samples", type=int, default=64, help="training sequences")
    parser.add_argument("--num-val-samples", type=int, default=16, help="validation sequences")
    parser.add_argument("--seed", type=int, default=42, help="model initialisation seed")
    parser.add_argument("--init", choices=("eager", "meta", "per_module", "init_module"), default="eager",
                        help="build the model eagerly in __init__, on the meta device in configure_model, eagerly"
                             " in configure_model followed by init_weights (see tests/models.py), or in __init__"
                             " under trainer.init_module(empty_init=True) (on the meta device)")
    parser.add_argument("--layers", type=int, default=None, help="number of blocks (the model's default if unset)")
    parser.add_argument("--precision", default="32-true", help="Lightning precision flag")
    parser.add_argument("--gradient-clip-val", type=float, default=GRADIENT_CLIP_VAL)
    parser.add_argument("--checkpoint-dir", type=Path, help="save a sharded checkpoint at every epoch end here")
    parser.add_argument("--ckpt-path", help='resume from this checkpoint ("last": the newest last*.ckpt there)')
    parser.add_argument("--kill", metavar="RANK:WHERE:N",
                        help="SIGKILL rank RANK at optimizer step N: when it starts (WHERE=step), in its forward"
                             " (forward), in optimizer.step (optimizer); or when it starts its N-th checkpoint save"
                             " (save). First attempt only under torchrun. To test crash handling")
    parser.add_argument("--stop", metavar="RANK:WHERE:N", help="like --kill with SIGSTOP: a rank that freezes")
    parser.add_argument("--slow-writes", type=float, default=0.0, metavar="SECONDS",
                        help="start every DCP write SECONDS late on every rank (a slow file system)")
    parser.add_argument("--monitor", action="store_true",
                        help="add ModelCheckpoint(monitor='val_loss') and EarlyStopping; record each rank's decisions")
    parser.add_argument("--user-parallel", action="store_true",
                        help="the module applies FSDP2 itself in configure_model (HybridStrategy must respect it)")
    parser.add_argument("--tensorboard", type=Path, help="log to a TensorBoardLogger in this folder, every batch")
    parser.add_argument("--module-kwargs", type=json.loads, default={},
                        help="extra LMLightningModule keyword arguments, as JSON (also per --sweep entry: 'module')")
    parser.add_argument(
        "--sweep", type=json.loads,
        help="JSON list of HybridStrategy keyword dicts: train once per entry in the same processes (saving"
             " OUT.<index>.pt, TensorBoard in TENSORBOARD/<index>), which saves a process start per entry",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    args.dp_size = args.dp * args.dp_replicate
    if args.global_batch % args.dp_size:
        parser.error(f"--global-batch {args.global_batch} is not divisible by dp * dp_replicate = {args.dp_size}")
    if args.reference and args.devices != 1:
        parser.error("--reference runs one process: use --devices 1 (the dp flags only set the data order)")
    if not args.reference and args.strategy == "ddp" and (args.tp, args.pp, args.dp_replicate) != (1, 1, 1):
        parser.error("--strategy ddp supports only data parallelism (--tp 1 --pp 1 --dp-replicate 1)")
    if args.reference and args.num_nodes != 1:
        parser.error("--reference runs one process: use --num-nodes 1")
    if not args.reference and args.strategy == "ddp" and args.devices * args.num_nodes != args.dp:
        parser.error("--strategy ddp needs --devices × --num-nodes == --dp")
    return args


def make_strategy(args: argparse.Namespace, sweep_entry: dict[str, Any], tensorboard: Path | None) -> Any:
    """The Trainer ``strategy`` argument for the requested mode. With TensorBoard, the strategy's monitor also
    draws the pipeline timeline every 4 batches and writes it as Chrome traces to ``<tensorboard>/traces``."""
    if args.reference:
        return "auto"
    if args.strategy == "ddp":
        return "ddp"
    from lightning_hybrid import HybridStrategy, ParallelMonitor  # lazily: the reference runs without the package

    kwargs: dict[str, Any] = dict(dp=args.dp, tp=args.tp, pp=args.pp, dp_replicate=args.dp_replicate)
    if tensorboard is not None:
        kwargs["monitor"] = ParallelMonitor(timeline_every_n_steps=4, chrome_trace_dir=tensorboard / "traces")
    if args.zero is not None:
        kwargs["zero"] = args.zero
    kwargs.update(args.strategy_kwargs)
    kwargs.update(sweep_entry)
    if isinstance(kwargs.get("cluster"), dict):  # JSON has no Cluster: its fields
        from lightning_hybrid.hardware import Cluster

        kwargs["cluster"] = Cluster(**kwargs["cluster"])
    return HybridStrategy(**kwargs)


def make_dataloaders(args: argparse.Namespace) -> tuple[DataLoader, DataLoader]:
    """Training and validation loaders; see the module docstring for why the reference orders data this way."""
    config = default_config(args.model)
    train_set = RandomTokenDataset(args.num_samples, config["seq_len"], config["vocab_size"], seed=1234)
    val_set = RandomTokenDataset(args.num_val_samples, config["seq_len"], config["vocab_size"], seed=4321)
    if args.reference:
        # Mirror Lightning's seed choice for the injected sampler (PL_GLOBAL_SEED is set by seed_everything).
        seed = int(os.getenv("PL_GLOBAL_SEED", 0))
        sampler = DistributedOrderSampler(train_set, args.dp_size, args.global_batch // args.dp_size, seed)
        train = DataLoader(train_set, batch_size=args.global_batch, sampler=sampler)
        # Validation order does not matter: val_loss is an equal-weight mean over all samples either way.
        val = DataLoader(val_set, batch_size=args.global_batch, shuffle=False)
    else:
        per_rank = args.global_batch // args.dp_size
        # No shuffle and no sampler here: Lightning injects the DistributedSampler described above.
        train = DataLoader(train_set, batch_size=per_rank, shuffle=False)
        val = DataLoader(val_set, batch_size=per_rank, shuffle=False)
    return train, val


def sweep_out(out: Path, index: int) -> Path:
    """Where entry ``index`` of ``--sweep`` saves its result."""
    return out.with_name(f"{out.stem}.{index}{out.suffix}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    # Tiny models: keep Lightning's advice about dataloader workers and small batches out of the logs.
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*number of training batches.*")
    if args.slow_writes:
        slow_down_writes(args.slow_writes)
    if args.sweep is None:
        train_once(args, {}, args.out, args.tensorboard)
    else:
        for index, entry in enumerate(args.sweep):
            tensorboard = args.tensorboard / str(index) if args.tensorboard else None
            train_once(args, entry, sweep_out(args.out, index), tensorboard)
    shut_down_process_group()
    # Everything is saved: skip the interpreter's teardown, in which gloo's threads occasionally abort a finished
    # rank ("terminate called without an active exception"), which the harness would report as a failed run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _process_group_count() -> int:
    """The process groups torch holds now (the default one included); it keeps no public list of them."""
    return len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else 0


def shut_down_process_group() -> None:
    """Leave together and close gloo's connections before exit; a rank exiting while its peers' gloo threads still
    serve the connection occasionally died in C++ ("terminate called without an active exception")."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def train_once(args: argparse.Namespace, sweep_entry: dict[str, Any], out: Path, tensorboard: Path | None) -> None:
    """One fit + test + predict; rank 0 saves the result to ``out``. A sweep entry's ``"model"`` replaces
    ``--model`` (several zoo families in one launch), a ``"checkpoint_dir"`` replaces ``--checkpoint-dir``; its other
    keys are HybridStrategy arguments."""
    start = time.perf_counter()
    # Forget graphs an earlier entry compiled: another layout's graphs would count towards Dynamo's recompile limit
    # (8 per code object), past which it silently runs eagerly.
    torch._dynamo.reset()
    recorded_entry = sweep_entry
    if {"model", "module", "checkpoint_dir"} & sweep_entry.keys():
        sweep_entry = {k: v for k, v in sweep_entry.items() if k not in ("model", "module", "checkpoint_dir")}
        module_kwargs = {**args.module_kwargs, **recorded_entry.get("module", {})}
        checkpoint_dir = recorded_entry.get("checkpoint_dir", args.checkpoint_dir)
        args = argparse.Namespace(**{**vars(args), "model": recorded_entry.get("model", args.model),
                                     "module_kwargs": module_kwargs,
                                     "checkpoint_dir": Path(checkpoint_dir) if checkpoint_dir else None})

    train, val = make_dataloaders(args)
    compiled = bool(args.module_kwargs.get("compile_blocks") or {**args.strategy_kwargs, **sweep_entry}.get("compile"))
    recorder = RecordCallback(count_linear_calls=not compiled)
    callbacks: list[pl.Callback] = [recorder]
    if args.checkpoint_dir is not None:
        callbacks.append(
            ModelCheckpoint(dirpath=args.checkpoint_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
        )
    if args.kill:
        callbacks.append(kill_switch(args.kill))
    if args.stop:
        callbacks.append(kill_switch(args.stop, signal.SIGSTOP))
    if args.monitor:
        # Any positive val_loss counts as diverged: stop at the first validation, on every rank or none.
        callbacks += [ModelCheckpoint(dirpath=args.out.parent / "best", monitor="val_loss", save_top_k=1),
                      EarlyStopping(monitor="val_loss", divergence_threshold=0.0)]
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=make_strategy(args, sweep_entry, tensorboard),
        precision=args.precision,
        max_steps=args.steps,
        gradient_clip_val=args.gradient_clip_val,
        accumulate_grad_batches=ACCUMULATE_GRAD_BATCHES,
        logger=TensorBoardLogger(tensorboard, name="", version=0) if tensorboard else False,
        log_every_n_steps=1,
        enable_checkpointing=args.checkpoint_dir is not None or args.monitor,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        deterministic=True,
        callbacks=callbacks,
    )
    checkpoint_seconds = _time_checkpoint_io(trainer.strategy)
    module = _lightning_module(args, trainer)
    trainer.fit(module, train_dataloaders=train, val_dataloaders=val, ckpt_path=args.ckpt_path)
    resumed_from = Path(trainer.ckpt_path) if trainer.ckpt_path else None  # "last" resolved; test() resets it
    decisions = _gather_to_rank0({
        "global_step": trainer.global_step,
        "should_stop": trainer.should_stop,
        "best_model_path": trainer.checkpoint_callback.best_model_path if args.monitor else "",
    })
    fit_step = trainer.global_step
    groups_after_fit = _process_group_count()
    placements = _gather_to_rank0(_rank_placement(trainer))
    # Evaluation after fit: test_step through the strategy, and predict_step (each rank predicts its data shard).
    test_loss = trainer.test(module, dataloaders=val, verbose=False)[0]["test_loss"]
    predictions = trainer.predict(module, dataloaders=val)
    process_groups = (groups_after_fit, _process_group_count())

    if trainer.global_rank == 0:
        first_step = recorder.start_step  # the resumed checkpoint's step (0 for a fresh run)
        expected = (args.steps - first_step) * ACCUMULATE_GRAD_BATCHES
        if not args.monitor and (fit_step != args.steps or len(recorder.losses) != expected):
            raise RuntimeError(
                f"ran {trainer.global_step} optimizer steps / {len(recorder.losses)} micro-batches,"
                f" expected {args.steps} / {expected}"
            )
        step_losses = [
            sum(recorder.losses[i : i + ACCUMULATE_GRAD_BATCHES]) / ACCUMULATE_GRAD_BATCHES
            for i in range(0, len(recorder.losses), ACCUMULATE_GRAD_BATCHES)
        ]
        wall_s = time.perf_counter() - start
        result = {
            "losses": recorder.losses,
            "tokens": recorder.tokens,
            "step_outputs": recorder.step_outputs,
            "step_losses": step_losses,
            "val_losses": recorder.val_losses,
            "params": recorder.params,
            "initial_params": recorder.initial_params,
            "rank_linear_calls": recorder.rank_linear_calls,
            "rank_compiled_frames": recorder.rank_compiled_frames,
            "rank_local_parameter_bytes": recorder.rank_local_parameter_bytes,
            "replica_max_abs_diff": recorder.replica_max_abs_diff,
            "hook_calls": recorder.hook_calls,
            "grads_after_backward": recorder.grads_after_backward,
            "learning_rates": recorder.learning_rates,
            "grad_norms": recorder.grad_norms,
            "metric_values": recorder.metric_values,
            "model_flops": recorder.model_flops,
            "rank_parameter_counts": recorder.rank_parameter_counts,
            "summary_parameters": recorder.summary_parameters,
            "rank_local_shapes": recorder.rank_local_shapes,
            "global_step": fit_step,
            "start_step": first_step,
            "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),  # the attempt under torchrun
            "resumed_from": str(resumed_from) if resumed_from else None,
            "checkpoint_seconds": checkpoint_seconds,
            "rank_decisions": decisions,
            "test_loss": float(test_loss),
            "prediction_shapes": [tuple(p.shape) for p in predictions],
            "process_groups": process_groups,  # after fit, after test + predict
            "tp_plan": getattr(trainer.strategy, "tp_plan_applied", {}),
            "auto_layout": str(trainer.strategy.layout_estimate.layout)
            if getattr(trainer.strategy, "layout_estimate", None) else None,
            "layout_note": getattr(trainer.strategy, "layout_note", None),
            "world_size": trainer.world_size,
            "num_nodes": trainer.num_nodes,
            # Single-device strategies have no cluster environment.
            "cluster_environment": type(getattr(trainer.strategy, "cluster_environment", None)).__name__,
            "rank_placement": placements,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "sweep_entry": recorded_entry,
            "wall_s": wall_s,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, out)
        print(
            f"[equivalence] {'reference' if args.reference else args.strategy} model={args.model}"
            f" dp={args.dp} tp={args.tp} pp={args.pp} dp_replicate={args.dp_replicate} devices={args.devices}"
            f" wall={wall_s:.1f}s step_losses={[round(x, 6) for x in step_losses]} val={recorder.val_losses}"
            f" replica_max_abs_diff={recorder.replica_max_abs_diff:.3g} -> {out}",
            flush=True,
        )


if __name__ == "__main__":
    main()
