"""``HybridStrategy(tp="auto", pp="auto")``: choose the layout at setup with the planner's cost model, applied to the
live module, its first batch and the hardware the job runs on.

:func:`choose_for_run` measures the module (:mod:`lightning_hybrid.planner.live_model`) and the hardware
(:mod:`lightning_hybrid.planner.hardware_probe`, or ``HybridStrategy(cluster=...)``), estimates every layout the fixed
options leave open with the DataLoader's batch per data-parallel rank (so the global batch grows with dp, as
anywhere in Lightning), and takes the feasible one with the most tokens per second (:func:`choose_layout`);
rank 0's choice is broadcast so every rank adopts the same one (:func:`adopt_layout`). Options left unset are
searched with the degrees — the schedule and its virtual stages, the microbatch count, the ZeRO level and
activation checkpointing — and the log line says why each took its value (:func:`explain_options`).

Example::

    Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))   # logs the choice
    HybridStrategy(tp=2, pp="auto", cluster=Cluster.preset("h100-sxm", nodes=4))            # given hardware
    choose_layout(model_shape, cluster, HybridOptions(tp="auto", pp="auto"), per_rank_batch=8, precision="bf16-mixed")
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn

from lightning_hybrid.options.hybrid_options import AUTO, ZERO_LEVELS, Degree, HybridOptions, default_zero_level
from lightning_hybrid.options.schedules import PLANNED_SCHEDULES
from lightning_hybrid.pipeline.runtime import NEEDS_AUTOMATIC_OPTIMIZATION
from lightning_hybrid.planner.cost import estimate
from lightning_hybrid.hardware import GIB, Cluster
from lightning_hybrid.planner.layout import CHECKPOINTING, Estimate, Layout
from lightning_hybrid.planner.live_model import measure_model, tensor_parallel_obstacles
from lightning_hybrid.planner.model import ModelShape
from lightning_hybrid.planner.hardware_probe import detect_cluster
from lightning_hybrid.planner.search import divisors, pipeline_variants, recompute_order


# ------------------------------------------------------------------------------------------------- in the run
def choose_for_run(module: nn.Module, blocks_path: str, block_call: tuple[tuple, dict], options: HybridOptions, *,
                   device: torch.device, nodes: int, devices_per_node: int, precision: str,
                   accumulation: int) -> tuple[Estimate, str]:
    """The chosen layout's estimate and a log line describing the choice, the same on every rank (rank 0's,
    broadcast; every process calls). ``block_call`` is the first block's captured call on the first batch;
    ``accumulation`` the Trainer's ``accumulate_grad_batches``. Raises ``ValueError`` when nothing fits."""
    model, tokens, obstacles = _measure_run(module, blocks_path, block_call, options, device)
    cluster, hardware = _run_cluster(options, device, nodes, devices_per_node, precision)
    outcome: list[Union[str, tuple[Estimate, str]]]
    try:
        ranked = choose_layout(model, cluster, options, tokens // model.seq_len, precision, accumulation, obstacles)
        outcome = [(ranked[0], describe_choice(ranked, cluster, hardware))]
    except ValueError as error:
        outcome = [str(error)]
    dist.broadcast_object_list(outcome, src=0)  # one choice for all ranks, even where probes measured differently
    if isinstance(outcome[0], str):
        raise ValueError(outcome[0])
    return outcome[0]


def estimate_for_run(module: nn.Module, blocks_path: str, block_call: tuple[tuple, dict], options: HybridOptions, *,
                     device: torch.device, nodes: int, devices_per_node: int, precision: str,
                     accumulation: int) -> tuple[Estimate, str]:
    """The cost model's estimate of the fixed layout ``options`` give (no ``"auto"`` degree), measured as
    :func:`choose_for_run` measures (the tensor-parallel checks left out: the run applies its plan anyway), and
    where the hardware's numbers come from. Every process calls (the CPU probe all-reduces; about 0.1 s)."""
    accelerator_rng = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=accelerator_rng):
        model, tokens = measure_model(module, blocks_path, block_call)
    cluster, hardware = _run_cluster(options, device, nodes, devices_per_node, precision)
    (layout,) = candidate_layouts(options, cluster.gpus, accumulation)
    return _estimate_for_rank_batch(model, cluster, layout, tokens // model.seq_len, precision), hardware


def _run_cluster(options: HybridOptions, device: torch.device, nodes: int, devices_per_node: int,
                 precision: str) -> tuple[Cluster, str]:
    """The cluster a run is estimated on (``cluster=`` or the detected hardware) and where its numbers come from."""
    if options.cluster is not None:
        return options.cluster, "as given (cluster=)"
    return detect_cluster(device, nodes, devices_per_node, precision)


def _measure_run(module: nn.Module, blocks_path: str, block_call: tuple[tuple, dict], options: HybridOptions,
                 device: torch.device) -> tuple[ModelShape, int, "Obstacles"]:
    """The module's shape, the tokens of its first batch, and the layouts it cannot take."""
    accelerator_rng = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=accelerator_rng):  # measuring must not shift the user's random streams
        model, tokens = measure_model(module, blocks_path, block_call)
        degrees = divisors(dist.get_world_size())[1:] if options.tp == AUTO else [int(options.tp)]
        check_on = device.type if options.verify_tp_plan else None
        obstacles = Obstacles(
            tensor_parallel=tensor_parallel_obstacles(module, blocks_path, block_call, degrees, options.tp_plan,
                                                      check_on),
            pipeline=None if getattr(module, "automatic_optimization", True) else NEEDS_AUTOMATIC_OPTIMIZATION)
    return model, tokens, obstacles


# ------------------------------------------------------------------------------------------------- choosing
def candidate_layouts(options: HybridOptions, world: int, accumulation: int = 1, per_rank_batch: int = 1,
                      layers: Optional[int] = None) -> list[Layout]:
    """Every layout of ``world`` devices that keeps ``options``' fixed degrees; ``accumulation`` is the Trainer's
    ``accumulate_grad_batches`` (the planner's microbatches when pp = 1, ``accumulate`` on top of a pipeline).
    When ``options`` choose the layout, what they leave unset varies too: the schedule, the microbatches (counts
    ≥ pp dividing ``per_rank_batch``) and virtual stages (by ``layers``), the ZeRO level and the checkpointing."""
    layouts = []
    for tp in _choices(options.tp, world):
        for pp in _choices(options.pp, world):
            rest, remainder = divmod(world, tp * pp * options.dp_replicate * options.cp)
            dp = rest if options.dp == AUTO else int(options.dp)
            if remainder or dp * tp * pp * options.dp_replicate * options.cp != world:
                continue
            base = Layout(dp=dp, tp=tp, pp=pp, dp_replicate=options.dp_replicate, ep=options.ep, cp=options.cp,
                          shard_vocab=options.shard_vocab,
                          compile=options.compile_arguments is not None, offload=options.offload,
                          reduce_dtype=options.reduce_dtype, loss_parallel=options.loss_parallel)
            layouts += [replace(variant, zero=zero, activation_checkpointing=mode)
                        for variant in _pipeline_choices(options, base, accumulation, per_rank_batch, layers)
                        for zero in _zero_choices(options, pp) for mode in _checkpointing_choices(options)]
    return layouts


def _pipeline_choices(options: HybridOptions, base: Layout, accumulation: int, per_rank_batch: int,
                      layers: Optional[int]) -> list[Layout]:
    if base.pp == 1:
        return [replace(base, microbatches=accumulation if accumulation > 1 else None)]
    base = replace(base, accumulate=accumulation)
    if not options.chooses_layout:
        return [replace(base, pp_schedule=options.pp_schedule, microbatches=options.microbatches,
                        virtual_stages=options.virtual_stages)]
    given = options.pp_schedule_given
    return pipeline_variants(base, per_rank_batch, [given] if given else PLANNED_SCHEDULES, layers,
                             options.microbatches, options.virtual_stages)


def _zero_choices(options: HybridOptions, pp: int) -> Sequence[int]:
    if options.zero_given is not None:
        return [int(options.zero_given)]
    return ZERO_LEVELS if options.chooses_layout else [default_zero_level(pp > 1)]


def _checkpointing_choices(options: HybridOptions) -> Sequence[Union[None, str, int]]:
    # Only an unset value is the planner's to choose: "none" rules checkpointing out.
    return CHECKPOINTING if options.chooses_layout and options.activation_checkpointing is None else [
        options.planned_checkpointing]


def adopt_layout(options: HybridOptions, layout: Layout) -> HybridOptions:
    """``options`` with a chosen layout: its degrees and the pipeline, ZeRO and checkpointing choices it made
    (what was given stays as given: the search kept it). ``cluster``, which served the choice, is dropped."""
    chosen = options.with_degrees(layout.dp, layout.tp, layout.pp, layout.dp_replicate)
    pipeline = dict(pp_schedule=layout.pp_schedule, microbatches=layout.microbatches,
                    virtual_stages=layout.virtual_stages) if layout.pp > 1 else {}
    mode = layout.activation_checkpointing
    return chosen.changed(zero=layout.zero, activation_checkpointing=options.activation_checkpointing
                          if mode is None else mode, **pipeline)


def _choices(degree: Degree, world: int) -> list[int]:
    return divisors(world) if degree == AUTO else [int(degree)]


@dataclass(frozen=True)
class Obstacles:
    """Why the module cannot take some layouts, beyond the cost model's own reasons."""

    tensor_parallel: Mapping[int, str] = field(default_factory=dict)  # tp degree → why the blocks refuse it
    pipeline: Optional[str] = None  # why the module cannot be pipelined at all

    def reasons(self, layout: Layout) -> tuple[str, ...]:
        reasons = [self.tensor_parallel[layout.tp]] if layout.tp in self.tensor_parallel else []
        return (*reasons, *([self.pipeline] if self.pipeline and layout.pp > 1 else []))


def _estimate_for_rank_batch(model: ModelShape, cluster: Cluster, layout: Layout, per_rank_batch: int,
                             precision: str) -> Estimate:
    """``estimate`` of ``layout`` when every data-parallel rank takes ``per_rank_batch`` sequences a step."""
    global_batch = per_rank_batch * layout.dp * layout.dp_replicate * layout.accumulation_steps
    return estimate(model, cluster, layout, global_batch, precision)


def choose_layout(model: ModelShape, cluster: Cluster, options: HybridOptions, per_rank_batch: int, precision: str,
                  accumulation: int = 1, obstacles: Obstacles = Obstacles()) -> list[Estimate]:
    """Estimates of every layout ``options`` leave open, ranked: feasible ones by tokens per second (most first;
    ties: less recomputation, less memory, the default ZeRO level), then the infeasible ones, nearest to fitting
    first. ``per_rank_batch`` is the DataLoader's batch (sequences per data-parallel rank and step). Raises
    ``ValueError`` saying what would fit when nothing does."""
    estimates = []
    for layout in candidate_layouts(options, cluster.gpus, accumulation, per_rank_batch, model.layers):
        result = _estimate_for_rank_batch(model, cluster, layout, per_rank_batch, precision)
        estimates.append(replace(result, reasons=(*result.reasons, *obstacles.reasons(layout))))
    feasible = sorted((e for e in estimates if e.feasible), key=lambda e: (
        -e.tokens_per_second, recompute_order(e.layout), e.memory.total,
        e.layout.zero != default_zero_level(e.layout.pp > 1)))
    infeasible = sorted((e for e in estimates if not e.feasible),
                        key=lambda e: (len(e.reasons) - e.out_of_memory, e.memory.total))
    if not feasible:
        raise ValueError(_nothing_fits(model, cluster, options, per_rank_batch, precision, accumulation, obstacles,
                                       infeasible))
    return feasible + infeasible


def _nothing_fits(model: ModelShape, cluster: Cluster, options: HybridOptions, per_rank_batch: int, precision: str,
                  accumulation: int, obstacles: Obstacles, ranked: list[Estimate]) -> str:
    nearest = ranked[0] if ranked else None
    message = (f"HybridStrategy(tp={options.tp!r}, pp={options.pp!r}) found no layout of {cluster.gpus} devices that"
               f" can train this model with {per_rank_batch} sequences of {model.seq_len} tokens per data-parallel"
               " rank.")
    if nearest is not None:
        message += f" The nearest, {nearest.layout}: {'; '.join(nearest.reasons)}."
    if "every" not in _checkpointing_choices(options):  # what the search did not try, suggested
        checkpointed = options.changed(activation_checkpointing="every")
        try:
            best = choose_layout(model, cluster, checkpointed, per_rank_batch, precision, accumulation, obstacles)[0]
        except ValueError:
            pass
        else:
            return message + (f" With HybridStrategy(activation_checkpointing='every') {best.layout} fits"
                              f" ({_size(best.memory.total)} per device).")
    return message + " Lower the DataLoader's batch size or add devices."


def describe_choice(ranked: Sequence[Estimate], cluster: Cluster, hardware: str) -> str:
    """One log line: the chosen layout, its predicted memory and throughput, the runner-up, why each option the
    search varied took its value (:func:`explain_options`), and the hardware."""
    chosen = ranked[0]
    memory = chosen.memory
    where = "" if memory.stage == "only" else f" ({memory.stage} pipeline stage)"
    text = (f"chose {chosen.layout} for {cluster.gpus} devices: predicted {_size(memory.total)} per device{where} of"
            f" {_size(cluster.usable_memory)} usable (model states {_size(memory.model_states)}, gathered parameters"
            f" {_size(memory.gathered_parameters)}, activations {_size(memory.activations)}, logits"
            f" {_size(memory.logits)}), {chosen.tokens_per_second:,.0f} tokens/s")
    runner_up = next((e for e in ranked[1:] if e.feasible), None)
    if runner_up is not None:
        text += f"; next {runner_up.layout} at {runner_up.tokens_per_second:,.0f} tokens/s"
    ruled_out = [e for e in ranked if not e.feasible]
    if ruled_out:
        text += f"; {len(ruled_out)} ruled out (e.g. {ruled_out[0].layout}: {ruled_out[0].reasons[0]})"
    why = explain_options(ranked)
    return text + (f". Why: {why}" if why else "") + f". Hardware: {hardware}."


#: The options besides the degrees that the search varies: title, Layout fields, how a value is written.
_OPTIONS = (
    ("microbatches", ("microbatches",), lambda layout: str(layout.microbatches or "default")),
    ("schedule", ("pp_schedule", "virtual_stages"), lambda layout: layout.pp_schedule + (
        f" v{layout.virtual_stages}" if (layout.virtual_stages or 1) > 1 else "")),
    ("ZeRO", ("zero",), lambda layout: str(layout.zero)),
    ("activation checkpointing", ("activation_checkpointing",), lambda layout: str(
        layout.activation_checkpointing or "none")),
)


def explain_options(ranked: Sequence[Estimate], alternatives: int = 3) -> str:
    """Why the chosen layout (``ranked[0]``) has its microbatches, schedule, ZeRO level and checkpointing: for
    each the search varied, up to ``alternatives`` layouts that differ from it only there, with their speed
    relative to the choice or why they cannot run; e.g. ``"microbatches 8, bubble 11% of the step (4: 0.93×);
    ZeRO 2 (3: 0.90×)"``. Empty when nothing besides the degrees was varied."""
    chosen = ranked[0]
    parts = []
    for title, fields, spell in _OPTIONS:
        others = [e for e in ranked[1:] if e.layout != chosen.layout
                  and replace(e.layout, **{name: getattr(chosen.layout, name) for name in fields}) == chosen.layout]
        if not others:
            continue
        bubble = (f", bubble {chosen.time.bubble / chosen.time.step:.0%} of the step"
                  if title == "microbatches" and chosen.time.step > 0 else "")
        compared = ", ".join(_compared(e, chosen, spell) for e in others[:alternatives])
        parts.append(f"{title} {spell(chosen.layout)}{bubble} ({compared})")
    return "; ".join(parts)


def _compared(other: Estimate, chosen: Estimate, spell: Callable[[Layout], str]) -> str:
    if not other.feasible:
        why = f"out of memory ({_size(other.memory.total)})" if other.out_of_memory else other.reasons[0]
        return f"{spell(other.layout)}: {why}"
    ratio = other.tokens_per_second / chosen.tokens_per_second
    if round(ratio, 2) != 1.0:
        return f"{spell(other.layout)}: {ratio:.2f}×"
    memory, chosen_memory = _size(other.memory.total), _size(chosen.memory.total)
    return f"{spell(other.layout)}: as fast, " + ("as much memory" if memory == chosen_memory else memory)


def _size(size_bytes: float) -> str:
    return f"{size_bytes / GIB:.2f} GiB" if size_bytes >= GIB / 10 else f"{size_bytes / 2**20:.2f} MiB"
