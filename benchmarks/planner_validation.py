"""Calibrate the layout planner's cost model (``lightning_hybrid/planner/cost.py``) on this machine and compare what it
predicts with what HybridStrategy measures here, and with published figures.

Three tables, printed as Markdown:

1. **Step time, predicted vs measured.** The cost model's constants come from this machine first:

   * *compute* (``Cluster.peak_flops``): fp32 FLOP/s of one thread on the matmuls of the GPT's linear layers at a
     two-rank data-parallel rank's token count (``(b·s) × h × 3h``, ``× h × h``, ``× h × 4h``, ``× 4h × h``,
     ``× h × V``), 15 of each back to back: FLOPs ÷ wall time (:func:`measure_matmul_flops`). Printed for one
     process alone; the predictions use the same probe run inside each measured layout by all its ranks at once,
     before the first step and after the last (the slowest rank's mean): this shared machine's speed drifts
     (±15 % over hours), and ranks that outnumber the cores get their share of one (4 ranks on 2 cores: half);
   * *links* (``intra_node_bandwidth`` = ``inter_node_bandwidth``): gloo between two processes on this machine
     (``python -m torch.distributed.run --nproc-per-node 2``), all-reduce, all-gather, reduce-scatter and
     send/receive from 1 KiB to 64 MiB. Bus bandwidth = ring bytes ÷ (time − latency) (all-reduce 2·(n−1)/n ×
     bytes, all-gather and reduce-scatter (n−1)/n × bytes, send/receive bytes: what the planner's ``_ring``
     charges), the median over 1, 4 and 16 MiB, the sizes these runs send (64 MiB, beyond the L3 cache, is
     slower again and only printed); latency = the time of a 1 KiB message. The planner has one bandwidth for
     all links: it gets the mean of the all-reduce and all-gather bus bandwidths, and their mean 1 KiB time as its
     ``latency`` (α per message);
   * ``efficiency=1.0``, ``memory_bytes`` = this machine's memory, ``overlap_communication=False`` (gloo's threads
     need the same cores as the computation: no traffic hides behind it).

   Timings wait for a quiet machine (no ``benchmarks/compare.py`` running and other processes using under a tenth
   of a core, at most 20 minutes in all), and a launch during which other processes used the cores is repeated
   once, then marked ``*``.

   Then recipes/gpt.py's GPT (:data:`CONFIG`: 4 blocks, width 256, 8 heads, vocabulary 256, sequence 128,
   3,323,392 parameters), fp32 (``"32-true"``), the recipe's AdamW, a global batch of :data:`GLOBAL_BATCH` random
   sequences, trains under ``HybridStrategy(..., monitor=False)`` in each layout of :data:`LAYOUTS`, one process per
   rank, gloo, ``OMP_NUM_THREADS=1``. A callback takes ``time.perf_counter()`` at ``on_train_batch_start`` (first
   batch of an optimizer step; with accumulation the step spans ``k`` batches) and ``on_train_batch_end`` (last
   one), and at ``on_before_optimizer_step`` (forward + backward done; the rest is AdamW and zero_grad). Per rank
   the median over the steps after :data:`WARMUP_STEPS`; the slowest rank is the layout's figure.
   ``estimate(...)`` predicts each layout with the calibrated cluster (links as measured with two processes, for
   four ranks too). Printed beside it: its terms, the CPU time of the rank's process per step (busy or waiting?),
   and a second prediction with the ``efficiency`` that makes ``single`` match (one rank: the step is all compute):
   what is left there is what the model lacks rather than a constant.

2. **Memory, predicted vs measured**: model states, activations (+ logits and the loss's log-softmax) and
   gathered parameters per rank, the largest over the ranks, measured by running ``benchmarks/memory.py``'s
   layouts with its own functions (its GPT: 4 blocks, width 128, vocabulary 64, sequence 64, global batch 16,
   fp32; what is measured and how: its docstring), next to ``estimate(...)`` for the same layouts (every-2nd-block
   and selective checkpointing included).

3. **Published figures**: ZeRO (Rajbhandari et al. 2020), Table 1: model-state memory per GPU of a 7.5B-parameter
   model on 64 GPUs with mixed-precision Adam (K = 12); and the same paper's Section 3.2 activation figure: GPT-2
   1.5B (48 layers, width 1600, 25 heads), sequence 1K, batch 32, 16-bit: "about 60 GB", "about 8 GB" with
   activation checkpointing (their 12 × hidden × batch × sequence × layers elements).

Usage::

    python benchmarks/planner_validation.py                        # all three tables (5.5 minutes on 2 cores)
    python benchmarks/planner_validation.py --layouts dp2,tp2 --steps 6
    python benchmarks/planner_validation.py --skip-steps           # calibration, memory and papers only
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import launch_ranks, markdown_table, save_rank_result  # noqa: E402
from lightning_hybrid.planner.cost import estimate  # noqa: E402
from lightning_hybrid.hardware import Cluster  # noqa: E402
from lightning_hybrid.planner.layout import Estimate, Layout  # noqa: E402
from lightning_hybrid.planner.model import ModelShape  # noqa: E402
from recipes.gpt import GPTConfig  # noqa: E402

CONFIG = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=8, n_embd=256)
GLOBAL_BATCH = 16  # sequences per optimizer step over all data-parallel ranks
PROBE_TOKENS = GLOBAL_BATCH * CONFIG.block_size // 2  # matmul rows of the compute calibration: a dp2 rank's tokens
WARMUP_STEPS = 2  # optimizer steps left out: pipeline shape inference, AdamW's lazy state, allocator warm-up
TIMED_STEPS = 8
PRECISION = "32-true"
MiB = 2**20
LAUNCH_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Run:
    """One measured layout: ``world`` processes, the HybridStrategy arguments, Lightning's gradient accumulation,
    and the same layout for the planner."""

    name: str
    world: int
    strategy: dict[str, Any]
    planned: Layout
    accumulate: int = 1


LAYOUTS = [
    Run("single", 1, {"dp": 1}, Layout()),
    Run("single-acc4", 1, {"dp": 1}, Layout(microbatches=4), accumulate=4),
    Run("dp2", 2, {"dp": 2, "zero": 3}, Layout(dp=2, zero=3)),
    Run("dp2-acc2", 2, {"dp": 2, "zero": 3}, Layout(dp=2, zero=3, microbatches=2), accumulate=2),
    Run("tp2", 2, {"dp": 1, "tp": 2}, Layout(tp=2)),
    Run("pp2", 2, {"dp": 1, "pp": 2, "pp_schedule": "1f1b", "microbatches": 4}, Layout(pp=2, microbatches=4)),
    Run("dp2-tp2", 4, {"dp": 2, "tp": 2}, Layout(dp=2, tp=2)),
]
BY_NAME = {run.name: run for run in LAYOUTS}


# ============================================================================================== calibration
def matmul_shapes(tokens: int, config: GPTConfig = CONFIG) -> list[tuple[str, int, int, int]]:
    """(name, rows, inner, columns) of the GPT's linear layers for ``tokens`` tokens."""
    h, v = config.n_embd, config.vocab_size
    return [("c_attn", tokens, h, 3 * h), ("attn.c_proj", tokens, h, h), ("c_fc", tokens, h, 4 * h),
            ("mlp.c_proj", tokens, 4 * h, h), ("lm_head", tokens, h, v)]


class MatmulRate(NamedTuple):
    """What :func:`measure_matmul_flops` measured."""

    flops_per_second: float  # all timed FLOPs ÷ their wall time
    per_shape: list[tuple[str, float]]  # (shape, FLOP/s)
    executed_flops: float  # warm-up included


def measure_matmul_flops(tokens: int, repeats: int = 15, warmup: int = 3) -> MatmulRate:
    """fp32 FLOP/s of one thread on :func:`matmul_shapes`, ``repeats`` of each back to back after ``warmup`` (MKL's
    first call picks kernels and allocates). Wall time of the whole loop, not a per-call median: a process that
    shares a core (more ranks than cores) or is interrupted computes at the share it gets, as a rank does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        timed_flops = timed_seconds = executed = 0.0
        per_shape = []
        for name, rows, inner, columns in matmul_shapes(tokens):
            a, b = torch.randn(rows, inner), torch.randn(inner, columns)
            for _ in range(warmup):
                a @ b
            start = time.perf_counter()
            for _ in range(repeats):
                a @ b
            seconds, flops = time.perf_counter() - start, 2.0 * rows * inner * columns * repeats
            per_shape.append((f"{name} {rows}×{inner}×{columns}", flops / seconds))
            timed_flops, timed_seconds = timed_flops + flops, timed_seconds + seconds
            executed += flops * (repeats + warmup) / repeats
        return MatmulRate(timed_flops / timed_seconds, per_shape, executed)
    finally:
        torch.set_num_threads(threads)


LINK_SIZES = [2**k for k in range(10, 27, 2)]  # bytes: 1 KiB ... 64 MiB
#: Bytes the planner's ``_ring`` charges per byte of the full tensor, two ranks: all-reduce 2·(n−1)/n, all-gather
#: (n−1)/n, a send 1.
BUS_FACTOR = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "send_recv": 1.0}


def links_worker(out: Path) -> None:
    """Rank's side of the link calibration (2 ranks): median seconds per size of each collective (rank 0's are
    used)."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict[str, list[float]] = {}
    for kind in BUS_FACTOR:
        results[kind] = []
        for size in LINK_SIZES:
            tensor = torch.ones(size // 4)
            gathered = torch.empty(size // 4 * world)
            repeats = max(3, min(40, 2**24 // size))

            def once() -> None:
                if kind == "all_reduce":
                    dist.all_reduce(tensor)
                elif kind == "all_gather":  # the full tensor (what FSDP2 gathers) is `size` bytes
                    dist.all_gather_into_tensor(gathered[: size // 4], tensor[: size // 4 // world])
                elif kind == "reduce_scatter":  # `size` bytes in (FSDP2's unsharded gradients), a shard out
                    dist.reduce_scatter_tensor(gathered[: size // 4 // world], tensor)
                elif rank == 0:  # one message each way: time / 2 is one send's
                    dist.send(tensor, 1)
                    dist.recv(tensor, 1)
                else:
                    dist.recv(tensor, 0)
                    dist.send(tensor, 0)

            once()
            times = []
            for _ in range(repeats):
                dist.barrier()
                start = time.perf_counter()
                once()
                times.append(time.perf_counter() - start)
            results[kind].append(statistics.median(times) / (2 if kind == "send_recv" else 1))
    save_rank_result(out, results)
    dist.barrier()
    dist.destroy_process_group()


#: Message sizes of the measured layouts (TP all-reduces 1-2 MiB, FSDP units up to 3.2 MB, pipeline sends 0.5 MiB):
#: the bus bandwidth is their median. At 64 MiB gloo is slower again (beyond the 32 MiB L3 cache).
MODEL_MESSAGE_SIZES = (2**20, 2**22, 2**24)


@dataclass
class LinkFit:
    """One collective on this machine: seconds per size of :data:`LINK_SIZES`, latency (the 1 KiB time), and bus
    bandwidth = ring bytes ÷ (time − latency), the median over :data:`MODEL_MESSAGE_SIZES` and at 64 MiB."""

    kind: str
    seconds: list[float]

    @property
    def latency(self) -> float:
        return self.seconds[0]

    def bus_bandwidth_at(self, size: int) -> float:
        return BUS_FACTOR[self.kind] * size / (self.seconds[LINK_SIZES.index(size)] - self.latency)

    @property
    def bus_bandwidth(self) -> float:
        return statistics.median(self.bus_bandwidth_at(size) for size in MODEL_MESSAGE_SIZES)


def measure_links() -> dict[str, LinkFit]:
    measured = launch_ranks(Path(__file__), ["--worker", "links"], world=2, timeout_s=LAUNCH_TIMEOUT_S).ranks[0]
    return {kind: LinkFit(kind, seconds) for kind, seconds in measured.items()}


def calibrated_cluster(world: int, flops: float, bandwidth: float, latency: float = 0.0) -> Cluster:
    """This machine as a planner cluster of ``world`` ranks computing at ``flops`` each; gloo reduces on the cores
    that compute, so no communication overlaps it."""
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Cluster(nodes=1, gpus_per_node=world, memory_bytes=memory, peak_flops=flops,
                   intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, efficiency=1.0, latency=latency,
                   overlap_communication=False)


# ================================================================================================ step time
def make_step_clock(k: int) -> Any:
    """A callback timing each optimizer step of ``k`` accumulated batches (defined on first use: the parent never
    imports Lightning)."""
    import lightning.pytorch as pl

    class StepClock(pl.Callback):
        """Times of each optimizer step's first batch start, its optimizer hook and its last batch end."""

        def __init__(self) -> None:
            self.starts: list[float] = []
            self.before_optimizer: list[float] = []
            self.ends: list[float] = []
            self.cpu_starts: list[float] = []
            self.cpu_ends: list[float] = []

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % k == 0:
                self.starts.append(time.perf_counter())
                self.cpu_starts.append(time.process_time())

        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            self.before_optimizer.append(time.perf_counter())

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx % k == k - 1:
                self.ends.append(time.perf_counter())
                self.cpu_ends.append(time.process_time())

    return StepClock()


def make_compute_probe() -> Any:
    """A callback probing this rank's matmul FLOP/s before the first step and after the last."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    class ComputeProbe(pl.Callback):
        """``peak_flops`` of this rank, measured in the run before the first step and after the last: all ranks
        leave a barrier and run :func:`measure_matmul_flops`; FLOPs ÷ the time from the barrier to the rank's end
        (a rank that had to wait for a core to start counts that wait)."""

        def __init__(self) -> None:
            self.flops: list[float] = []

        def _probe(self) -> None:
            if dist.is_initialized():
                dist.barrier()
            start = time.perf_counter()
            executed = measure_matmul_flops(PROBE_TOKENS).executed_flops
            self.flops.append(executed / (time.perf_counter() - start))

        def on_train_start(self, trainer: Any, module: Any) -> None:
            self._probe()

        def on_train_end(self, trainer: Any, module: Any) -> None:
            self._probe()

    return ComputeProbe()


def step_worker(run: Run, steps: int, out: Path) -> None:
    """One rank of a measured layout: train, time every optimizer step, save this rank's times."""
    import logging

    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridStrategy
    from recipes.gpt import GPTLightning

    warnings.simplefilter("ignore")  # Lightning's advice about dataloader workers and logging on tiny runs
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    k = run.accumulate
    torch.manual_seed(0)
    module = GPTLightning(CONFIG, max_steps=steps)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * steps, CONFIG.block_size + 1))
    data = TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    clock, probe = make_step_clock(k), make_compute_probe()
    trainer = pl.Trainer(
        accelerator="cpu", devices=run.world, strategy=HybridStrategy(**run.strategy, monitor=False),
        precision=PRECISION, max_steps=steps, accumulate_grad_batches=k, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        callbacks=[clock, probe])
    # The sampler deals sequences out over the data-parallel ranks; each loader batch is one accumulation step.
    trainer.fit(module, DataLoader(data, batch_size=GLOBAL_BATCH // (run.planned.dp * k)))
    record = {"step": [end - start for start, end in zip(clock.starts, clock.ends)],
              "forward_backward": [mark - start for start, mark in zip(clock.starts, clock.before_optimizer)],
              "cpu": [end - start for start, end in zip(clock.cpu_starts, clock.cpu_ends)], "flops": probe.flops}
    save_rank_result(out, record, trainer.global_rank)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo crashes at interpreter exit otherwise


@dataclass
class Measured:
    """A layout's median seconds after warm-up, the largest over its ranks: the optimizer step, its forward +
    backward (the rest is AdamW, zero_grad and Lightning's hooks), and the CPU time of the rank's process in it
    (below the step: the rank waited; above: its threads ran on several cores)."""

    step: float
    forward_backward: float
    cpu: float  # CPU seconds of the rank's process (all its threads, gloo's included) per step
    flops: float  # matmul FLOP/s of the slowest rank, all computing at once, before and after training
    disturbed: bool = False  # other processes used the cores meanwhile, twice in a row


def measure_steps(run: Run, steps: int, quiet: QuietMachine) -> Measured:
    """Launch ``run`` on a quiet machine; once more if other processes used the cores meanwhile."""
    for attempt in range(2):
        quiet.wait()
        arguments = ["--worker", "steps", run.name, "--steps", steps]
        launched, disturbed = quiet.others_during(
            lambda: launch_ranks(Path(__file__), arguments, world=run.world, timeout_s=LAUNCH_TIMEOUT_S))
        ranks = launched.ranks
        if not disturbed:
            break

    def slowest(key: str) -> float:
        return max(statistics.median(rank[key][WARMUP_STEPS:]) for rank in ranks)

    flops = min(statistics.mean(rank["flops"]) for rank in ranks)  # the slowest rank sets a step's pace
    return Measured(slowest("step"), slowest("forward_backward"), slowest("cpu"), flops, disturbed)


def gpt_shape(config: GPTConfig) -> ModelShape:
    return ModelShape.from_module("recipes.gpt:GPTLightning", {"config": asdict(config)}, seq_len=config.block_size,
                                  heads=config.n_head)


@dataclass
class StepRow:
    run: Run
    measured: Measured
    predicted: Estimate  # the planner as it is, with the calibrated constants
    adjusted: Estimate  # the same with single's efficiency


def step_rows(runs: list[Run], measured: dict[str, Measured], bandwidth: float,
              latency: float) -> tuple[float, list[StepRow]]:
    """Each run's measurement and predictions with the FLOP/s probed in that run and the calibrated links; and the
    efficiency that makes ``single`` (one rank: all compute) match, 1 if it was not measured."""
    model = gpt_shape(CONFIG)

    def predict(run: Run, efficiency: float) -> Estimate:
        cluster = replace(calibrated_cluster(run.world, measured[run.name].flops, bandwidth, latency),
                          efficiency=efficiency)
        return estimate(model, cluster, run.planned, GLOBAL_BATCH, PRECISION)

    single = BY_NAME["single"]
    efficiency = min(1.0, predict(single, 1.0).time.step / measured["single"].step) if "single" in measured else 1.0
    return efficiency, [StepRow(run, measured[run.name], predict(run, 1.0), predict(run, efficiency)) for run in runs]


STEP_HEADER = ["layout", "ranks", "GFLOP/s per rank", "measured step s", "fwd+bwd s", "CPU s", "predicted s", "error",
               "compute", "tp", "pp", "dp (all)", "dp exposed", "bubble", "with single's efficiency: predicted s",
               "error"]


def step_table(rows: list[StepRow]) -> str:
    cells = []
    for row in rows:
        time_, measured = row.predicted.time, row.measured
        terms = [time_.compute, time_.tensor_parallel, time_.pipeline, time_.data_parallel,
                 time_.data_parallel_exposed, time_.bubble]
        cells.append([row.run.name, row.run.world, f"{measured.flops / 1e9:.1f}",
                      f"{measured.step:.3f}{'*' if measured.disturbed else ''}", f"{measured.forward_backward:.3f}",
                      f"{measured.cpu:.3f}", f"{time_.step:.3f}", relative_error(time_.step, measured.step),
                      *(f"{value:.3f}" for value in terms), f"{row.adjusted.time.step:.3f}",
                      relative_error(row.adjusted.time.step, measured.step)])
    return markdown_table(STEP_HEADER, cells)


def relative_error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}"


# =================================================================================================== memory
#: ``benchmarks/memory.py``'s layouts, as the planner writes them: ranks, layout.
MEMORY_LAYOUTS: dict[str, tuple[int, Layout]] = {
    "dp1": (1, Layout()),  # HybridStrategy on one rank ("single" is plain Lightning, no strategy)
    "dp1-ac": (1, Layout(activation_checkpointing="every")),
    "dp2-z3": (2, Layout(dp=2, zero=3)),
    "dp2-z2": (2, Layout(dp=2, zero=2)),
    "dp4": (4, Layout(dp=4)),
    "tp2": (2, Layout(tp=2)),
    "dp2-tp2": (4, Layout(dp=2, tp=2)),
    "pp2": (2, Layout(pp=2, microbatches=2)),
    "pp2-gpipe-m4": (2, Layout(pp=2, pp_schedule="gpipe", microbatches=4)),
    "tp2-pp2": (4, Layout(tp=2, pp=2, microbatches=2)),
    "dp2-z3-ac": (2, Layout(dp=2, zero=3, activation_checkpointing="every")),
    "tp2-ac": (2, Layout(tp=2, activation_checkpointing="every")),
    "pp2-ac": (2, Layout(pp=2, microbatches=2, activation_checkpointing="every")),
    "dp1-ac2": (1, Layout(activation_checkpointing=2)),
    "dp1-sac": (1, Layout(activation_checkpointing="selective")),
    "tp2-sac": (2, Layout(tp=2, activation_checkpointing="selective")),
}


def measure_memory(name: str) -> dict[str, float]:
    """Run ``benchmarks/memory.py``'s layout ``name`` and return the largest MiB over its ranks of model states,
    activations (logits and the loss's log-softmax included) and gathered parameters."""
    from benchmarks import memory as memory_benchmark

    layout = memory_benchmark.BY_NAME[name]
    rows = memory_benchmark.table_rows(layout, memory_benchmark.launch(layout))
    return {"states": max(row["states_mib"] for row in rows), "activations": max(row["act_mib"] for row in rows),
            "gathered": max(row["gathered_mib"] for row in rows)}


def memory_table() -> str:
    from benchmarks.memory import CONFIG as MEMORY_CONFIG, GLOBAL_BATCH as MEMORY_GLOBAL_BATCH

    model = gpt_shape(MEMORY_CONFIG)
    rows = []
    for name, (world, layout) in MEMORY_LAYOUTS.items():
        measured = measure_memory(name)
        cluster = calibrated_cluster(world, flops=1e9, bandwidth=1e9)  # memory does not depend on speeds
        memory = estimate(model, cluster, layout, MEMORY_GLOBAL_BATCH, PRECISION).memory
        pairs = [(memory.model_states, measured["states"]), (memory.activations + memory.logits,
                                                               measured["activations"]),
                 (memory.gathered_parameters, measured["gathered"])]
        cells = []
        for predicted_bytes, measured_mib in pairs:
            predicted = predicted_bytes / MiB
            error = relative_error(predicted, measured_mib) if measured_mib else "-"
            cells += [f"{predicted:.2f}", f"{measured_mib:.2f}", error]
        rows.append([name, *cells])
    return markdown_table(["layout", "model states MiB: predicted", "measured", "error",
                           "activations + logits MiB: predicted", "measured", "error",
                           "gathered params MiB: predicted", "measured", "error"], rows)


# =================================================================================================== papers
def papers_table() -> str:
    """ZeRO Table 1 (7.5B parameters, Nd = 64, K = 12) and ZeRO Section 3.2's GPT-2 1.5B activations."""
    rows = []
    zero_model = ModelShape(layers=30, hidden=4096, heads=32, vocab=32000, seq_len=1024,
                            parameters_per_block=250_000_000, first_stage_parameters=0, last_stage_parameters=0)
    cluster = Cluster.preset("a100-80gb", nodes=8)  # 64 GPUs; memory is what is compared, the GPU does not matter
    baseline = estimate(zero_model, cluster, Layout(dp=1, dp_replicate=64), 64).memory
    zero2 = estimate(zero_model, cluster, Layout(dp=64, zero=2), 64).memory
    zero3 = estimate(zero_model, cluster, Layout(dp=64, zero=3), 64).memory
    source = "ZeRO Table 1, 7.5B, Nd=64, K=12"
    rows.append((source, "baseline (DP)", "rep64 (HSDP, no sharding): model states", baseline.model_states, 120e9))
    rows.append((source, "P_os", "not offered (FSDP2 shards gradients too)", None, 31.4e9))
    # FSDP2's two blocks of transient buffers at its peak (counted in gathered) are not in the paper's figure.
    buffers = 2 * zero_model.parameters_per_block * 2
    rows.append((source, "P_os+g", "dp64 z2: model states + gathered bf16 parameters (less 2 blocks' buffers)",
                 zero2.model_states + zero2.gathered_parameters - buffers, 16.6e9))
    rows.append((source, "P_os+g+p", "dp64 z3: model states", zero3.model_states, 1.88e9))
    # GPT-2 1.5B as in the ZeRO paper: 48 layers, width 1600, 25 heads, sequence 1024, batch 32, 16-bit.
    gpt2 = ModelShape(layers=48, hidden=1600, heads=25, vocab=50257, seq_len=1024)
    source = "ZeRO §3.2, GPT-2 1.5B, s=1K, b=32"
    for label, shape in (("flash SDPA, no dropout (default)", gpt2),
                         ("Korthikanti: dropout, materialized scores",
                          replace(gpt2, dropout=True, flash_attention=False))):
        cluster = Cluster.preset("h100-sxm", nodes=1, gpus_per_node=1, memory_bytes=1e15)  # no memory limit
        for checkpointing, published in ((None, 60e9), ("every", 8e9)):
            memory = estimate(shape, cluster, Layout(activation_checkpointing=checkpointing), 32).memory
            what = "activations" + (", every block checkpointed" if checkpointing else "")
            rows.append((source, what, f"{label}: blocks' activations (logits left out)", memory.activations,
                         published))
    cells = [[source, quantity, counterpart, *(["-", f"{published / 1e9:g}", "-"] if predicted is None else [
        f"{predicted / 1e9:.2f}", f"{published / 1e9:g}", relative_error(predicted, published)])]
        for source, quantity, counterpart, predicted, published in rows]
    return markdown_table(["source", "published quantity", "planner's counterpart", "predicted GB", "published GB",
                           "error"], cells)


# ===================================================================================================== main
def busy_cpu_seconds() -> float:
    """CPU seconds all processes of this machine have run since boot (``/proc/stat``: all but idle and iowait)."""
    user, nice, system, idle, iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU seconds of this process, of its finished children and of its live children with their finished ones:
    the launched ranks are children of the harness's fork server, which lives on and reaps them."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime + live_children_cpu_seconds()


def live_children_cpu_seconds() -> float:
    """CPU seconds of this process's live children and of the children they reaped (``/proc/<pid>/stat``: utime,
    stime, cutime, cstime)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # "pid (command) state ppid ...": the command may hold spaces and parentheses, so split after it.
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # the process ended meanwhile
            continue
        if int(fields[1]) == os.getpid():
            ticks += sum(int(value) for value in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclass
class QuietMachine:
    """Timings need the cores to themselves. :meth:`wait` blocks while another timing benchmark (a process whose
    command line contains ``pattern``) runs or other processes keep more than ``busy_cores`` cores busy, polling
    every ``poll_s``, for at most ``limit_s`` over the whole run (then it warns once and lets measurements
    proceed). :meth:`others_during` tells whether other processes used the cores while a measurement ran."""

    pattern: str = "benchmarks/compare.py"
    busy_cores: float = 0.1
    poll_s: float = 30.0
    limit_s: float = 1200.0
    waited_s: float = 0.0
    warned: bool = False

    def other_benchmark(self) -> bool:
        return subprocess.run(["pgrep", "-f", self.pattern], capture_output=True).returncode == 0

    def others_busy(self, sample_s: float = 3.0) -> bool:
        return self.others_during(lambda: time.sleep(sample_s))[1]

    def others_during(self, action: Any) -> tuple[Any, bool]:
        """Run ``action()``; also say whether other processes kept more than ``busy_cores`` cores busy meanwhile."""
        busy, own, start = busy_cpu_seconds(), own_cpu_seconds(), time.perf_counter()
        result = action()
        others = (busy_cpu_seconds() - busy) - (own_cpu_seconds() - own)
        return result, others / (time.perf_counter() - start) > self.busy_cores

    def wait(self) -> None:
        while (self.other_benchmark() or self.others_busy()) and self.waited_s < self.limit_s:
            time.sleep(self.poll_s)
            self.waited_s += self.poll_s
        if self.waited_s >= self.limit_s and not self.warned:
            print(f"WARNING: the machine was still busy after {self.limit_s / 60:.0f} minutes of waiting: timings may"
                  " be disturbed (marked *).\n", flush=True)
            self.warned = True


def calibration_table(alone: MatmulRate, links: dict[str, LinkFit], bandwidth: float, latency: float) -> str:
    """The planner's constants as measured: matmul FLOP/s per shape, gloo's latency and bus bandwidth per
    collective, and the link bandwidth and latency the planner gets."""
    rows = [[f"matmul {shape}, fp32", f"{shape_flops / 1e9:.1f} GFLOP/s"] for shape, shape_flops in alone.per_shape]
    rows.append(["matmul FLOP/s, all shapes, one process alone", f"{alone.flops_per_second / 1e9:.1f} GFLOP/s"])
    rows += [[f"gloo {fit.kind}: latency (1 KiB) / bus bandwidth (1-16 MiB; 64 MiB)",
              f"{fit.latency * 1e6:.0f} µs / {fit.bus_bandwidth / 1e9:.2f} GB/s;"
              f" {fit.bus_bandwidth_at(LINK_SIZES[-1]) / 1e9:.2f} GB/s"] for fit in links.values()]
    rows.append(["**link bandwidth** (mean of all-reduce and all-gather)", f"**{bandwidth / 1e9:.2f} GB/s**"])
    rows.append(["**link latency** (mean of all-reduce and all-gather at 1 KiB)", f"**{latency * 1e6:.0f} µs**"])
    return markdown_table(["constant", "value"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", default=",".join(BY_NAME), help=f"comma-separated, of {', '.join(BY_NAME)}")
    parser.add_argument("--steps", type=int, default=WARMUP_STEPS + TIMED_STEPS, help="optimizer steps per layout")
    parser.add_argument("--skip-steps", action="store_true", help="calibration, memory and papers only")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)  # "links" or "steps LAYOUT"
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        if args.worker[0] == "links":
            links_worker(args.out)
        else:
            step_worker(BY_NAME[args.worker[1]], args.steps, args.out)
        return
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must exceed the {WARMUP_STEPS} warm-up steps")
    runs = [BY_NAME[name] for name in args.layouts.split(",")]
    quiet, started = QuietMachine(), time.perf_counter()
    for attempt in range(2):  # once more if other processes used the cores meanwhile
        quiet.wait()
        (alone, links), disturbed = quiet.others_during(lambda: (measure_matmul_flops(PROBE_TOKENS), measure_links()))
        if not disturbed:
            break
    bandwidth = (links["all_reduce"].bus_bandwidth + links["all_gather"].bus_bandwidth) / 2
    latency = (links["all_reduce"].latency + links["all_gather"].latency) / 2
    print(f"## Calibration ({os.cpu_count()} cores, torch {torch.__version__}, one thread per process)"
          + (" -- DISTURBED by other processes" if disturbed else "") + "\n")
    print(calibration_table(alone, links, bandwidth, latency))
    print("\nSeconds per size (1 KiB ... 64 MiB, ×4):")
    for fit in links.values():
        print(f"  {fit.kind:10s} " + " ".join(f"{seconds * 1e3:.3f}" for seconds in fit.seconds) + " ms")

    if not args.skip_steps:
        measured = {run.name: measure_steps(run, args.steps, quiet) for run in runs}
        efficiency, rows = step_rows(runs, measured, bandwidth, latency)
        print(f"\n## Step time: {GLOBAL_BATCH} sequences of {CONFIG.block_size}, fp32, predicted vs measured\n")
        print(f"Terms: the prediction's seconds on the busiest rank. Efficiency fitted on single: {efficiency:.2f}."
              " * = other processes used the cores meanwhile.\n")
        print(step_table(rows))
    print("\n## Memory per rank: predicted vs measured by benchmarks/memory.py (largest over ranks)\n")
    print(memory_table())
    print("\n## Published figures\n")
    print(papers_table())
    print(f"\n({time.perf_counter() - started - quiet.waited_s:.0f} s measuring, {quiet.waited_s:.0f} s waiting for a"
          " quiet machine)")


if __name__ == "__main__":
    main()
