"""The planner against a published run at scale: Narayanan et al. 2021 ("Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC21), Table 1 — GPT 1.7B to 1T on 32 to 3072 A100-80GB (DGX A100:
8 GPUs on NVLink, one 200 Gb/s HDR port per GPU), sequence 2048, vocabulary 51,200, full activation recomputation.

Each row's configuration is the paper's released script, ``examples/sc21/run_table_1.sh`` of NVIDIA/Megatron-LM:
tensor and pipeline degrees, microbatch size (16 at 1.7B–7.5B, 8, 4, 2, 2, 1, 1, 1), layers per virtual stage (5
at 76B and 145B, 3 at 310B, 1 at 530B: v = 3, 2, 2, 3; none at 39B and 1T: 1F1B), ``--recompute-method uniform``,
fp16, dropout 0.1 (Megatron's default) and its fused kernels, no flash attention (2021). Data parallelism fills the
GPUs, d = n/(t·p); the pipeline's microbatches are m = B/(d·b).

The planner predicts HybridStrategy on that hardware with that configuration (``Cluster.preset("a100-80gb")``,
bf16-mixed, the strategy's defaults: ZeRO-3 without a pipeline, ZeRO-2 with one, the vocabulary sharded over tp, the
tied embedding kept on the first and last stage) and the predicted TFLOP/s per GPU are counted as the paper counts
its own: F = 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h)) FLOPs per iteration (recomputed forward included) ÷ (step
time × GPUs). The model is the paper's: per block 12h² + 13h parameters (biases; 6h of them, the norms and the
row-parallel biases, whole over tp), learned position embeddings, tied head.

Where HybridStrategy differs from the published system, the planner counts what HybridStrategy does:

* FSDP2 (ZeRO-3 / ZeRO-2) instead of Megatron's data-parallel all-reduce: the same gradient bytes (a fp32
  reduce-scatter instead of a fp16 all-reduce) plus the all-gathers, which hide behind compute;
* pipeline messages: each tp rank sends the whole b·s·h activation over its own NIC (Megatron's scatter/gather sends
  1/t of it and all-gathers over NVLink);
* receive buffers as the pipeline runtime allocates them (on arrival, freed after use, as Megatron does): one
  activation posted ahead of its forward and two gradients per rank, b·s·h each, whatever m: every published
  configuration fits, 1T included; ``--best`` searches the fastest layout on each row's (t, p).

Usage::

    python benchmarks/planner_megatron.py             # the table: published vs predicted, per row (about 1 s)
    python benchmarks/planner_megatron.py --terms     # each row's predicted time terms and memory
    python benchmarks/planner_megatron.py --best      # + the fastest layout HybridStrategy fits on each row's (t, p)
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Optional

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import markdown_table  # noqa: E402
from lightning_hybrid.planner.cost import estimate  # noqa: E402
from lightning_hybrid.hardware import GIB, Cluster  # noqa: E402
from lightning_hybrid.planner.layout import Estimate, Layout  # noqa: E402
from lightning_hybrid.planner.model import ModelShape  # noqa: E402
from lightning_hybrid.planner.search import divisors  # noqa: E402

SEQUENCE, VOCABULARY = 2048, 51_200


class Row(NamedTuple):
    """One Table 1 row: billions of parameters, heads, hidden, layers, t, p, GPUs, global batch, published TFLOP/s
    per GPU; and from run_table_1.sh the microbatch size and the virtual stages per pipeline rank."""

    billions: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    gpus: int
    batch: int
    published_tflops: float
    micro_batch: int
    virtual_stages: int


TABLE_1 = (
    Row(1.7, 24, 2304, 24, 1, 1, 32, 512, 137, 16, 1),
    Row(3.6, 32, 3072, 30, 2, 1, 64, 512, 138, 16, 1),
    Row(7.5, 32, 4096, 36, 4, 1, 128, 512, 142, 16, 1),
    Row(18.4, 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 1),
    Row(39.1, 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 1),
    Row(76.1, 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 3),
    Row(145.6, 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 2),
    Row(310.1, 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 2),
    Row(529.6, 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 3),
    Row(1008.0, 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 1),
)


def megatron_gpt(row: Row) -> ModelShape:
    """The paper's GPT: 12h² + 13h parameters per block, learned positions, tied head, dropout, fused kernels,
    attention scores materialized."""
    h = row.hidden
    return ModelShape(layers=row.layers, hidden=h, heads=row.heads, vocab=VOCABULARY, seq_len=SEQUENCE,
                      parameters_per_block=12 * h * h + 13 * h, whole_parameters_per_block=6 * h,
                      first_stage_parameters=(VOCABULARY + SEQUENCE) * h, last_stage_parameters=2 * h,
                      tied_embeddings=True, dropout=True, flash_attention=False, fused_elementwise=True)


def a100_cluster(row: Row) -> Cluster:
    return Cluster.preset("a100-80gb", nodes=row.gpus // 8)


def published_layout(row: Row) -> Layout:
    """run_table_1.sh's configuration as HybridStrategy arguments."""
    dp = row.gpus // (row.tp * row.pp)
    microbatches = row.batch // (dp * row.micro_batch)
    if row.pp == 1:  # Megatron's microbatches without a pipeline are gradient accumulation
        return Layout(dp=dp, tp=row.tp, activation_checkpointing="every",
                      microbatches=microbatches if microbatches > 1 else None)
    schedule = "interleaved_1f1b" if row.virtual_stages > 1 else "1f1b"
    return Layout(dp=dp, tp=row.tp, pp=row.pp, zero=2, activation_checkpointing="every", pp_schedule=schedule,
                  microbatches=microbatches, virtual_stages=row.virtual_stages)


def paper_flops(row: Row) -> float:
    """Equation (3): FLOPs per iteration, the recomputed forward included."""
    s, h, l = SEQUENCE, row.hidden, row.layers
    return 96 * row.batch * s * l * h * h * (1 + s / (6 * h) + VOCABULARY / (16 * l * h))


def tflops_per_gpu(row: Row, result: Estimate) -> float:
    return paper_flops(row) / (result.time.step * row.gpus) / 1e12


def predict(row: Row, layout: Optional[Layout] = None) -> Estimate:
    return estimate(megatron_gpt(row), a100_cluster(row), layout or published_layout(row), row.batch)


def variants(row: Row) -> list[Layout]:
    """Layouts on the row's (t, p) with full recomputation, as published: both ZeRO levels, every microbatch count
    and (pp > 1) schedule, balanced virtual stages and gradient accumulation on top of the pipeline."""
    base = published_layout(row)
    per_replica = row.batch // base.dp
    if row.pp == 1:
        return [replace(base, zero=zero, microbatches=k if k > 1 else None)
                for zero in (2, 3) for k in divisors(per_replica)]
    layouts = []
    for accumulate in divisors(per_replica):
        for m in (k for k in divisors(per_replica // accumulate) if k >= row.pp):
            stages = [1] + [v for v in range(2, row.layers // row.pp + 1) if row.layers % (row.pp * v) == 0]
            layouts += [replace(base, zero=zero, microbatches=m, accumulate=accumulate, virtual_stages=v,
                                pp_schedule="interleaved_1f1b" if v > 1 else "1f1b")
                        for zero in (2, 3) for v in stages]
    return layouts


def best_variant(row: Row) -> Optional[Estimate]:
    """The fastest of :func:`variants` that fits, or None."""
    fitting = [e for e in (predict(row, layout) for layout in variants(row)) if e.feasible]
    return min(fitting, key=lambda e: e.time.step, default=None)


def _fits(result: Estimate) -> str:
    if result.feasible:
        return f"yes ({result.memory.total / GIB:.1f} GiB)"
    return f"no: {result.memory.total / GIB:.1f} GiB on the {result.memory.stage} stage"


def table(best: bool) -> str:
    header = ["params (B)", "t", "p", "d", "GPUs", "b", "m", "v", "published TFLOP/s", "predicted TFLOP/s",
              "predicted / published", "fits under HybridStrategy (80 GiB)"]
    if best:
        header += ["best layout that fits", "its TFLOP/s", "/ published"]
    rows = []
    for row in TABLE_1:
        layout, result = published_layout(row), predict(row)
        tflops = tflops_per_gpu(row, result)
        cells = [f"{row.billions:g}", str(row.tp), str(row.pp), str(layout.dp), str(row.gpus), str(row.micro_batch),
                 str(result.layout.microbatches or 1), str(row.virtual_stages), f"{row.published_tflops:g}",
                 f"{tflops:.1f}", f"{tflops / row.published_tflops:.2f}", _fits(result)]
        if best:
            chosen = best_variant(row)
            cells += ["none"] * 3 if chosen is None else [
                str(chosen.layout), f"{tflops_per_gpu(row, chosen):.1f}",
                f"{tflops_per_gpu(row, chosen) / row.published_tflops:.2f}"]
        rows.append(cells)
    return markdown_table(header, rows)


def terms() -> str:
    """Each row's predicted seconds per step by term and its memory on the fullest stage."""
    header = ["params (B)", "step s", "matmul s", "memory-bound s", "tp s", "pp s", "bubble s", "dp exposed s",
              "optimizer s", "states GiB", "gathered GiB", "activations GiB", "of which receive buffers GiB"]
    rows = []
    for row in TABLE_1:
        time, memory = predict(row).time, predict(row).memory
        seconds = [time.step, time.compute - time.memory_bound, time.memory_bound, time.tensor_parallel,
                   time.pipeline, time.bubble, time.data_parallel_exposed, time.optimizer]
        sizes = [memory.model_states, memory.gathered_parameters, memory.activations, memory.receive_buffers]
        rows.append([f"{row.billions:g}", *(f"{value:.2f}" for value in seconds),
                     *(f"{value / GIB:.1f}" for value in sizes)])
    return markdown_table(header, rows)


#: Printed under the table: how the prediction, which is HybridStrategy's, differs from the published system.
DIFFERENCES = (
    "Predicted: HybridStrategy on the published configuration. It differs from Megatron-LM 2021 in: FSDP2 instead"
    " of a data-parallel all-reduce (the same gradient bytes, all-gathers hidden); whole b·s·h pipeline messages from"
    " every tp rank (Megatron's scatter/gather sends 1/t); fp32 unsharded gradient accumulation per microbatch under"
    " a pipeline; receive buffers allocated on arrival and freed after use (at most three b·s·h per rank, so every"
    " published configuration fits, 1T included).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--terms", action="store_true", help="also print each row's time terms and memory")
    parser.add_argument("--best", action="store_true", help="also search the fastest layout that fits (a minute)")
    args = parser.parse_args()
    print(table(args.best))
    print()
    print(DIFFERENCES)
    if args.terms:
        print()
        print(terms())


if __name__ == "__main__":
    main()
