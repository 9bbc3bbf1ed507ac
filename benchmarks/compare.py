"""HybridStrategy next to the alternatives: a hand-written torch loop, Lightning's ModelParallelStrategy, FSDPStrategy
and DDPStrategy -- step time, peak memory and communication per step, each pair on the same model, data and layout.

Model and data: ``recipes/gpt.py``'s GPT (parallelism-unaware) with :data:`CONFIG` (4 blocks, width 256, 8 heads,
vocabulary 256, sequence 128: 3,323,392 parameters, 3,159,040 of them in the blocks), fp32, AdamW (the recipe's
``configure_optimizers``: two weight-decay groups, betas 0.9/0.95, warm-up + cosine LambdaLR stepped per step), a
global batch of :data:`GLOBAL_BATCH` sequences of random tokens drawn with a fixed seed. Every side seeds
``torch.manual_seed`` and builds ``GPT(CONFIG)`` eagerly on every rank, so all start from the same weights; every
side draws batches with ``DistributedSampler(shuffle=True, seed=0)`` over the data-parallel ranks (what Lightning
injects), so all see the same sequences in the same order.

Sides (one process per rank, started by ``benchmarks/harness.py`` with the environment ``torchrun`` gives a rank,
gloo on CPU, ``OMP_NUM_THREADS=1``):

``hybrid``         Lightning ``Trainer`` + ``HybridStrategy(dp=, tp=, pp=, monitor=False)``, module unchanged
                   (with tp, ``shard_vocab=False``: embeddings and head whole over tp, as on the other sides).
``manual``         No Lightning: ``init_process_group("gloo")``, ``init_device_mesh``, then the same torch primitives
                   the strategy applies, written by hand (:func:`manual_parallelize`, :func:`manual_pipeline`):
                   dp: ``fully_shard`` per block (resharded after forward) + the GPT root (kept gathered);
                   tp: ``parallelize_module`` with ``ColwiseParallel`` on ``attn.c_attn`` and ``mlp.c_fc``,
                   ``RowwiseParallel`` on ``attn.c_proj`` and ``mlp.c_proj`` and the attention's head counts
                   divided by tp -- HybridStrategy's automatic plan for this block (``tp_plan_applied`` is printed
                   with ``--verbose``); the fused q|k|v rows are reordered once so a contiguous row shard holds whole
                   heads of q, k and v (HybridStrategy reaches the same with a strided placement);
                   pp: the GPT cut by hand at the same block boundary as the strategy's split, one
                   ``PipelineStage`` per rank, ``Schedule1F1B`` with the same microbatch count.
                   Loop: fetch, forward/backward (or ``schedule.step``), ``optimizer.step()``,
                   ``scheduler.step()``, ``zero_grad(set_to_none=True)``.
``modelparallel``  Lightning's ``ModelParallelStrategy`` with a ``configure_model`` written as Lightning's docs show
                   it (``parallelize_module`` on the tensor-parallel mesh when tp > 1, then ``fully_shard`` per block
                   and on ``self.model`` when dp > 1), using the same plan as ``manual``.
``fsdp``           Lightning's ``FSDPStrategy(auto_wrap_policy={Block})`` (FSDP1, FULL_SHARD). Lightning refuses it on
                   CPU although torch's FSDP1 trains there; :func:`_cpu_fsdp_strategy_class` lifts only that refusal.
``ddp``            Lightning's ``DDPStrategy()``.
``manual_fsdp1``   ``manual`` plus ``fully_shard`` over the 1-rank data-parallel mesh (tp2, pp2): what HybridStrategy
                   did before f78baa9 (FSDP2 whatever the data-parallel degree); this side shows what that alone costs.

What is measured: each rank times, counts and memory-tracks its steps the same way on every side
(``benchmarks/step_window.py``: the step window, step and CPU time, peak tensor memory, collectives, Python calls);
the parent aggregates the ranks and rounds and prints the table (``benchmarks/compare_report.py``: slowest rank,
medians and ratios over alternating rounds, the theoretical minimum communication, the same-computation check).

Usage::

    python benchmarks/compare.py                    # the 9 two-rank pairs, 3 rounds (a few minutes on 2 cores)
    python benchmarks/compare.py --quick            # one round, 5 timed steps (under a minute)
    python benchmarks/compare.py --pairs manual-dp2,manual-pp2 --rounds 5
    python benchmarks/compare.py --list             # pair names (including the oversubscribed 4-rank ones)
    python benchmarks/compare.py --json out.json    # also every launch's raw numbers
    python benchmarks/compare.py --quick --profile prof/   # cProfile of the timed steps, Python calls per step
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from torch import Tensor, nn

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.compare_report import (  # noqa: E402
    Layout, Pair, SideRun, format_notes, format_python_calls, format_table, minimum_comm, parameter_counts, summarize,
)
from benchmarks.harness import alternating, launch_ranks, revision, save_rank_result  # noqa: E402
from benchmarks.step_window import RankRecord, StepWindows, pipeline_receive_buffers  # noqa: E402
from recipes.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
GLOBAL_BATCH = 8  # sequences per optimizer step over all data-parallel ranks
MICROBATCHES = 4  # pipeline layouts: microbatches per step, the same on both sides
WARMUP_STEPS = 2  # shape inference of the pipeline, lazy AdamW state, allocator warm-up
TIMED_STEPS = 8
QUICK_TIMED_STEPS = 5
ROUNDS = 3
MODEL_SEED = 1234
DATA_SEED = 4321
LR, WEIGHT_DECAY, LR_WARMUP = 3e-3, 0.1, 2  # the recipe's optimizer settings, short warm-up
LAUNCH_TIMEOUT_S = 300.0


# ============================================================================================ layouts, pairs
LAYOUTS = {layout.name: layout for layout in (
    Layout("dp2", dp=2), Layout("tp2", tp=2), Layout("pp2", pp=2), Layout("dp2-tp2", dp=2, tp=2),
)}

SIDES = {
    "hybrid": "Lightning + HybridStrategy",
    "manual": "hand-written torch loop",
    "modelparallel": "Lightning ModelParallelStrategy + configure_model",
    "fsdp": "Lightning FSDPStrategy (FSDP1)",
    "ddp": "Lightning DDPStrategy",
    "manual_fsdp1": "hand-written loop + FSDP2 over the 1-rank data mesh (HybridStrategy at dp=1 before f78baa9)",
}

PAIRS = {pair.name: pair for pair in (
    Pair("manual-dp2", "dp2", "hybrid", "manual"),
    Pair("manual-tp2", "tp2", "hybrid", "manual"),
    Pair("manual-pp2", "pp2", "hybrid", "manual"),
    Pair("modelparallel-tp2", "tp2", "hybrid", "modelparallel"),
    Pair("modelparallel-dp2", "dp2", "hybrid", "modelparallel"),
    Pair("fsdp-dp2", "dp2", "hybrid", "fsdp"),
    Pair("ddp-dp2", "dp2", "hybrid", "ddp"),
    # Attribution: what FSDP2 on a 1-rank data mesh (which HybridStrategy applied at dp=1 before f78baa9) costs.
    Pair("manual_fsdp1-tp2", "tp2", "hybrid", "manual_fsdp1"),
    Pair("manual_fsdp1-pp2", "pp2", "hybrid", "manual_fsdp1"),
    # 4 ranks: oversubscribed on a 2-core machine, so not in the default set.
    Pair("manual-dp2-tp2", "dp2-tp2", "hybrid", "manual"),
    Pair("modelparallel-dp2-tp2", "dp2-tp2", "hybrid", "modelparallel"),
)}
DEFAULT_PAIRS = [name for name, pair in PAIRS.items() if LAYOUTS[pair.layout].world == 2]


# ==================================================================================================== data
def make_dataset(steps: int) -> Any:
    from torch.utils.data import TensorDataset

    generator = torch.Generator().manual_seed(DATA_SEED)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * steps, CONFIG.block_size + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


# ============================================================================================ manual side
def make_optimizer(parameters: list[nn.Parameter], total_steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The recipe's optimizer and schedule (``GPTLightning.configure_optimizers``), built without Lightning."""
    from recipes.gpt import cosine_with_warmup

    decay = [p for p in parameters if p.ndim >= 2]
    no_decay = [p for p in parameters if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_with_warmup(LR_WARMUP, total_steps))
    return optimizer, scheduler


def tensor_parallelize_blocks(blocks: nn.ModuleList, tp_mesh: Any) -> None:
    """Megatron plan on every block with torch's ``parallelize_module``: q|k|v and MLP-up column-parallel, the two
    output projections row-parallel, attention head counts per rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in blocks:
        attn = block.attn
        # c_attn's rows are [q | k | v]. A contiguous row shard must hold whole heads of each, so deal the rows as
        # [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] once (same values, same products; only the row order changes).
        with torch.no_grad():
            weight = attn.c_attn.weight
            attn.c_attn.weight.copy_(weight.view(3, tp, -1, weight.shape[1]).transpose(0, 1).reshape_as(weight))
            bias = attn.c_attn.bias
            attn.c_attn.bias.copy_(bias.view(3, tp, -1).transpose(0, 1).reshape_as(bias))
        attn.n_head //= tp
        attn.n_embd //= tp
        parallelize_module(block, tp_mesh, {
            "attn.c_attn": ColwiseParallel(), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(),
        })


def fully_shard_model(model: nn.Module, blocks: Iterable[nn.Module], dp_mesh: Any) -> None:
    """FSDP2: each block one unit (resharded after forward: ZeRO-3), the root last (FSDP2's default keeps the root
    gathered from forward to backward)."""
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh)


def manual_parallelize(model: nn.Module, layout: Layout, mesh: Any, shard_single_rank: bool = False) -> None:
    """tp, then FSDP2 when there is more than one data-parallel rank (or always, with ``shard_single_rank``:
    the ``manual_fsdp1`` side)."""
    if layout.tp > 1:
        tensor_parallelize_blocks(model.blocks, mesh["tp"])
    if layout.dp > 1 or shard_single_rank:
        fully_shard_model(model, model.blocks, mesh["dp"])


class FirstStage(nn.Module):
    """Embeddings and the first blocks of the GPT (``GPT.forward`` up to the cut)."""

    def __init__(self, gpt: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.wte, self.wpe = gpt.wte, gpt.wpe
        self.blocks = nn.ModuleList(blocks)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.size(1), device=idx.device))
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The remaining blocks, final norm and LM head (``GPT.forward`` after the cut)."""

    def __init__(self, gpt: nn.Module, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def split_blocks(n_layer: int, stages: int) -> list[int]:
    """Blocks per stage: as even as possible, the extra blocks on the earlier stages. For this GPT it equals the
    strategy's FLOP-balanced split (both sides record ``blocks_per_stage``; the report warns if they differ)."""
    return [n_layer // stages + (1 if s < n_layer % stages else 0) for s in range(stages)]


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def run_manual(layout: Layout, windows: StepWindows, shard_single_rank: bool = False) -> None:
    """The hand-written training loop (no Lightning). ``shard_single_rank``: apply FSDP2 even over a 1-rank data
    mesh, as HybridStrategy did before f78baa9 (the ``manual_fsdp1`` side)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.data import DataLoader, DistributedSampler

    from recipes.gpt import GPT

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # Same rank order as HybridStrategy's mesh: pipeline outermost, tensor-parallel innermost.
    mesh = init_device_mesh("cpu", (layout.pp, layout.dp, layout.tp), mesh_dim_names=("pp", "dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    torch.manual_seed(MODEL_SEED)
    model = GPT(CONFIG)
    data = make_dataset(windows.total_steps)
    sampler = DistributedSampler(data, num_replicas=layout.dp, rank=dp_rank, shuffle=True, seed=0)
    sampler.set_epoch(0)
    loader = DataLoader(data, batch_size=GLOBAL_BATCH // layout.dp, sampler=sampler)
    if layout.pp > 1:
        _manual_pipeline_loop(model, layout, mesh, loader, windows, shard_single_rank)
    else:
        _manual_loop(model, layout, mesh, loader, windows, shard_single_rank)
    windows.record.rank = rank
    dist.barrier()
    dist.destroy_process_group()


def _manual_loop(model: nn.Module, layout: Layout, mesh: Any, loader: Any, windows: StepWindows,
                 shard_single_rank: bool) -> None:
    """Fetch, forward, backward, optimizer and scheduler steps, zero_grad: one window per iteration."""
    manual_parallelize(model, layout, mesh, shard_single_rank)
    optimizer, scheduler = make_optimizer(list(model.parameters()), windows.total_steps)
    batches = iter(loader)
    for step in range(windows.total_steps):
        windows.begin(step, lambda: [model, optimizer])
        idx, targets = next(batches)
        loss = cross_entropy(model(idx), targets)
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        windows.end(step, loss.item())


def _manual_pipeline_loop(model: nn.Module, layout: Layout, mesh: Any, loader: Any, windows: StepWindows,
                          shard_single_rank: bool) -> None:
    """This rank's stage through the 1F1B schedule, then the optimizer and scheduler steps, zero_grad."""
    stage, schedule, stage_module = manual_pipeline(model, layout, mesh, shard_single_rank)
    optimizer, scheduler = make_optimizer(list(stage_module.parameters()), windows.total_steps)
    windows.record.info["blocks_per_stage"] = split_blocks(CONFIG.n_layer, layout.pp)

    def existing() -> list[Any]:
        return [stage_module, optimizer, *pipeline_receive_buffers([stage])]

    batches = iter(loader)
    for step in range(windows.total_steps):
        windows.begin(step, existing)  # before the fetch: the step's window is the whole iteration
        idx, targets = next(batches)
        losses: list[Tensor] = []
        if stage.is_first:
            schedule.step(idx)
        elif stage.is_last:
            schedule.step(target=targets, losses=losses, return_outputs=False)
        else:
            schedule.step()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        windows.end(step, torch.stack(losses).mean().item() if losses else None)


def manual_pipeline(
    model: nn.Module, layout: Layout, mesh: Any, shard_single_rank: bool = False
) -> tuple[Any, Any, nn.Module]:
    """Cut the GPT at the block boundary, keep this rank's stage, wrap it in a PipelineStage and a 1F1B schedule
    (``shard_single_rank``: FSDP2 on the stage over the 1-rank data mesh first, as HybridStrategy did before
    f78baa9)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    if layout.pp != 2:
        raise ValueError("the hand-written pipeline cuts the GPT into 2 stages")
    stage_index = mesh["pp"].get_local_rank()
    cut = split_blocks(CONFIG.n_layer, layout.pp)[0]
    blocks = list(model.blocks)
    stage_module = FirstStage(model, blocks[:cut]) if stage_index == 0 else LastStage(model, blocks[cut:])
    if shard_single_rank:
        fully_shard_model(stage_module, stage_module.blocks, mesh["dp"])
    stage = PipelineStage(stage_module, stage_index, layout.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    # scale_grads=True (default): gradients are divided by the microbatch count, i.e. the mean over microbatches.
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=cross_entropy)
    return stage, schedule, stage_module


# ========================================================================================= Lightning sides
def make_lightning_module(side: str, steps: int) -> Any:
    """The recipe's LightningModule (built eagerly: call after seeding); ModelParallelStrategy also needs a
    ``configure_model``."""
    from recipes.gpt import GPTLightning

    kwargs = dict(lr=LR, weight_decay=WEIGHT_DECAY, warmup_steps=LR_WARMUP, max_steps=steps)
    if side != "modelparallel":
        return GPTLightning(CONFIG, **kwargs)

    class ModelParallelGPT(GPTLightning):
        """The recipe's module plus the ``configure_model`` ModelParallelStrategy requires, in the docs' style."""

        def configure_model(self) -> None:
            if getattr(self, "_parallelized", False):
                return
            self._parallelized = True
            dp_mesh, tp_mesh = self.device_mesh["data_parallel"], self.device_mesh["tensor_parallel"]
            if tp_mesh.size() > 1:
                tensor_parallelize_blocks(self.model.blocks, tp_mesh)
            if dp_mesh.size() > 1:
                fully_shard_model(self.model, self.model.blocks, dp_mesh)

    return ModelParallelGPT(CONFIG, **kwargs)


def _cpu_fsdp_strategy_class() -> type:
    """Lightning's FSDPStrategy, allowed on CPU. Two things stop it there, neither in FSDP1 itself (which trains on
    CPU/gloo when given ``device_id=torch.device("cpu")``): the accelerator connector refuses ``accelerator="cpu"``
    by an exact type check (``type(strategy) is FSDPStrategy``), which a subclass passes; and ``_setup_model`` passes
    ``device_id=root_device.index``, ``None`` on CPU, which FSDP1 rejects -- so FSDP1 is given the CPU device while
    the strategy wraps the model. Nothing else of the strategy changes."""
    import torch.distributed.fsdp as fsdp
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        def _setup_model(self, model: nn.Module) -> nn.Module:
            original = fsdp.FullyShardedDataParallel

            class OnCPU(original):  # type: ignore[misc, valid-type]
                def __init__(self, *args: Any, device_id: Any = None, **kwargs: Any) -> None:
                    super().__init__(*args, device_id=device_id if device_id is not None else torch.device("cpu"),
                                     **kwargs)

            fsdp.FullyShardedDataParallel = OnCPU  # Lightning imports it from here inside _setup_model
            try:
                return super()._setup_model(model)
            finally:
                fsdp.FullyShardedDataParallel = original

    return CPUFSDPStrategy


def make_strategy(side: str, layout: Layout) -> Any:
    if side == "hybrid":
        from lightning_hybrid import HybridStrategy

        options: dict[str, Any] = dict(dp=layout.dp, tp=layout.tp, pp=layout.pp)
        if layout.pp > 1:
            options.update(pp_schedule="1f1b", microbatches=MICROBATCHES)
        if "monitor" in inspect.signature(HybridStrategy.__init__).parameters:
            options["monitor"] = False  # the strategy alone, without its monitoring callback
        if layout.tp > 1 and "shard_vocab" in inspect.signature(HybridStrategy.__init__).parameters:
            options["shard_vocab"] = False  # the other sides' plan: embeddings and head whole over tp
        return HybridStrategy(**options)
    if side == "modelparallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        return ModelParallelStrategy(data_parallel_size=layout.dp, tensor_parallel_size=layout.tp)
    if layout.tp > 1 or layout.pp > 1:
        raise ValueError(f"side {side!r} is data-parallel only")
    if side == "fsdp":
        from recipes.gpt import Block

        return _cpu_fsdp_strategy_class()(auto_wrap_policy={Block}, sharding_strategy="FULL_SHARD")
    if side == "ddp":
        from lightning.pytorch.strategies import DDPStrategy

        return DDPStrategy()
    raise ValueError(f"unknown side {side!r}")


def run_lightning(side: str, layout: Layout, windows: StepWindows) -> None:
    """One rank of a Lightning side: ``Trainer.fit`` with the side's strategy and a callback feeding ``windows``."""
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    steps = windows.total_steps

    class StepProbe(pl.Callback):
        """Ends step ``i`` and opens the window of step ``i + 1`` in ``on_train_batch_end``: a step runs from one
        ``on_train_batch_end`` to the next, so Lightning's work between batches (LR scheduler, the per-batch
        sigterm broadcast, fetching) is timed, counted and tracked like the manual loop's."""

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            windows.end(batch_idx, float(loss) if isinstance(loss, Tensor) else None)

            def existing() -> list[Any]:
                stages = []
                pipeline = getattr(trainer.strategy, "pipeline", None)
                if pipeline is not None:
                    for schedule, _ in pipeline._schedules.values():  # (schedule, its stage buffers)
                        stages += getattr(schedule, "_stages", None) or [schedule._stage]
                return [trainer.strategy.model, pl_module, *trainer.optimizers, *pipeline_receive_buffers(stages)]

            windows.begin(batch_idx + 1, existing)

    torch.manual_seed(MODEL_SEED)
    module = make_lightning_module(side, steps)
    trainer = pl.Trainer(
        accelerator="cpu", devices=layout.world, strategy=make_strategy(side, layout), precision="32-true",
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, callbacks=[StepProbe()],
    )
    # Per data-parallel rank; Lightning's DistributedSampler (shuffle, seed 0) deals the sequences out.
    trainer.fit(module, DataLoader(make_dataset(steps), batch_size=GLOBAL_BATCH // layout.dp))
    windows.record.rank = trainer.global_rank
    strategy = trainer.strategy
    if side == "hybrid":
        windows.record.info["tp_plan_applied"] = dict(strategy.tp_plan_applied)
        if strategy.pipeline is not None:
            windows.record.info["blocks_per_stage"] = list(strategy.pipeline.split.blocks_per_stage)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo crashes at interpreter exit otherwise


def run_worker(side: str, layout: Layout, timed_steps: int, out: Path, profile_to: Optional[str] = None) -> None:
    """One rank of a launch: run the side, save its :class:`RankRecord` (and ``<profile_to>-rank<N>.pstats`` of the
    timed steps)."""
    warnings.simplefilter("ignore")  # Lightning's advice about workers and logging on tiny runs
    import logging
    import os

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    record = RankRecord(rank=int(os.environ.get("RANK", 0)))
    profile = Path(f"{profile_to}-rank{record.rank}.pstats") if profile_to else None
    windows = StepWindows(WARMUP_STEPS, timed_steps, record, profile)
    if side in ("manual", "manual_fsdp1"):
        run_manual(layout, windows, shard_single_rank=side == "manual_fsdp1")
    else:
        run_lightning(side, layout, windows)
    save_rank_result(out, asdict(record), record.rank)


# ================================================================================================ rounds
def launch(side: str, layout: Layout, timed_steps: int, round_index: int, profile_dir: Optional[Path]) -> SideRun:
    """One side on one layout: ``layout.world`` ranks of this script, every side started identically."""
    worker = ["--worker", side, layout.name, "--steps", timed_steps]
    if profile_dir is not None:  # each rank keeps its profile of the timed steps
        worker += ["--profile-to", profile_dir / f"{side}-{layout.name}-round{round_index + 1}"]
    launched = launch_ranks(Path(__file__), worker, layout.world, timeout_s=LAUNCH_TIMEOUT_S)
    return SideRun(side, layout.name, round_index, launched.ranks, launched.wall_s, WARMUP_STEPS)


def launch_order(pairs: list[Pair]) -> list[tuple[str, str]]:
    """``(side, layout)`` of every launch a round makes: grouped by layout, the HybridStrategy launch in the middle of
    its group and shared by that layout's pairs (``... B1 A B2 ...``)."""
    groups: dict[str, list[str]] = {}
    for pair in pairs:
        sides = groups.setdefault(pair.layout, [])
        if pair.b not in sides:
            sides.append(pair.b)
    order: list[tuple[str, str]] = []
    for layout_name, others in groups.items():
        middle = len(others) // 2
        order += [(side, layout_name) for side in (*others[:middle], "hybrid", *others[middle:])]
    return order


def run_rounds(pairs: list[Pair], rounds: int, timed_steps: int,
               profile_dir: Optional[Path] = None) -> dict[str, list[tuple[SideRun, SideRun]]]:
    """Every launch of :func:`launch_order` once per round, the order reversed every other round. Returns each
    pair's ``(A, B)`` launches, one per round."""
    launched: dict[tuple[str, str, int], SideRun] = {}
    for round_index, (side, layout_name) in alternating(launch_order(pairs), rounds):
        run = launch(side, LAYOUTS[layout_name], timed_steps, round_index, profile_dir)
        launched[(side, layout_name, round_index)] = run
        print(f"  round {round_index + 1}/{rounds} {layout_name:7s} {side:13s}"
              f" step {run.step_seconds() * 1e3:5.0f} ms, CPU {run.cpu_seconds() * 1e3:5.0f} ms"
              f"  (launch {run.wall_s:3.0f} s)", file=sys.stderr, flush=True)
    return {pair.name: [(launched[(pair.a, pair.layout, r)], launched[(pair.b, pair.layout, r)])
                        for r in range(rounds)] for pair in pairs}


# ================================================================================================== main
def parse_arguments() -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", help=f"comma-separated pair names (see --list); default: {','.join(DEFAULT_PAIRS)}")
    parser.add_argument("--quick", action="store_true", help=f"one round, {QUICK_TIMED_STEPS} timed steps")
    parser.add_argument("--rounds", type=int, help=f"alternating rounds (default {ROUNDS}; --quick: 1)")
    parser.add_argument("--steps", type=int, help=f"timed steps per launch (default {TIMED_STEPS})")
    parser.add_argument("--list", action="store_true", help="print the pair names and exit")
    parser.add_argument("--verbose", action="store_true",
                        help="also print the tensor-parallel plan HybridStrategy applied")
    parser.add_argument("--json", type=Path, help="also write every launch's raw numbers here")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="cProfile each rank's timed steps into DIR and print Python function calls per step"
                             " (the profiler slows Python-heavy sides more: read the step times of such a run as"
                             " distorted)")
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "LAYOUT"), help=argparse.SUPPRESS)
    parser.add_argument("--profile-to", help=argparse.SUPPRESS)  # a rank's profile path, less "-rank<N>.pstats"
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness: layout.world
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return parser, parser.parse_args()


def print_pairs() -> None:
    for name, pair in PAIRS.items():
        layout = LAYOUTS[pair.layout]
        print(f"{name:24s} {SIDES[pair.a]} vs {SIDES[pair.b]}, {layout.name} ({layout.world} ranks"
              + (", oversubscribed" if layout.oversubscribed else "") + ")"
              + ("" if name in DEFAULT_PAIRS else "  [not in the default set]"))


def compare(pairs: list[Pair], rounds: int, timed_steps: int, args: argparse.Namespace) -> None:
    """Launch every round, print the table, its notes (and the applied tp plans, the Python calls per step)."""
    counts = parameter_counts(CONFIG)
    print(f"lightning_hybrid at {revision()}; "
          f"GPT {asdict(CONFIG)}: {counts['total']:,} parameters ({counts['blocks']:,} in blocks); fp32, AdamW; global"
          f" batch {GLOBAL_BATCH} x {CONFIG.block_size} tokens; {WARMUP_STEPS} warm-up + {timed_steps} timed steps;"
          f" {rounds} round(s); pp: 1F1B, {MICROBATCHES} microbatches; torch {torch.__version__}", flush=True)
    start = time.perf_counter()
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    launches = run_rounds(pairs, rounds, timed_steps, args.profile)
    results = [summarize(pair, LAYOUTS[pair.layout], launches[pair.name],
                         minimum_comm(LAYOUTS[pair.layout], pair.b, CONFIG, GLOBAL_BATCH)) for pair in pairs]
    command = "python benchmarks/compare.py " + " ".join(sys.argv[1:])
    print(f"\nCommand: {command.strip()}   ({time.perf_counter() - start:.0f} s)\n")
    print(format_table(results))
    notes = format_notes(results)
    if notes:
        print("\n" + notes)
    if args.verbose:
        for r in results:
            if r.a.info.get("tp_plan_applied"):
                print(f"- {r.pair.name}: HybridStrategy tp_plan_applied = {r.a.info['tp_plan_applied']}")
    if args.profile:
        print("\n" + format_python_calls(args.profile, timed_steps, list(LAYOUTS), list(SIDES)))
    if args.json:
        args.json.write_text(json.dumps({name: [[asdict(a), asdict(b)] for a, b in rounds]
                                         for name, rounds in launches.items()}, indent=1))


def main() -> None:
    parser, args = parse_arguments()
    timed_steps = args.steps or (QUICK_TIMED_STEPS if args.quick else TIMED_STEPS)
    if args.worker:
        side, layout_name = args.worker
        run_worker(side, LAYOUTS[layout_name], timed_steps, args.out, args.profile_to)
        return
    if args.list:
        print_pairs()
        return
    names = args.pairs.split(",") if args.pairs else DEFAULT_PAIRS
    unknown = [n for n in names if n not in PAIRS]
    if unknown:
        parser.error(f"unknown pairs {unknown}; choose from {', '.join(PAIRS)}")
    if timed_steps < 5:
        parser.error("at least 5 timed steps")
    compare([PAIRS[n] for n in names], args.rounds or (1 if args.quick else ROUNDS), timed_steps, args)


if __name__ == "__main__":
    main()
