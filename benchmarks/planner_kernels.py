"""The planner on modern kernels (issue 32): every published run the cost model is checked against, which of them
fit its one matmul constant per GPU generation and which are held out, and the fit itself.

The constants (``A100_MATMUL_EFFICIENCY``, ``H100_MATMUL_EFFICIENCY`` in lightning_hybrid/hardware.py: the share
of peak a large, tile-aligned GEMM sustains; ``K_OVERHEAD`` in planner/kernels.py, one value for both; the rest
follows from the GEMMs' shapes) are fitted so that the geometric mean of predicted / published over the fitted runs
is 1 (``K_OVERHEAD``: the value of 0, 64, ..., 1024 with the smallest error over them):

* A100: Narayanan et al. 2021, Table 1 (benchmarks/planner_megatron.py), all ten rows, as published (materialized
  attention), and llm-foundry's MPT 1B (A100 80GB) and 13B (A100 40GB) (flash attention);
* H100: llm-foundry's MPT 1B, 7B and 30B on 8 H100s, and torchtitan's Llama 3.1 8B on 8 H100s, eager
  (pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``, Table 1, first row).

Held out: torchtitan's eight A100 runs (benchmarks/planner_torchtitan.py; "selective op" priced as torchtitan runs
it), its other three bf16 H100 rows (torch.compile; 128 GPUs), llm-foundry's MPT 3B, 13B and 70B on H100s and its MPT 3B, 7B
and 30B on A100s, and NeMo AutoModel's Llama 3.1 70B on 64 DGX H100s (NVIDIA-NeMo/Automodel
``docs/performance-summary.md`` at e458120, FSDP2 32 × cp 2, full checkpointing, torch.compile, bf16), and
torchtitan's float8 rows (:data:`FLOAT8_RUNS`: Llama 3.1 8B, 70B and 405B, priced with ``ModelShape.float8_linears``,
which only this check uses: HybridStrategy trains in bf16).

Usage::

    python benchmarks/planner_kernels.py          # every run: published, predicted, ratio, fitted or held out
    python benchmarks/planner_kernels.py --fit    # + the constants refitted from the fitted runs
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import markdown_table  # noqa: E402
from benchmarks.planner_megatron import (TABLE_1, Row, a100_cluster, megatron_gpt, published_layout,  # noqa: E402
                                         tflops_per_gpu)
from benchmarks.planner_torchtitan import (A100_RUNS, H100_RUNS, LLAMA3_8B, LLAMA3_70B, Run, a100,  # noqa: E402
                                           grand_teton, tokens_per_gpu, with_op_sac_recompute)
from benchmarks.planner_torchtitan import predict as predict_torchtitan  # noqa: E402
from lightning_hybrid.hardware import Cluster  # noqa: E402
from lightning_hybrid.planner.cost import estimate  # noqa: E402
from lightning_hybrid.planner import kernels  # noqa: E402
from lightning_hybrid.planner.layout import Estimate, Layout  # noqa: E402
from lightning_hybrid.planner.model import ModelShape  # noqa: E402

#: NeMo AutoModel, Llama 3.1 70B pretraining on 64 DGX H100 (bf16): tokens/s per GPU as published, and its config
#: (examples/llm_benchmark/llama3_3/custom_llama3_1_70b_pretrain_benchmark_8nodes.yaml): dp 32 × cp 2 FSDP2, local
#: batch 1, 4 accumulation steps (global batch 128), sequence 8192, activation checkpointing, torch.compile, sdpa.
NEMO_70B_TOKENS_PER_GPU = 866.77
NEMO_70B_LAYOUT = Layout(dp=32, cp=2, microbatches=4, activation_checkpointing="every", compile=True)


#: torchtitan's float8 rows (benchmarks/llama3_h100_202412_torchtitan.md @31a17bf, Tables 1, 3, 4, 5), all with
#: torch.compile and torchao's Float8 linear layers, sequence 8192, on Grand Teton: the table, the run, its layout,
#: global batch, published tokens/s per GPU, and whether it ran AsyncTP (:func:`with_async_tp`). Local batch = global
#: ÷ FSDP degree; the pipeline splits it into torchtitan's default number of microbatches at the commit the page
#: names (9dec370: ``pipeline_parallel_microbatches`` unset = the pipeline degree, 8, of 4 sequences each), its
#: default two stages per rank for "Interleaved 1F1B". Held out: nothing was fitted on float8.
LLAMA3_405B = ModelShape(layers=126, hidden=16384, heads=128, kv_heads=8, ffn_hidden=53248, gated_mlp=True,
                         vocab=128256, seq_len=8192, fp32_norm=True, rotary=True, float8_linears=True)
LLAMA3_70B_2D = Layout(dp=32, tp=8, activation_checkpointing="every", compile=True)
LLAMA3_405B_3D = Layout(dp=8, tp=8, pp=8, zero=2, microbatches=8, activation_checkpointing="every", compile=True)
FLOAT8_RUNS = (
    ("Table 1", "Llama 3.1 8B, 8 H100, FSDP 8, local batch 2, selective op", replace(LLAMA3_8B, float8_linears=True),
     Layout(dp=8, activation_checkpointing="selective", compile=True), 16, 8532, False),
    ("Table 3", "Llama 3.1 8B, 128 H100, FSDP 128, local batch 2, selective op",
     replace(LLAMA3_8B, float8_linears=True), Layout(dp=128, activation_checkpointing="selective", compile=True),
     256, 8380, False),
    ("Table 4", "Llama 3.1 70B, 256 H100, FSDP 32 × TP 8, local batch 16, full AC",
     replace(LLAMA3_70B, float8_linears=True), LLAMA3_70B_2D, 512, 829, False),
    ("Table 4", "Llama 3.1 70B, 256 H100, FSDP 32 × TP 8, local batch 16, full AC, AsyncTP",
     replace(LLAMA3_70B, float8_linears=True), LLAMA3_70B_2D, 512, 876, True),
    ("Table 5", "Llama 3.1 405B, 512 H100, FSDP 8 × TP 8 × PP 8 1F1B m8, local batch 32, full AC, AsyncTP",
     LLAMA3_405B, LLAMA3_405B_3D, 256, 100, True),
    ("Table 5", "Llama 3.1 405B, 512 H100, FSDP 8 × TP 8 × PP 8 interleaved 1F1B m8 v2, local batch 32, full AC,"
     " AsyncTP", LLAMA3_405B, replace(LLAMA3_405B_3D, pp_schedule="interleaved_1f1b", virtual_stages=2), 256, 128,
     True),
)


def with_async_tp(result: Estimate) -> Estimate:
    """``result`` with tensor-parallel traffic overlapped as AsyncTP runs it (torch's micro-pipelined collective
    matmuls): each collective split into t transfers, each behind the partial matmul of the chunk before, so all but
    the first, (t − 1)/t of the TP time, hides behind compute (in the pipeline's bubble factor as well)."""
    time, t = result.time, result.layout.tp
    busy = time.compute + time.tensor_parallel + time.pipeline  # the step's pipelined part is busy × (1 + bubble/busy)
    overlapped = time.tensor_parallel * (t - 1) / t
    hidden = overlapped * (1 + time.bubble / busy)
    faster = replace(time, tensor_parallel=time.tensor_parallel - overlapped,
                     bubble=time.bubble * (1 - overlapped / busy), step=time.step - hidden)
    scale = time.step / faster.step
    return replace(result, time=faster, tokens_per_second=result.tokens_per_second * scale, mfu=result.mfu * scale)


#: torchtitan's H100s run at a 500 W power limit, their peak "between SXM and NVL" (the page): NVL's datasheet
#: figure, the lower bound it names (at SXM's 989 every torchtitan H100 prediction is 989/835 = 1.18 times higher).
TORCHTITAN_H100_PEAK_TFLOPS = 835

#: MosaicML llm-foundry (mosaicml/llm-foundry scripts/train/benchmarking/README.md @c90b9b3): MPT at sequence 2048,
#: PyTorch FSDP (FULL_SHARD: ZeRO-3), FlashAttention, bf16, no dropout, learned positions, tied head, biases (per
#: block 12h² + 13h: the NumParams column is matched exactly). Per row: name, (hidden, heads, layers), GPUs,
#: microbatch, accumulation steps, activation checkpointing, published tokens/s per GPU, NumParams, GPU preset (the
#: tables "H100 80GB BF16", "A100 80GB ...", "A100 40GB with 1600 Gbps node-node interconnect").
MPT_RUNS = (
    ("MPT 1B", (2048, 16, 24), 8, 14, 1, None, 45455, 1_315_950_592, "h100-sxm"),
    ("MPT 3B", (2560, 20, 32), 16, 10, 3, None, 24142, 2_651_837_440, "h100-sxm"),
    ("MPT 7B", (4096, 32, 32), 8, 6, 1, None, 10643, 6_658_859_008, "h100-sxm"),
    ("MPT 13B", (5120, 40, 40), 8, 2, 1, None, 4792, 12_853_954_560, "h100-sxm"),
    ("MPT 30B", (7168, 56, 48), 8, 3, 21, "every", 2002, 29_975_214_080, "h100-sxm"),
    ("MPT 70B", (8192, 64, 80), 64, 8, 4, "every", 1039, 64_862_437_376, "h100-sxm"),
    ("MPT 1B", (2048, 16, 24), 8, 14, 4, None, 20513, 1_315_950_592, "a100-80gb"),
    ("MPT 3B", (2560, 20, 32), 8, 5, 8, None, 10065, 2_651_837_440, "a100-40gb"),
    ("MPT 7B", (4096, 32, 32), 8, 12, 4, "every", 3679, 6_658_859_008, "a100-40gb"),
    ("MPT 13B", (5120, 40, 40), 32, 14, 1, "every", 1998, 12_853_954_560, "a100-40gb"),
    ("MPT 30B", (7168, 56, 48), 32, 4, 1, "every", 857, 29_975_214_080, "a100-40gb"),
)
MPT_VOCAB, MPT_SEQUENCE = 50368, 2048
#: The MPT rows the constants are fitted on (the others are held out): on each generation runs with flash attention
#: of small and large widths, next to Table 1's materialized attention on A100.
MPT_FITTED = (("MPT 1B", "h100-sxm"), ("MPT 7B", "h100-sxm"), ("MPT 30B", "h100-sxm"), ("MPT 1B", "a100-80gb"),
              ("MPT 13B", "a100-40gb"))
#: The values of ``K_OVERHEAD`` the fit tries.
OVERHEADS = (0, 64, 128, 256, 384, 512, 768, 1024)


def mpt(hidden: int, heads: int, layers: int) -> ModelShape:
    """llm-foundry's MPT benchmark model: per block 12h² + 13h parameters (biases; LayerNorm weight and bias), learned
    positions, tied head, flash attention, eager element-wise kernels."""
    h = hidden
    return ModelShape(layers=layers, hidden=h, heads=heads, vocab=MPT_VOCAB, seq_len=MPT_SEQUENCE,
                      parameters_per_block=12 * h * h + 13 * h, whole_parameters_per_block=6 * h,
                      first_stage_parameters=(MPT_VOCAB + MPT_SEQUENCE) * h, last_stage_parameters=2 * h,
                      tied_embeddings=True)


class Published(NamedTuple):
    """One published run: where from, what it ran, the published figure, the GPU generation it checks, whether it
    fits that generation's constant, and its prediction for a given matmul efficiency."""

    source: str
    config: str
    published: float
    generation: str  # "a100" or "h100"
    fitted: bool
    predict: Callable[[float], float]


def _megatron(efficiency: float, row: Row) -> float:
    cluster = replace(a100_cluster(row), efficiency=efficiency)
    return tflops_per_gpu(row, estimate(megatron_gpt(row), cluster, published_layout(row), row.batch))


def _torchtitan(efficiency: float, run: Run, cluster: Cluster) -> float:
    return tokens_per_gpu(run, predict_torchtitan(run, replace(cluster, efficiency=efficiency)))


def _nemo(efficiency: float) -> float:
    cluster = Cluster.preset("h100-sxm", nodes=8, efficiency=efficiency)
    return estimate(LLAMA3_70B, cluster, NEMO_70B_LAYOUT, 128).tokens_per_second / 64


def _float8(efficiency: float, model: ModelShape, layout: Layout, global_batch: int, async_tp: bool) -> float:
    cluster = Cluster.preset("h100-sxm", nodes=layout.gpus // 8, memory_bytes=96e9, memory_bandwidth=2.4e12,
                             peak_flops=TORCHTITAN_H100_PEAK_TFLOPS * 1e12, efficiency=efficiency)
    result = estimate(model, cluster, layout, global_batch)
    if layout.activation_checkpointing == "selective":  # torchtitan's "selective op"
        result = with_op_sac_recompute(result, model, cluster, global_batch // layout.dp)
    return (with_async_tp(result) if async_tp else result).tokens_per_second / layout.gpus


def _mpt(efficiency: float, row: tuple) -> float:
    _, dims, gpus, micro, steps, checkpointing, _, _, gpu = row
    cluster = Cluster.preset(gpu, nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus), efficiency=efficiency)
    layout = Layout(dp=gpus, microbatches=steps if steps > 1 else None, activation_checkpointing=checkpointing)
    return estimate(mpt(*dims), cluster, layout, gpus * micro * steps).tokens_per_second / gpus


def published_runs() -> list[Published]:
    runs = [Published("Narayanan et al. 2021, Table 1", f"GPT {row.billions:g}B, {row.gpus} A100, t{row.tp} p{row.pp}"
                      f" b{row.micro_batch}, TFLOP/s per GPU", row.published_tflops, "a100", True,
                      lambda e, row=row: _megatron(e, row)) for row in TABLE_1]
    runs += [Published("torchtitan docs/performance.md @0413364", f"{run.name}, 64 A100, local batch"
                       f" {run.local_batch}, {run.published_as}", run.published, "a100", False,
                       lambda e, run=run: _torchtitan(e, run, a100(run)))
             for run in A100_RUNS]
    runs += [Published("torchtitan benchmarks/llama3_h100_202412_torchtitan.md @31a17bf",
                       f"{run.name}, {run.gpus} H100 (500 W), local batch 2, {run.published_as}", run.published,
                       "h100", index == 0,
                       lambda e, run=run: _torchtitan(e, run, grand_teton(run, TORCHTITAN_H100_PEAK_TFLOPS)))
             for index, run in enumerate(H100_RUNS)]
    runs += [Published("llm-foundry benchmarking/README.md @c90b9b3", f"{row[0]}, {row[2]} {row[8].upper()},"
                       f" microbatch {row[3]}, acc {row[4]}, {'full AC' if row[5] else 'no AC'}", row[6],
                       row[8][:4], (row[0], row[8]) in MPT_FITTED, lambda e, row=row: _mpt(e, row)) for row in MPT_RUNS]
    runs += [Published(f"torchtitan benchmarks/llama3_h100_202412_torchtitan.md @31a17bf, {table}",
                       f"{config}, compile, Float8", published, "h100", False,
                       lambda e, model=model, layout=layout, batch=batch, overlap=overlap:
                       _float8(e, model, layout, batch, overlap))
             for table, config, model, layout, batch, published, overlap in FLOAT8_RUNS]
    runs.append(Published("NeMo AutoModel docs/performance-summary.md @e458120", "Llama 3.1 70B, 64 DGX H100,"
                          " FSDP2 32 × cp 2, local batch 1, acc 4, full AC, compile", NEMO_70B_TOKENS_PER_GPU, "h100",
                          False, _nemo))
    return runs


def fit(generation: str) -> float:
    """The matmul efficiency at which the fitted runs of ``generation`` are right on geometric average."""
    fitted = [run for run in published_runs() if run.generation == generation and run.fitted]

    def log_error(efficiency: float) -> float:
        return sum(math.log(run.predict(efficiency) / run.published) for run in fitted) / len(fitted)

    low, high = 0.2, 1.0
    for _ in range(30):  # predictions grow with the efficiency: bisect the log error's zero
        low, high = (low, (low + high) / 2) if log_error((low + high) / 2) > 0 else ((low + high) / 2, high)
    return (low + high) / 2


def fit_overhead() -> tuple[int, float]:
    """The ``K_OVERHEAD`` of :data:`OVERHEADS` with the smallest RMS log error over the fitted runs (each generation's
    efficiency refitted at each), and that error."""
    saved, errors = kernels.K_OVERHEAD, {}
    try:
        for overhead in OVERHEADS:
            kernels.K_OVERHEAD = overhead
            efficiency = {generation: fit(generation) for generation in ("a100", "h100")}
            logs = [math.log(run.predict(efficiency[run.generation]) / run.published)
                    for run in published_runs() if run.fitted]
            errors[overhead] = math.sqrt(sum(error * error for error in logs) / len(logs))
    finally:
        kernels.K_OVERHEAD = saved
    best = min(errors, key=errors.get)
    return best, errors[best]


def table() -> str:
    rows = []
    for run in published_runs():
        efficiency = Cluster.preset(f"{run.generation}-sxm" if run.generation == "h100" else "a100-80gb").efficiency
        predicted = run.predict(efficiency)
        rows.append([run.source, run.config, f"{run.published:,.0f}", f"{predicted:,.0f}",
                     f"{predicted / run.published:.2f}", "fitted" if run.fitted else "held out"])
    return markdown_table(["source", "run", "published", "predicted", "predicted / published", "role"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fit", action="store_true", help="also refit the matmul efficiency of each generation")
    args = parser.parse_args()
    print(table())
    if args.fit:
        overhead, error = fit_overhead()
        print(f"\nK_OVERHEAD fitted = {overhead} (RMS log error {error:.3f} over the fitted runs)")
        for generation in ("a100", "h100"):
            print(f"{generation}: matmul efficiency fitted on its fitted runs = {fit(generation):.3f}")


if __name__ == "__main__":
    main()
