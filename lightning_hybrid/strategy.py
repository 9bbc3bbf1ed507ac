"""``HybridStrategy``: data × tensor (× pipeline) parallelism for an unmodified LightningModule.

Lightning glue only: the parallelisms live in :mod:`lightning_hybrid.parallelize`, :mod:`~lightning_hybrid.sharding`
and :mod:`~lightning_hybrid.tensor_parallel`; process groups, launching, DCP checkpoints and cluster environments
come from Lightning's :class:`~lightning.pytorch.strategies.ModelParallelStrategy`, which this class extends.
"""

from __future__ import annotations

import logging
import math
import shutil
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Sequence, Union

import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.load import _METADATA_FILENAME
from lightning.fabric.utilities.distributed import group as _group
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH, ReduceOp
from lightning.pytorch import Trainer
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from torch.utils._pytree import tree_map
from typing_extensions import override

from lightning_hybrid.activation_checkpointing import ActivationCheckpointing, CheckpointPlan, apply_activation_checkpointing
from lightning_hybrid.auto_layout import (
    AUTO,
    LayoutRequest,
    Obstacles,
    choose_layout,
    describe_choice,
    detect_cluster,
    measure_model,
    tensor_parallel_obstacles,
)
from lightning_hybrid.checkpoint import (
    MODULE_STATE_KEY,
    key_mismatch_message,
    load_full,
    load_sharded,
    partial_checkpoint_path,
    publish_checkpoint,
    save_sharded,
    saved_module_keys,
)
from lightning_hybrid.blocks import capture_block_call, find_block_list
from lightning_hybrid.initialization import materialize_meta_module
from lightning_hybrid.monitoring import ParallelMonitor
from lightning_hybrid.mesh import DATA_DIMS, DATA_SHARD, PIPELINE, TENSOR, ParallelDims, check_degrees
from lightning_hybrid.parallelize import apply_tensor_parallel
from lightning_hybrid.planning import Cluster, Estimate, Layout, ModelShape, divisors
from lightning_hybrid.resume import SamplerEpochOnResume
from lightning_hybrid.pipeline import Pipeline, PipelineSchedule, make_shadows, muted_logs
from lightning_hybrid.precision import HybridHalfPrecision, HybridPrecision, precision_plugin_for
from lightning_hybrid.sharding import FSDPOptions, apply_fsdp, check_zero_level, mixed_precision_policy
from lightning_hybrid.stage_split import plan_split, trace_step
from lightning_hybrid.tensor_parallel import PlanEntry

log = logging.getLogger(__name__)


class HybridStrategy(ModelParallelStrategy):
    """Data-parallel sharding (FSDP2) × automatic tensor parallelism × pipeline parallelism for a LightningModule
    written without any of them.

    Example::

        trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy=HybridStrategy(tp=4, pp=8))
        trainer = Trainer(accelerator="cpu", devices=8, strategy=HybridStrategy(tp=2, pp=2, pp_schedule="gpipe"))
        trainer = Trainer(accelerator="cpu", devices=4, strategy="hybrid")   # dp=4
        trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))

    The device mesh has the named dimensions ``pp``, ``dp_replicate``, ``dp_shard`` and ``tp``; the LightningModule
    reaches it as ``self.device_mesh``. ``strategy.data_mesh`` flattens the data-parallel ranks (replicas × shards).

    Arguments:
        dp: Data-parallel sharding degree; ``"auto"`` takes what the world size leaves.
        tp: Tensor-parallel degree. The linear layers of the model's repeated blocks are paired into
            column-/row-parallel layers by how data flows between them; see :mod:`lightning_hybrid.tensor_parallel`.
            ``"auto"``: chosen at setup (see below).
        pp: Pipeline-parallel degree. The block list is cut into ``pp × virtual_stages`` stages balanced by
            traced FLOPs; modules outside the blocks go with the stage that runs them. The model's own step runs
            on every stage (see :mod:`lightning_hybrid.pipeline`). ``"auto"``: chosen at setup.
            With ``tp="auto"`` and/or ``pp="auto"`` the strategy measures the module (parameter counts, and heads
            and sequence length from the first block's attention on the first batch) and the hardware, estimates
            every layout the other arguments leave open with :mod:`lightning_hybrid.planning`'s cost model, and
            takes the one with the most tokens per second that fits in memory; it logs the choice with its
            predicted memory and keeps the estimate in ``strategy.layout_estimate``. See
            :mod:`lightning_hybrid.auto_layout`.
        dp_replicate: Replicas of the sharded model (HSDP): parameters are sharded within a replica and gradients
            all-reduced across replicas.
        zero: 3 (default) shards parameters between forward and backward too; 2 keeps them gathered for the step
            (see :mod:`lightning_hybrid.sharding`). Zero-bubble pipeline schedules need 2 and default to it.
        tp_plan: ``{module name pattern: "colwise" | "rowwise" | "replicate" | ParallelStyle}``, names from the
            LightningModule (``fnmatch`` patterns, e.g. ``"model.blocks.*.attn.qkv"``). Overrides or completes
            the automatic plan; entries outside the blocks are applied as given.
        blocks: Name of the container of repeated blocks (found automatically when ``None``).
        pp_schedule: ``"1f1b"`` (default), ``"gpipe"``, ``"interleaved_1f1b"``, ``"looped_bfs"``,
            ``"interleaved_zero_bubble"``, ``"zbv_zero_bubble"`` or ``"dualpipev"`` (torch's schedules).
        microbatches: Microbatches per step (each rank's batch is split into this many); default
            ``pp × virtual_stages``. The batch size must be divisible by it.
        virtual_stages: Stages per pipeline rank: 1 for ``gpipe``/``1f1b``, default 2 for the others.
        pp_split: Blocks per stage (``pp × virtual_stages`` numbers), overriding the balanced split.
        activation_checkpointing: ``None`` (default), ``"every"`` block, an integer N (every N-th block) or
            ``"selective"`` (every block, keeping matmul and attention outputs); see
            :mod:`lightning_hybrid.activation_checkpointing`.
        offload: Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
            ``CPUOffloadPolicy``); parameters are copied to the device for each block's forward and backward and
            the optimizer steps on CPU.
        verify_tp_plan: Run one block unsharded and sharded at setup and refuse a plan whose outputs differ.
        save_distributed_checkpoint: One DCP shard per rank (``True``) or one consolidated file on rank 0.
        process_group_backend: ``"nccl"`` or ``"gloo"``; chosen from the device when ``None``.
        timeout: Timeout of collective operations: also how long the other ranks can wait on a rank that vanished
            without closing its connections (a killed process's closed connections end the job at once).
        monitor: ``True`` (default) adds a :class:`~lightning_hybrid.monitoring.ParallelMonitor` (throughput, MFU,
            memory, pipeline bubble and timeline, communication, gradient norm) when the trainer has a logger or a
            progress bar; ``False`` adds none; a ``ParallelMonitor(...)`` instance is added as configured.
        cluster: The hardware an ``"auto"`` layout is planned for (a :class:`~lightning_hybrid.planning.Cluster`
            whose nodes × GPUs per node match the Trainer's); by default GPUs are recognised by name and CPUs probed.
    """

    strategy_name = "hybrid"

    def __init__(
        self,
        dp: Union[int, Literal["auto"]] = "auto",
        tp: Union[int, Literal["auto"]] = 1,
        pp: Union[int, Literal["auto"]] = 1,
        dp_replicate: int = 1,
        zero: Optional[int] = None,
        tp_plan: Optional[Mapping[str, PlanEntry]] = None,
        blocks: Optional[str] = None,
        pp_schedule: str = "1f1b",
        microbatches: Optional[int] = None,
        virtual_stages: Optional[int] = None,
        pp_split: Optional[Sequence[int]] = None,
        activation_checkpointing: ActivationCheckpointing = None,
        offload: bool = False,
        verify_tp_plan: bool = True,
        save_distributed_checkpoint: bool = True,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        monitor: Union[bool, ParallelMonitor] = True,
        cluster: Optional[Cluster] = None,
    ) -> None:
        super().__init__(
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        _let_pytorch_lightning_reach_our_message()
        self._degrees = {"dp": dp, "tp": tp, "pp": pp, "dp_replicate": dp_replicate}
        # fail fast on bad values; the world size is checked once it is known
        check_degrees(**self._degrees, auto=("dp", "tp", "pp"))
        #: The pipeline schedule (``None`` when pp=1; with pp="auto", set at setup).
        self.pp_schedule: Optional[PipelineSchedule] = None
        self._pipeline_options = (pp_schedule, virtual_stages, microbatches)
        if pp == AUTO:
            _check_pipeline_may_be_chosen(pp_split, save_distributed_checkpoint)
        elif pp > 1:
            self.pp_schedule = PipelineSchedule.resolve(pp_schedule, pp, virtual_stages, microbatches)
        elif microbatches is not None or virtual_stages is not None or pp_split is not None:
            raise ValueError("HybridStrategy(microbatches=, virtual_stages=, pp_split=) are pipeline options: set pp > 1.")
        if pp != AUTO and pp > 1 and not save_distributed_checkpoint:
            raise ValueError(_CONSOLIDATED_WITH_PIPELINE)
        self._pp_split = pp_split
        self._zero = check_zero_level(_zero_level(zero, self.pp_schedule))
        #: Which blocks are activation-checkpointed (``None``: none).
        self.checkpoint_plan = CheckpointPlan.resolve(activation_checkpointing)
        _check_checkpointing_with_schedule(self.checkpoint_plan, self.pp_schedule)
        #: What an "auto" layout is chosen from (``None`` when tp and pp are given).
        self._layout_request = _layout_request(self._degrees, self._zero, self.checkpoint_plan, pp_schedule,
                                               microbatches, virtual_stages, cluster)
        self._cluster = cluster
        #: The cost model's estimate of the layout chosen for tp="auto"/pp="auto" (``None`` otherwise).
        self.layout_estimate: Optional[Estimate] = None
        if not isinstance(offload, bool):
            raise ValueError(f"HybridStrategy(offload={offload!r}) is invalid: pass True (CPU offload) or False.")
        self._offload = offload
        if not isinstance(monitor, (bool, ParallelMonitor)):
            raise ValueError(f"HybridStrategy(monitor={monitor!r}) must be True, False or a ParallelMonitor(...).")
        self._monitor = monitor
        #: This rank's pipeline stages and schedules (``None`` when pp=1); set at setup.
        self.pipeline: Optional[Pipeline] = None
        self._tp_plan = dict(tp_plan or {})
        self._blocks_path = blocks
        self._verify_tp_plan = verify_tp_plan
        self.dims: Optional[ParallelDims] = None
        #: Data-parallel ranks (replicas × shards) flattened into one mesh; set when processes start.
        self.data_mesh: Optional[DeviceMesh] = None
        # The module this strategy parallelized: a later trainer.test()/predict() of it reuses it as fit left it.
        self._parallelized: Optional[torch.nn.Module] = None
        #: The tensor-parallel plan applied at setup, ``{module name pattern: style}``.
        self.tp_plan_applied: dict[str, str] = {}

    # ------------------------------------------------------------------------------------------ processes & mesh
    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Checked here, before any process is launched, so a wrong layout fails once and clearly.
        world_size = self.num_nodes * self.num_processes
        if self._layout_request is None:
            self.dims = ParallelDims(world_size=world_size, **self._degrees)
        else:
            _check_fixed_degrees_divide(world_size, self._degrees, self._cluster, self.num_nodes, self.num_processes)

    @override
    def setup_environment(self) -> None:
        self._setup_distributed()
        if self.dims is not None:  # an "auto" layout builds its mesh at setup, once it is chosen
            self._build_mesh()

    def _build_mesh(self) -> None:
        assert self.dims is not None and self.lightning_module is not None
        self._device_mesh, self.data_mesh = self.dims.build_mesh(self.root_device.type)
        self.lightning_module._device_mesh = self._device_mesh

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Tensor-parallel ranks of one replica must see the same batch: the sampler counts data-parallel ranks only.
        return {"num_replicas": self.data_mesh.size(), "rank": self.data_mesh.get_local_rank()}

    @property
    def is_distributed(self) -> bool:
        return True

    # --------------------------------------------------------------------------------------------- precision
    @property  # type: ignore[override]
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else HybridPrecision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Optional[Precision]) -> None:
        if type(plugin).__module__.startswith("pytorch_lightning."):
            raise ValueError(_STANDALONE_PACKAGE_MESSAGE)
        # Lightning hands ModelParallelStrategy an autocast plugin for bf16-mixed; FSDP2's policy does that job here.
        if plugin is not None and not isinstance(plugin, (HybridPrecision, HybridHalfPrecision)):
            plugin = precision_plugin_for(getattr(plugin, "precision", "32-true"))
        self._precision_plugin = plugin

    # ------------------------------------------------------------------------------------------------- setup
    @override
    def setup(self, trainer: Trainer) -> None:
        assert self.model is not None and self.accelerator is not None
        self.accelerator.setup(trainer)
        if not any(isinstance(callback, SamplerEpochOnResume) for callback in trainer.callbacks):
            trainer.callbacks.append(SamplerEpochOnResume())
        self._add_monitor(trainer)
        if self._parallelized is self.model:
            pass  # a later trainer.test()/predict() reuses the module as fit left it
        elif not _already_parallel(self.model):
            self._parallelize(trainer)
        else:
            if self._offload or self.checkpoint_plan is not None:
                raise ValueError(
                    "HybridStrategy(offload=, activation_checkpointing=) are applied while the strategy shards the"
                    " model, but configure_model() already applied FSDP2/tensor parallelism itself. Either let the"
                    " strategy parallelize (build the model in configure_model without fully_shard/parallelize_module)"
                    " or pass offload_policy=CPUOffloadPolicy() to your fully_shard calls and checkpoint your blocks"
                    " there."
                )
            rank_zero_info("HybridStrategy: configure_model() already parallelized the model; applying nothing more.")
        self._materialize()
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING and not self._offload:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _add_monitor(self, trainer: Trainer) -> None:
        if self._monitor is False or any(isinstance(callback, ParallelMonitor) for callback in trainer.callbacks):
            return
        if isinstance(self._monitor, ParallelMonitor):
            trainer.callbacks.append(self._monitor)
        elif trainer.loggers or trainer.progress_bar_callback is not None:
            trainer.callbacks.append(ParallelMonitor())

    def _materialize(self) -> None:
        """Give a meta-device model its values now that each rank holds only its shards (see
        :mod:`lightning_hybrid.initialization`). The seed is rank 0's, so every rank draws the same values."""
        assert self.model is not None
        seed = self.broadcast(torch.initial_seed())
        parameter_device = torch.device("cpu") if self._offload else self.root_device
        if materialize_meta_module(self.model, parameter_device, seed):
            rank_zero_info(f"HybridStrategy: initialized the meta-device model per module from seed {seed}.")

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if not self._offload:
            return super().model_to_device()
        # FSDP2 keeps offloaded shards in CPU memory and copies them over per block; only buffers move.
        for module in self.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(self.root_device)

    def _parallelize(self, trainer: Trainer) -> None:
        """Pipeline split, then tensor parallelism, then FSDP2 (see :mod:`lightning_hybrid.parallelize` for why)."""
        self._parallelized = self.model
        module = self.lightning_module
        assert module is not None
        module = self.precision_plugin.convert_module(module)
        if not any(p.is_meta for p in module.parameters()):
            module.to(self.root_device)
        blocks_path, blocks = find_block_list(module, self._blocks_path)
        block_call = None
        if self.dims is None:
            block_call = self._choose_layout(trainer, module, blocks_path, blocks)
        assert self.dims is not None
        mesh = self.device_mesh
        # 1. pipeline split: this rank keeps only its stages' blocks (and the modules around them it runs)
        owned = list(range(len(blocks)))
        if self.dims.pp > 1:
            self.pipeline = self._split_into_stages(trainer, module, blocks_path, blocks)
            owned = [i for stage in self.pipeline.stage_ids for i in self.pipeline.split.block_range(stage)]
        # 2. tensor parallelism
        if self.dims.tp > 1 or self._tp_plan:
            block_call = block_call or capture_block_call(blocks[0], lambda: self._run_first_step(trainer))
            self.tp_plan_applied = apply_tensor_parallel(
                module, blocks_path, blocks, block_call, mesh[TENSOR], tp_plan=self._tp_plan,
                verify=self._verify_tp_plan, apply_to=[blocks[i] for i in owned],
            )
            rank_zero_info(f"HybridStrategy: tensor-parallel plan (tp={self.dims.tp}): {self.tp_plan_applied}")
        # 3. activation checkpointing, inside the FSDP units so their hooks gather parameters for the recompute
        if self.checkpoint_plan is not None:
            count = apply_activation_checkpointing(((i, blocks[i]) for i in owned), self.checkpoint_plan)
            rank_zero_info(f"HybridStrategy: activation checkpointing {self.checkpoint_plan} on {count} blocks")
        # 4. FSDP2 last: it shards whatever parameters it finds, DTensors included
        fsdp_mesh = mesh[DATA_DIMS] if self.dims.dp_replicate > 1 else mesh[DATA_SHARD]
        precision = str(self.precision_plugin.precision)
        fsdp_options = FSDPOptions(zero=self._zero, mixed_precision=mixed_precision_policy(precision), offload=self._offload)
        # With one data-parallel rank FSDP2 would shard nothing yet make every parameter a DTensor and run its hooks
        # per block (measured: +15 % step time at tp=2, +20 % at pp=2, BENCHMARKS.md); it stays for what only it
        # provides here: bf16-mixed's policy and CPU offload.
        sharded = fsdp_mesh.size() > 1 or self._offload or precision == "bf16-mixed"
        if self.pipeline is not None:
            self._install_stages(blocks, fsdp_mesh, fsdp_options if sharded else None)
        elif sharded:
            apply_fsdp(module, blocks, fsdp_mesh, fsdp_options)
        mesh_shape = dict(zip(mesh.mesh_dim_names or (), mesh.shape))
        if sharded:
            rank_zero_info(f"HybridStrategy: FSDP2 (ZeRO-{self._zero}) over {len(blocks)} blocks of '{blocks_path}',"
                           f" mesh {mesh_shape}")
        else:
            rank_zero_info(f"HybridStrategy: one data-parallel rank, no FSDP2 (mesh {mesh_shape})")

    def _choose_layout(self, trainer: Trainer, module: Any, blocks_path: str, blocks: Any) -> tuple[tuple, dict]:
        """Measure the module on the first batch and the hardware, choose the layout with the cost model (rank 0's
        choice, broadcast), and build its mesh. Returns the first block's captured call for tensor parallelism."""
        assert self._layout_request is not None
        request, precision = self._layout_request, str(self.precision_plugin.precision)
        block_call = capture_block_call(blocks[0], lambda: self._run_first_step(trainer))
        model, tokens, obstacles = self._measure_module(module, blocks_path, block_call)
        if self._cluster is not None:
            cluster, hardware = self._cluster, "as given (cluster=)"
        else:
            cluster, hardware = detect_cluster(self.root_device, self.num_nodes, self.num_processes, precision)
        try:
            ranked = choose_layout(model, cluster, request, tokens // model.seq_len, precision,
                                   trainer.accumulate_grad_batches, obstacles)
            outcome: Union[str, tuple[Estimate, str]] = (ranked[0], describe_choice(ranked, cluster, hardware))
        except ValueError as error:
            outcome = str(error)
        outcome = self.broadcast(outcome)  # one choice for all ranks, even where probes measured differently
        if isinstance(outcome, str):
            raise ValueError(outcome)
        self.layout_estimate, description = outcome
        rank_zero_info(f"HybridStrategy(tp={request.tp!r}, pp={request.pp!r}) {description}")
        self._adopt_layout(self.layout_estimate.layout)
        return block_call

    def _measure_module(self, module: Any, blocks_path: str,
                        block_call: tuple[tuple, dict]) -> tuple[ModelShape, int, Obstacles]:
        """The module's shape, the tokens of its first batch, and the layouts it cannot take."""
        assert self._layout_request is not None
        accelerator_rng = [self.root_device] if self.root_device.type == "cuda" else []
        with torch.random.fork_rng(devices=accelerator_rng):  # measuring must not shift the user's random streams
            model, tokens = measure_model(module, blocks_path, block_call)
            degrees = divisors(self.world_size)[1:]  # tp = 1 needs no check
            if self._layout_request.tp != AUTO:
                degrees = [int(self._layout_request.tp)]
            check_on = self.root_device.type if self._verify_tp_plan else None
            obstacles = Obstacles(
                tensor_parallel=tensor_parallel_obstacles(module, blocks_path, block_call, degrees, self._tp_plan,
                                                          check_on),
                pipeline=None if module.automatic_optimization else _PIPELINE_NEEDS_AUTOMATIC_OPTIMIZATION)
        return model, tokens, obstacles

    def _adopt_layout(self, layout: Layout) -> None:
        """Take a chosen layout's degrees and pipeline schedule, and build its mesh."""
        self._degrees = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "dp_replicate": layout.dp_replicate}
        self.dims = ParallelDims(world_size=self.world_size, **self._degrees)
        if layout.pp > 1:
            schedule, virtual_stages, microbatches = self._pipeline_options
            self.pp_schedule = PipelineSchedule.resolve(schedule, layout.pp, virtual_stages, microbatches)
            _check_checkpointing_with_schedule(self.checkpoint_plan, self.pp_schedule)
        self._build_mesh()

    def _split_into_stages(self, trainer: Trainer, module: Any, blocks_path: str, blocks: Any) -> Pipeline:
        """Trace one step, split it into stages, and keep meta-device stand-ins of every unit."""
        assert self.pp_schedule is not None
        if not module.automatic_optimization:
            raise ValueError(f"HybridStrategy(pp > 1): {_PIPELINE_NEEDS_AUTOMATIC_OPTIMIZATION}. Set"
                             " self.automatic_optimization = True or use pp=1.")
        trace = trace_step(module, blocks, lambda: self._run_first_step(trainer))
        split = plan_split(module, blocks_path, blocks, trace, self.pp_schedule.num_stages, self._pp_split)
        rank_zero_info(
            f"HybridStrategy: pipeline {self.pp_schedule.name} over {split.num_stages} stages, blocks per stage"
            f" {split.blocks_per_stage}, {self.pp_schedule.microbatches} microbatches"
        )
        compute_dtype = mixed_precision_policy(str(self.precision_plugin.precision)).param_dtype
        shadows = make_shadows(module, split, compute_dtype)
        return Pipeline(
            module, split, self.pp_schedule, self.device_mesh[PIPELINE], self.root_device, shadows, compute_dtype
        )

    def _install_stages(self, blocks: Any, fsdp_mesh: DeviceMesh, fsdp_options: Optional[FSDPOptions]) -> None:
        """Build this rank's stage modules; with ``fsdp_options``, FSDP2 per block of each local stage, each stage
        module the root of its own units."""
        assert self.pipeline is not None
        self.pipeline.install()
        for stage, stage_module in self.pipeline.stage_modules.items():
            stage_blocks = [blocks[i] for i in self.pipeline.split.block_range(stage)]
            if fsdp_options is not None:
                apply_fsdp(stage_module, stage_blocks, fsdp_mesh, fsdp_options)
        self.pipeline.route_units()
        self.precision_plugin.pipeline_group = self.device_mesh[PIPELINE].get_group()  # type: ignore[attr-defined]

    def _run_first_step(self, trainer: Trainer) -> None:
        """Run the user's step on the first batch with ``self.log`` muted: tensor-parallel planning stops it at the
        first block to see that block's inputs; the pipeline split runs it to the end to see every module."""
        module = self.lightning_module
        assert module is not None
        loop, step_name = {
            TrainerFn.FITTING: (trainer.fit_loop, "training_step"),
            TrainerFn.VALIDATING: (trainer.validate_loop, "validation_step"),
            TrainerFn.TESTING: (trainer.test_loop, "test_step"),
            TrainerFn.PREDICTING: (trainer.predict_loop, "predict_step"),
        }[trainer.state.fn]
        batch = _first_batch(loop._data_source.dataloader())
        if any(p.is_meta for p in module.parameters()):
            batch = tree_map(lambda v: v.to("meta") if isinstance(v, Tensor) else v, batch)
        else:
            batch = module._apply_batch_transfer_handler(batch, self.root_device)
        with muted_logs(module):
            getattr(module, step_name)(batch, 0)

    # -------------------------------------------------------------------------------------------- steps
    # FSDP2 hooks the root's __call__; Lightning calls training_step directly, so route steps through __call__.
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._through_call("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._through_call("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._through_call("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._through_call("predict_step", *args, **kwargs)

    def _through_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None
        if self.pipeline is not None:
            return self.pipeline.run_step(method, *args, **kwargs)
        if isinstance(module, FSDPModule):
            return self._forward_redirection(module, module, method, *args, **kwargs)
        return getattr(module, method)(*args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Any], *args: Any, **kwargs: Any) -> Tensor:
        if self.pipeline is None:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        # The schedule already ran every microbatch's backward inside training_step; Lightning's zero_grad came
        # after that, so the step's gradients are added now, where loss.backward() would have put them.
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        self.pipeline.add_step_gradients()
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    # ------------------------------------------------------------------------------------------- checkpoints
    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        assert self.model is not None
        optimizer = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        return get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER_STATE)

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Optional[Any] = None) -> None:
        if not self._save_distributed_checkpoint or storage_options is not None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        # Written under a temporary name and renamed when complete: a crash mid-save leaves only `<name>.partial`,
        # which neither a path nor ckpt_path="last" (ModelCheckpoint's last*.ckpt) ever resolves to.
        path = Path(self.broadcast(filepath))
        partial = partial_checkpoint_path(path)
        if self.global_rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # left by an earlier save that crashed
            partial.mkdir(parents=True)
        self.barrier()
        shards = {MODULE_STATE_KEY: checkpoint.pop("state_dict")}
        shards.update({f"optimizer_{i}": state for i, state in enumerate(checkpoint.pop("optimizer_states", []))})
        save_sharded(shards, partial)  # returns once every rank's shard and the DCP metadata are written
        if self.global_rank == 0:
            torch.save(checkpoint, partial / _METADATA_FILENAME)
            publish_checkpoint(partial, path)
        self.barrier()

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: Optional[bool] = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        assert self.model is not None and self.lightning_module is not None
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint {path} does not exist.")
        try:
            if path.is_dir():
                self._load_sharded(path)
                return torch.load(path / _METADATA_FILENAME, weights_only=weights_only)
            # Memory-mapped: every rank reads only the slices it keeps, not a private copy of the whole file.
            checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)
            load_full(self.model, self.optimizers, checkpoint, strict=self.lightning_module.strict_loading, path=path)
            return checkpoint
        except KeyError:
            raise
        # DCP gathers every rank's read errors into a CheckpointException (a BaseException) raised on all ranks.
        except (Exception, CheckpointException) as error:
            lines = str(error).strip().splitlines() or [""]
            cause = lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
            raise RuntimeError(
                f"Could not read the checkpoint {path}: {type(error).__name__}: {cause}. The checkpoint is incomplete"
                " or corrupted (e.g. a save that was interrupted); resume from an earlier one. Nothing was written."
            ) from error

    def _load_sharded(self, path: Path) -> None:
        assert self.model is not None and self.lightning_module is not None
        saved = saved_module_keys(path)
        module_state = get_model_state_dict(self.model)
        # Pipeline ranks hold different parameters: compare the checkpoint with the whole model's names.
        held: list[set[str]] = [set() for _ in range(self.world_size)]
        torch.distributed.all_gather_object(held, set(module_state))
        missing, unexpected = set().union(*held) - saved, saved - set().union(*held)
        if self.lightning_module.strict_loading and (missing or unexpected):
            raise KeyError(key_mismatch_message(path, missing, unexpected))
        module_state = {name: value for name, value in module_state.items() if name in saved}
        load_sharded({MODULE_STATE_KEY: module_state}, path)
        self.model.load_state_dict(module_state, strict=False)
        for index, optimizer in enumerate(self.optimizers):
            key = f"optimizer_{index}"
            optimizer_state = {key: get_optimizer_state_dict(self.model, optimizer, options=_FLAT_OPTIMIZER_STATE)}
            load_sharded(optimizer_state, path)
            set_optimizer_state_dict(self.model, optimizer, optimizer_state[key], options=_FLAT_OPTIMIZER_STATE)

    # ------------------------------------------------------------------------------------------- collectives
    @override
    def reduce(
        self, tensor: Union[Tensor, Any], group: Optional[Any] = None, reduce_op: Optional[Union[ReduceOp, str]] = "mean"
    ) -> Tensor:
        # Tensor-parallel ranks hold copies of one replica's values: reducing over WORLD would count each replica
        # tp times, which a "sum" would show. Default to the data-parallel group.
        if group is None and self._device_mesh is not None:
            group = self.data_mesh.get_group()
        return super().reduce(tensor, group=group, reduce_op=reduce_op)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        # Checkpoint and early-stopping decisions must agree on every rank of the job, not just one data group.
        flag = torch.tensor(int(decision), device=self.root_device)
        flag = super().reduce(flag, group=_group.WORLD, reduce_op=ReduceOp.SUM)
        return bool(flag == self.world_size) if all else bool(flag)


#: Optimizer state keyed per parameter name (``state.<name>.<key>``, ``param_groups.<name>.<key>``), not per group:
#: pipeline ranks hold different parameters, so one group's list of names differs between ranks and would be
#: saved from one rank only; per-name keys are unique and load under any other layout or stage split.
_FLAT_OPTIMIZER_STATE = StateDictOptions(flatten_optimizer_state_dict=True, cpu_offload=True)


_STANDALONE_PACKAGE_MESSAGE = (
    "HybridStrategy is built on `lightning.pytorch` (the `lightning` package) and was given to a Trainer of the"
    " standalone `pytorch_lightning` package, whose classes are separate. Import Trainer and LightningModule from"
    " lightning.pytorch: `from lightning.pytorch import Trainer, LightningModule`."
)


def _let_pytorch_lightning_reach_our_message() -> None:
    """Make a ``pytorch_lightning.Trainer`` accept the strategy far enough to hand it a precision plugin, where
    :data:`_STANDALONE_PACKAGE_MESSAGE` is raised; otherwise it rejects it with a generic "invalid strategy"."""
    standalone = sys.modules.get("pytorch_lightning.strategies")
    if standalone is not None:
        standalone.Strategy.register(HybridStrategy)


_PIPELINE_NEEDS_AUTOMATIC_OPTIMIZATION = (
    "the pipeline runs forward and backward of all microbatches inside its schedule, so it needs automatic"
    " optimization; manual_backward() cannot be pipelined"
)
_CONSOLIDATED_WITH_PIPELINE = (
    # Lightning's consolidated save gathers on global rank 0, which holds only the first stage.
    "HybridStrategy(pp > 1, save_distributed_checkpoint=False) would write only the first pipeline stage's parameters"
    " into the consolidated file. Keep save_distributed_checkpoint=True (one DCP shard per rank, loadable under any"
    " layout)."
)


def _check_pipeline_may_be_chosen(pp_split: Optional[Sequence[int]], save_distributed_checkpoint: bool) -> None:
    if pp_split is not None:
        raise ValueError("HybridStrategy(pp='auto', pp_split=...): a split fixes the number of stages; pass pp=N with"
                         " it, or leave pp_split out and let the strategy balance the stages.")
    if not save_distributed_checkpoint:
        raise ValueError(_CONSOLIDATED_WITH_PIPELINE.replace("pp > 1", "pp='auto'", 1)
                         + " (pp='auto' may choose a pipeline.)")


def _layout_request(degrees: Mapping[str, Any], zero: int, checkpoint_plan: Optional[CheckpointPlan],
                    pp_schedule: str, microbatches: Optional[int], virtual_stages: Optional[int],
                    cluster: Optional[Cluster]) -> Optional[LayoutRequest]:
    if cluster is not None and not isinstance(cluster, Cluster):
        raise ValueError(f"HybridStrategy(cluster={cluster!r}) must be a lightning_hybrid.planning.Cluster.")
    if AUTO not in (degrees["tp"], degrees["pp"]):
        if cluster is not None:
            raise ValueError("HybridStrategy(cluster=) describes the hardware for tp='auto'/pp='auto'; pass one of them.")
        return None
    return LayoutRequest(
        **degrees, zero=zero, pp_schedule=pp_schedule, microbatches=microbatches, virtual_stages=virtual_stages,
        # the planner models full checkpointing; none is the upper bound for every-N-th and selective
        activation_checkpointing="every" if checkpoint_plan == CheckpointPlan(every=1) else None)


def _check_fixed_degrees_divide(world_size: int, degrees: Mapping[str, Any], cluster: Optional[Cluster], nodes: int,
                                devices: int) -> None:
    fixed = {name: value for name, value in degrees.items() if value != AUTO}
    product = math.prod(fixed.values())
    if world_size % product:
        given = " × ".join(f"{name}={value}" for name, value in fixed.items() if value > 1)
        raise ValueError(f"{given} = {product} does not divide the world size {world_size} (devices × num_nodes):"
                         " no layout can be chosen. Change the fixed degrees or the number of devices.")
    if cluster is not None and (cluster.nodes, cluster.gpus_per_node) != (nodes, devices):
        raise ValueError(f"HybridStrategy(cluster=...) describes {cluster.nodes} node(s) × {cluster.gpus_per_node}"
                         f" devices, but the Trainer runs num_nodes={nodes} × devices={devices}. Make them match.")


def _zero_level(zero: Optional[int], schedule: Optional[PipelineSchedule]) -> object:
    if schedule is None or not schedule.splits_weight_gradients:
        return 3 if zero is None else zero
    if zero == 3:
        # torch computes a zero-bubble weight gradient against the parameters the module holds at that time; under
        # ZeRO-3 those are the resharded ones, not the gathered ones the forward used, and gradients come out wrong.
        raise ValueError(
            f"pp_schedule={schedule.name!r} computes weight gradients in a separate pass after backward, which"
            " needs parameters to stay gathered from forward to backward: use zero=2 (its default)."
        )
    return 2 if zero is None else zero


def _check_checkpointing_with_schedule(plan: Optional[CheckpointPlan], schedule: Optional[PipelineSchedule]) -> None:
    # Zero-bubble schedules run backward through a stage twice: input gradients first, then one weight-gradient
    # pass per group of parameters, each of which unpacks the checkpointed activations again.
    if plan is None or schedule is None or not schedule.splits_weight_gradients:
        return
    if plan.selective:
        raise ValueError(
            f"activation_checkpointing='selective' cannot run under pp_schedule={schedule.name!r}: torch's selective"
            " checkpointing allows one backward pass per checkpointed region, and zero-bubble schedules run two"
            " (input gradients, then weight gradients). Use activation_checkpointing='every' or an integer N, or a"
            " schedule without split weight gradients ('1f1b', 'interleaved_1f1b')."
        )
    rank_zero_warn(
        f"activation checkpointing under pp_schedule={schedule.name!r} recomputes a checkpointed block once per"
        " weight-gradient pass (measured 4-7 recomputations per micro-batch on a GPT block instead of 1): numbers are"
        " unchanged but the recompute cost multiplies. 'interleaved_1f1b' recomputes each block once."
    )


def _already_parallel(module: torch.nn.Module) -> bool:
    """True if ``configure_model`` applied FSDP2 or tensor parallelism itself (Lightning's ModelParallel style)."""
    return any(isinstance(m, FSDPModule) for m in module.modules()) or any(
        isinstance(p, DTensor) for p in module.parameters()
    )


def _first_batch(loaders: Any) -> Any:
    """The first batch of the first dataloader (Lightning allows lists and dicts of them)."""
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    if isinstance(loader, Mapping):
        loader = next(iter(loader.values()))
    return next(iter(loader))


StrategyRegistry.register(
    HybridStrategy.strategy_name, HybridStrategy, description="FSDP2 × automatic tensor parallelism", override=True
)
