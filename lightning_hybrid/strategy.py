"""``HybridStrategy``: data × tensor × pipeline parallelism for an unmodified LightningModule.

Lightning glue only, in the style of Lightning's own :class:`~lightning.pytorch.strategies.ModelParallelStrategy`
(which this class extends for process groups, launching and cluster environments): each hook is short and
delegates. The parallelisms are applied by :func:`lightning_hybrid.parallel.parallelize.parallelize`, an ``"auto"``
layout is chosen by :mod:`lightning_hybrid.planner.auto_layout`, pipelined steps run in
:mod:`lightning_hybrid.pipeline.runtime` and checkpoints are read and written by
:mod:`lightning_hybrid.glue.checkpoint_io`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from os import PathLike
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.types import ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid import _compat
from lightning_hybrid.checkpoint import async_save
from lightning_hybrid.checkpoint.data_position import make_resumable
from lightning_hybrid.glue import checkpoint_io, model_parallel_compat
from lightning_hybrid.glue.callbacks import add_strategy_callbacks
from lightning_hybrid.glue.precision import HybridPrecision, let_standalone_trainer_reach_precision, serving_plugin
from lightning_hybrid.glue.setup_batch import SetupBatch, setup_probe
from lightning_hybrid.glue.steps import RootStepRouter, free_stale_gradients, pipelined_backward, run_step_method
from lightning_hybrid.mesh import ParallelDims, lightning_view
from lightning_hybrid.observe.monitor import ParallelMonitor
from lightning_hybrid.observe.run_record import predict_fixed_layout, wants_prediction
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.options.keywords import keyword_options, options_from
from lightning_hybrid.options.recompute import CheckpointPlan
from lightning_hybrid.options.schedules import PipelineSchedule
from lightning_hybrid.expert_parallel.apply import AppliedExperts
from lightning_hybrid.parallel.fsdp import buffers_to_device
from lightning_hybrid.parallel.parallelize import AppliedPlan, find_blocks, parallelize, recording_construction
from lightning_hybrid.pipeline.metric_calls import sync_over
from lightning_hybrid.pipeline.runtime import Pipeline
from lightning_hybrid.planner.auto_layout import adopt_layout, choose_for_run
from lightning_hybrid.planner.layout import Estimate
from lightning_hybrid.probe.record import first_block_call
from lightning_hybrid.probe.step_probe import StepProbe
from lightning_hybrid.resilience.lost_rank import explain_lost_rank
from lightning_hybrid.tensor_parallel.loss_parallel import sharded_logits


@keyword_options(HybridOptions)
class HybridStrategy(ModelParallelStrategy):
    """Data-parallel sharding (FSDP2) × automatic tensor parallelism × pipeline parallelism for a LightningModule
    written without any of them.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy=HybridStrategy(tp=4, pp=8))
        trainer = Trainer(accelerator="cpu", devices=8, strategy=HybridStrategy(tp=2, pp=2, pp_schedule="gpipe"))
        trainer = Trainer(accelerator="cpu", devices=4, strategy="hybrid")   # dp=4
        trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))

    ``strategy.device_mesh`` has the named dimensions ``pp``, ``dp_replicate``, ``dp_shard`` and ``tp`` (and
    Lightning's ``data_parallel``, ``tensor_parallel`` as aliases); ``strategy.data_mesh`` flattens the data-parallel
    ranks. What the LightningModule sees as ``self.device_mesh``: :mod:`lightning_hybrid.glue.model_parallel_compat`.

    The options are declared once, as the fields of :class:`~lightning_hybrid.options.hybrid_options.HybridOptions`: the signature
    and the entries below are generated from them; :meth:`from_options` takes a built one. For a module that
    parallelizes itself, ``dp``, ``tp`` and ``pp`` mean what they mean to ``ModelParallelStrategy``.

    Arguments:
        process_group_backend: ``"nccl"`` or ``"gloo"``; chosen from the device when ``None``.
        timeout: Timeout of collective operations: also how long the other ranks can wait on a rank that vanished
            without closing its connections (a killed process's closed connections end the job at once).
        monitor: ``True`` (default) adds a :class:`~lightning_hybrid.observe.monitor.ParallelMonitor` (throughput,
            MFU, memory, pipeline bubble and timeline, communication, gradient norm) when the trainer has a logger
            or a progress bar; ``False`` adds none; a ``ParallelMonitor(...)`` instance is added as configured.
    """

    strategy_name = "hybrid"
    _async_saves: Optional[async_save.AsyncSaves] = None  # set at setup with async_checkpoint=True

    def __init__(
        self, *, process_group_backend: Optional[str] = None, timeout: Optional[timedelta] = default_pg_timeout,
        monitor: Union[bool, ParallelMonitor] = True, **option_values: Any,
    ) -> None:
        # The options' parameters (names, types, defaults, docs) are HybridOptions' fields, via @keyword_options.
        checked = options_from(HybridOptions, option_values, type(self))
        super().__init__(save_distributed_checkpoint=checked.save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        let_standalone_trainer_reach_precision(HybridStrategy)
        #: The validated arguments; an ``"auto"`` layout's chosen degrees replace the ``"auto"`` ones at setup.
        self.options: HybridOptions = checked
        if not isinstance(monitor, (bool, ParallelMonitor)):
            raise ValueError(f"HybridStrategy(monitor={monitor!r}) must be True, False or a ParallelMonitor(...).")
        self._monitor = monitor
        self.dims: Optional[ParallelDims] = None
        self._module_mesh: Any = None  # Lightning's 2-D mesh while the module may read it
        #: Data-parallel ranks (replicas × shards) flattened into one mesh; set when processes start.
        self.data_mesh: Optional[Any] = None
        #: This rank's pipeline stages and schedules (``None`` when pp=1); set at setup.
        self.pipeline: Optional[Pipeline] = None
        #: The tensor-parallel plan applied at setup, ``{module pattern: style}``, and its report per block structure.
        self.tp_plan_applied: AppliedPlan = AppliedPlan()
        #: With ep > 1: the expert layers split over the ep ranks (their exchange figures) and those kept whole.
        self.experts_applied: Optional[AppliedExperts] = None
        #: The cost model's estimate of the layout chosen for tp="auto"/pp="auto", or of the fixed layout when the
        #: monitor predicts (``ParallelMonitor(predict=True)``); ``None`` otherwise or where it cannot estimate.
        self.layout_estimate: Optional[Estimate] = None
        self.layout_note: Optional[str] = None  # how the estimate came about, or why there is none
        # The module this strategy parallelized: a later trainer.test()/predict() of it reuses it as fit left it.
        self._parallelized: Optional[torch.nn.Module] = None
        self._root_router = RootStepRouter()
        self._setup_batch: Optional[SetupBatch] = None  # the probe's, until the loop takes its loader over

    @classmethod
    def from_options(cls, options: HybridOptions, **arguments: Any) -> "HybridStrategy":
        """The strategy with ``options`` (typed and validated where they were built) and the other ``arguments``
        (``process_group_backend``, ``timeout``, ``monitor``): ``HybridStrategy.from_options(HybridOptions(tp=2))``."""
        return cls(**options.arguments(), **arguments)

    @property
    def pp_schedule(self) -> Optional[PipelineSchedule]:
        """The pipeline schedule (``None`` when pp=1; with pp="auto", set at setup)."""
        return self.options.pipeline_schedule

    @property
    def checkpoint_plan(self) -> Optional[CheckpointPlan]:
        """Which blocks are activation-checkpointed (``None``: none)."""
        return self.options.checkpointing

    # Meta-built values recorded around configure_model and init_module(empty_init=True) alike: Lightning warns that
    # init_module is unsupported by any strategy overriding model_sharded_context instead.
    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Iterator[None]:
        with super().tensor_init_context(empty_init), recording_construction():
            yield

    # ------------------------------------------------------------------------------------------ processes & mesh
    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Checked here, before any process is launched, so a wrong layout fails once and clearly.
        world_size = self.num_nodes * self.num_processes
        if self.options.chooses_layout:
            self.options.check_fixed_degrees_divide(world_size, self.num_nodes, self.num_processes)
        # With tp/pp="auto" these are Lightning's degrees, for configure_model; the layout is chosen at setup.
        self.dims = ParallelDims(world_size, **model_parallel_compat.mesh_degrees(self.options, world_size, self.num_processes))

    @override
    def setup_environment(self) -> None:
        _compat.setup_process_group(self)
        self._build_mesh(watched_view=True)

    def _build_mesh(self, watched_view: bool = False) -> None:
        assert self.dims is not None and self.lightning_module is not None
        mesh, self.data_mesh = self.dims.build_mesh(self.root_device.type)
        # Until setup the module sees Lightning's 2-D mesh; reading it means the module parallelizes itself.
        self._module_mesh = model_parallel_compat.watch_reads(lightning_view(mesh)) if watched_view else None
        _compat.publish_device_mesh(self, self.lightning_module, mesh, self._module_mesh)

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor-parallel ranks of one replica must see the same batch: the sampler counts data-parallel ranks only.
        return {"num_replicas": self.data_mesh.size(), "rank": self.data_mesh.get_local_rank()}

    @override
    def process_dataloader(self, dataloader: object) -> object:
        if self._setup_batch is not None:  # the loader whose first batch the setup probe took, continued
            dataloader = self._setup_batch.substitute(dataloader)
        return make_resumable(dataloader)  # its position saved as global samples consumed: mid-epoch resume

    @property
    def is_distributed(self) -> bool:
        return True

    # --------------------------------------------------------------------------------------------- precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else HybridPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        self._precision_plugin = serving_plugin(plugin)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        # Clipping adds the norm up over stages and ep ranks on this device: the one NCCL needs, also with offload.
        plugin = self.precision_plugin
        plugin.device, plugin.pipeline = self.root_device, self.pipeline  # type: ignore[attr-defined]
        plugin.experts = self.experts_applied  # type: ignore[attr-defined]

    # ------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        add_strategy_callbacks(trainer, self.options, self._monitor)
        self._async_saves = async_save.attach(trainer, self.options, self._async_saves, self._timeout)
        read_mesh = model_parallel_compat.stop_watching(self._module_mesh)
        if self._parallelized is self.model:  # a later trainer.test()/predict() reuses the module fit left
            _compat.publish_device_mesh(self, self.lightning_module, self.device_mesh)
        elif model_parallel_compat.parallelizes_itself(self.model, read_mesh, self.data_mesh.size()):
            self.options = model_parallel_compat.keep_given_degrees(self.options, self.dims)
            model_parallel_compat.accept_user_parallelism(self.model, self.options, self.root_device)
            self.precision_plugin.convert_module(self.model)
        else:
            self._parallelize(trainer)
        sync_over(self.lightning_module, self.data_mesh.get_group())  # torchmetrics: each replica counted once
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self.options.offload:
            _compat.optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, trainer: Trainer) -> None:
        self._parallelized = self.model
        _compat.publish_device_mesh(self, self.lightning_module, self.device_mesh)  # the module sees our names
        module = self.precision_plugin.convert_module(self.lightning_module)
        if not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)
        blocks = find_blocks(module, self.options)
        # The user's step on the first batch, recorded once for everything below that plans from it.
        self._setup_batch, probe = setup_probe(trainer, module, blocks, self.root_device)
        if self.options.chooses_layout:
            self._choose_layout(trainer, module, blocks, probe)
        elif wants_prediction(trainer):  # the fixed layout's estimate, for the monitor's plan/...
            self.layout_estimate, self.layout_note = predict_fixed_layout(trainer, self, module, blocks, probe)
        result = parallelize(module, blocks.path, blocks, self.device_mesh, self.dims, self.options,
                             data_mesh=self.data_mesh, precision=str(self.precision_plugin.precision),
                             device=self.root_device, probe=probe)
        self.pipeline, self.tp_plan_applied, self.experts_applied = result.pipeline, result.tp_plan, result.experts

    def _choose_layout(self, trainer: Trainer, module: Any, blocks: Any, probe: StepProbe) -> None:
        """tp/pp="auto": the layout chosen from the probe's first block call, adopted, and its mesh built."""
        self.layout_estimate, self.layout_note = choose_for_run(
            module, blocks.path, first_block_call(probe.record()), self.options, device=self.root_device,
            nodes=self.num_nodes, devices_per_node=self.num_processes, precision=str(self.precision_plugin.precision),
            accumulation=trainer.accumulate_grad_batches)
        rank_zero_info(f"HybridStrategy(tp={self.options.tp!r}, pp={self.options.pp!r}) {self.layout_note}")
        self.options = adopt_layout(self.options, self.layout_estimate.layout)
        self.dims = ParallelDims(world_size=self.world_size, **model_parallel_compat.mesh_degrees(
            self.options, self.world_size, self.num_processes))
        self._build_mesh()

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self.options.offload:
            return super().model_to_device()
        buffers_to_device(self.model, self.root_device)  # FSDP2 keeps offloaded shards in CPU memory

    # -------------------------------------------------------------------------------------------- steps
    # FSDP2 hooks the root's __call__; Lightning calls training_step directly (see lightning_hybrid.glue.steps).
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        free_stale_gradients(self.lightning_module.trainer, self.lightning_module)
        with self.precision_plugin.train_step_context():
            return run_step_method(self, self._root_router, "training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return run_step_method(self, self._root_router, "validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return run_step_method(self, self._root_router, "test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return run_step_method(self, self._root_router, "predict_step", *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            with sharded_logits(self.lightning_module, self.options.loss_parallel):  # the loss's backward too
                return super().backward(closure_loss, optimizer, *args, **kwargs)
        return pipelined_backward(self, closure_loss)  # the schedule ran backward inside training_step

    # ------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self.options.save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        optimizer = optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return checkpoint_io.optimizer_state(self.model, optimizer)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Union[str, PathLike],
                        storage_options: Optional[Any] = None) -> None:
        if not self.options.save_distributed_checkpoint or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        checkpoint_io.save_checkpoint(checkpoint, Path(self.broadcast(filepath)), self.global_rank, self.barrier,
                                     self._async_saves)

    @override
    def remove_checkpoint(self, filepath: Union[str, PathLike]) -> None:
        async_save.wait_if_writing(self._async_saves, filepath)  # else its publish would bring it back
        super().remove_checkpoint(filepath)

    @override
    def load_checkpoint(self, checkpoint_path: Union[str, PathLike], weights_only: Optional[bool] = None) -> dict[str, Any]:
        assert self.model is not None and self.lightning_module is not None
        return checkpoint_io.load_checkpoint(Path(self.broadcast(checkpoint_path)), self.model, self.optimizers,
                                            strict=self.lightning_module.strict_loading, weights_only=weights_only)

    @override
    def on_exception(self, exception: BaseException) -> None:  # a rank that died, told plainly to the survivors
        explain_lost_rank(exception, self.lightning_module, self.global_rank)

    # ------------------------------------------------------------------------------------------- collectives
    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Tensor:
        # Tensor-parallel ranks hold copies of one replica's values: over WORLD a "sum" would count each tp times.
        if group is None and self.data_mesh is not None:
            group = self.data_mesh.get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Checkpoint and early-stopping decisions must agree on every rank of the job, not just one data group.
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = super().reduce(flag, group=_group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)


StrategyRegistry.register(HybridStrategy.strategy_name, HybridStrategy,
                          description="FSDP2 × automatic tensor parallelism", override=True)
