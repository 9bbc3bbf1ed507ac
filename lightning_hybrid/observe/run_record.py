"""What the run is, in TensorBoard next to what it measures: the layout, the tensor-parallel plan, the pipeline's
stage split and the planner's prediction, written once when fitting starts (:func:`record_run`, called by
:class:`~lightning_hybrid.observe.monitor.ParallelMonitor`).

Rank 0 writes, with a logger whose ``experiment`` has ``add_text`` (TensorBoard's "Text" tab; other loggers get the
same texts as hyperparameters with string values):

* ``run/layout``: dp (sharded), dp_replicate, tp, pp, world size, ZeRO level, schedule, microbatches, virtual
  stages, activation checkpointing and precision, also logged as hyperparameters ``layout/...`` (the "HParams" tab);
* ``run/tp_plan``: the tensor-parallel plan applied, module pattern → style, and per block structure the share of
  its parameters tp shards, the modules kept whole on every tp rank and why, and the memory that costs per tp rank;
* ``run/stages``: per pipeline stage its blocks, its parameters and what one of its ranks holds (the whole-model
  summary's counts, :mod:`lightning_hybrid.observe.parameter_counts`);
* with ``ParallelMonitor(predict=True)`` (the default) ``plan/prediction`` (text) and the scalars
  ``plan/memory_gib``, ``plan/tokens_per_sec``, ``plan/step_time_sec``, ``plan/mfu``: the cost model's figures for
  this layout, to read next to the measured ``memory/peak_gib_max``, ``throughput/tokens_per_sec`` and
  ``throughput/step_time_sec``. For ``tp="auto"``/``pp="auto"`` that is the chosen layout's estimate; for a fixed
  layout the strategy measures the model on its first batch as the auto layout does and estimates that one layout
  (:func:`predict_fixed_layout`; the hardware probe costs about 0.1 s on CPUs, GPUs are known by name). Where the
  planner cannot estimate, the text says why and training goes on. On CPUs the measured memory is the process's
  peak resident memory (interpreter and libraries included), which the planner does not predict.

Example::

    Trainer(strategy=HybridStrategy(tp=2, pp=2, monitor=ParallelMonitor(predict=True)), logger=TensorBoardLogger("tb"))
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping, Optional

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_hybrid.observe.profiling import TraceWindow
from lightning_hybrid.observe.parameter_counts import WholeModelSummary, describe_shares, summarize_whole_model
from lightning_hybrid.probe.record import first_block_call
from lightning_hybrid.probe.step_probe import StepProbe
from lightning_hybrid.planner.auto_layout import estimate_for_run
from lightning_hybrid.hardware import GIB
from lightning_hybrid.planner.layout import Estimate
from lightning_hybrid.tensor_parallel.fallback import format_bytes

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------ the prediction
def wants_prediction(trainer: pl.Trainer) -> bool:
    """Whether a fixed layout should be estimated at setup: fitting, with a logger and a monitor that predicts."""
    from lightning_hybrid.observe.monitor import ParallelMonitor  # the monitor imports this module

    monitors = [c for c in trainer.callbacks if isinstance(c, ParallelMonitor)]
    return trainer.state.fn == TrainerFn.FITTING and bool(trainer.loggers) and any(m.predict for m in monitors)


def predict_fixed_layout(trainer: pl.Trainer, strategy: Any, module: Any, blocks: Any,
                         probe: StepProbe) -> tuple[Optional[Estimate], str]:
    """The planner's estimate of the strategy's fixed layout, from the setup ``probe``'s first block call, and a
    line saying where its hardware numbers came from or why there is no estimate. Every process calls it, before
    the model is parallelized; it never raises."""
    if len(blocks) == 0:
        return None, "no prediction: the model has no block list for the planner to measure"
    try:
        block_call = first_block_call(probe.record())
    except Exception as error:  # noqa: BLE001 - the prediction is an extra; the run must not fail on it
        return None, f"no prediction: the first block's inputs were not captured ({error})"
    try:
        estimate, hardware = estimate_for_run(
            module, blocks.path, block_call, strategy.options, device=strategy.root_device, nodes=strategy.num_nodes,
            devices_per_node=strategy.num_processes, precision=str(strategy.precision_plugin.precision),
            accumulation=trainer.accumulate_grad_batches)
    except Exception as error:  # noqa: BLE001
        return None, f"no prediction: the planner could not estimate this layout ({error})"
    return estimate, f"Hardware: {hardware}."


def prediction_scalars(estimate: Optional[Estimate]) -> dict[str, float]:
    """``plan/...`` scalars of an estimate (none without one)."""
    if estimate is None:
        return {}
    return {"plan/memory_gib": estimate.memory.total / GIB, "plan/tokens_per_sec": estimate.tokens_per_second,
            "plan/step_time_sec": estimate.time.step, "plan/mfu": estimate.mfu}


def prediction_text(estimate: Optional[Estimate], note: Optional[str]) -> str:
    """The ``plan/prediction`` text: the estimate's breakdown and where it came from, or why there is none."""
    if estimate is None:
        return note or "no prediction: the strategy has no planner estimate for this run"
    memory, time = estimate.memory, estimate.time
    rows = [("layout", str(estimate.layout)), ("memory per device (GiB)", f"{memory.total / GIB:.4f}"),
            ("fullest stage", memory.stage), ("model states (GiB)", f"{memory.model_states / GIB:.4f}"),
            ("activations (GiB)", f"{memory.activations / GIB:.4f}"), ("tokens/s", f"{estimate.tokens_per_second:,.0f}"),
            ("step time (s)", f"{time.step:.4f}"), ("bubble (s)", f"{time.bubble:.4f}"), ("MFU", f"{estimate.mfu:.3f}")]
    if estimate.reasons:
        rows.append(("does not fit", "; ".join(estimate.reasons)))
    return (markdown_table(("predicted", "value"), rows) + f"\n\n{note or ''} Measured: `memory/peak_gib_max`,"
            " `throughput/tokens_per_sec`, `throughput/step_time_sec` (on CPUs the measured memory is the process's"
            " resident memory, interpreter and libraries included).")


# ------------------------------------------------------------------------------------------ the texts
def markdown_table(header: tuple[str, ...], rows: list[tuple[Any, ...]]) -> str:
    """A Markdown table (TensorBoard's text plugin renders it)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def layout_figures(trainer: pl.Trainer) -> dict[str, Any]:
    """The layout as flat ``layout/...`` hyperparameters (numbers and strings)."""
    strategy = trainer.strategy
    dims, options = getattr(strategy, "dims", None), getattr(strategy, "options", None)
    figures: dict[str, Any] = {"layout/world_size": trainer.world_size}
    if dims is not None:
        figures.update({"layout/dp": dims.dp, "layout/dp_replicate": dims.dp_replicate, "layout/tp": dims.tp,
                        "layout/pp": dims.pp, "layout/ep": dims.ep, "layout/cp": dims.cp})
    if options is not None:
        schedule = options.pipeline_schedule
        plan = options.checkpointing
        figures.update({
            "layout/zero": options.zero, "layout/schedule": schedule.name if schedule is not None else "none",
            "layout/microbatches": schedule.microbatches if schedule is not None else 1,
            "layout/virtual_stages": schedule.virtual_stages if schedule is not None else 1,
            "layout/activation_checkpointing": str(options.planned_checkpointing) if plan is not None else "none",
        })
    figures["layout/precision"] = str(getattr(trainer.precision_plugin, "precision", "32-true"))
    return figures


def tp_plan_text(plan: Mapping[str, str], tp: int) -> str:
    """The ``run/tp_plan`` text: module pattern → style, then (for an
    :class:`~lightning_hybrid.tensor_parallel.fallback.AppliedPlan`) per block structure the share of its
    parameters tp shards, what stays whole on every tp rank and why, and what that costs each tp rank."""
    if not plan:
        return f"no tensor-parallel plan (tp={tp})"
    text = markdown_table(("module", "style"), [(f"`{name}`", style) for name, style in sorted(plan.items())])
    structures = getattr(plan, "structures", [])
    if structures:
        rows = [(f"`{s.blocks}`", f"{s.count} × {s.block_class}", f"{s.parameters:,}", f"{s.fraction:.1%}",
                 s.kept_text(), format_bytes(s.extra_bytes)) for s in structures]
        text += "\n\n" + markdown_table(("block structure", "blocks", "parameters", "sharded by tp",
                                          "kept whole on every tp rank (why)", "extra memory per tp rank"), rows)
    if getattr(plan, "vocab", ""):
        text += f"\n\nThe embedding and/or the head stay whole on every tp rank: {plan.vocab}."
    return text


def stages_text(summary: WholeModelSummary, trainer: pl.Trainer) -> str:
    """The stage split: the whole-model line of the console summary, then per stage its blocks, parameters and
    what one rank holds."""
    pipeline = getattr(trainer.strategy, "pipeline", None)
    by_stages: dict[tuple[int, ...], list[Any]] = {}
    for share in summary.shares:
        by_stages.setdefault(share.stages, []).append(share)
    rows = []
    for stages, shares in sorted(by_stages.items()):
        held = sorted({share.held for share in shares})
        blocks = "all" if pipeline is None else ", ".join(_block_range(pipeline.split.block_range(s)) for s in stages)
        rows.append(("+".join(map(str, stages)), blocks, f"{shares[0].counted:,}",
                     f"{held[0]:,}" if len(held) == 1 else f"{held[0]:,}–{held[-1]:,}"))
    header = describe_shares(summary, trainer).splitlines()[0]
    return header + "\n\n" + markdown_table(("stage", "blocks", "parameters", "held per rank"), rows)


def _block_range(blocks: range) -> str:
    if len(blocks) == 0:
        return "none"
    return str(blocks.start) if len(blocks) == 1 else f"{blocks.start}–{blocks.stop - 1}"


# ------------------------------------------------------------------------------------------ writing
def record_run(trainer: pl.Trainer, pl_module: pl.LightningModule, predict: bool,
               profile_steps: Optional[range]) -> Optional[TraceWindow]:
    """Write the run's texts, hyperparameters and predicted scalars (rank 0; collective: every rank calls, at fit
    start) and return the profiler window of ``profile_steps`` (``None`` without one)."""
    window = None
    if profile_steps is not None:  # trainer.log_dir broadcasts rank 0's folder
        window = TraceWindow(profile_steps, Path(trainer.log_dir or trainer.default_root_dir) / "profiler",
                             trainer.global_rank, trainer.strategy.root_device)
    if not trainer.loggers:
        return window
    summary = summarize_whole_model(trainer, pl_module)  # collective
    if trainer.global_rank != 0:
        return window
    strategy = trainer.strategy
    figures = layout_figures(trainer)
    texts = {"run/layout": markdown_table(("setting", "value"), [(k.split("/")[1], v) for k, v in figures.items()]),
             "run/tp_plan": tp_plan_text(getattr(strategy, "tp_plan_applied", {}), figures.get("layout/tp", 1)),
             "run/stages": stages_text(summary, trainer)}
    estimate = getattr(strategy, "layout_estimate", None)
    if predict:
        texts["plan/prediction"] = prediction_text(estimate, getattr(strategy, "layout_note", None))
    for logger in trainer.loggers:
        experiment = getattr(logger, "experiment", None)
        if hasattr(experiment, "add_text"):
            for tag, text in texts.items():
                experiment.add_text(tag, text, global_step=trainer.global_step)
        else:
            logger.log_hyperparams(texts)
        logger.log_hyperparams(figures)
        if predict and estimate is not None:
            logger.log_metrics(prediction_scalars(estimate), step=trainer.global_step)
    return window
