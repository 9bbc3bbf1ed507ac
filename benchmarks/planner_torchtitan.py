"""A second published anchor for the planner: torchtitan's FSDP2 throughput (tokens per second per GPU), the system
closest to HybridStrategy's data parallelism (FSDP2, bf16 parameters, fp32 gradient reduction, ZeRO-3).

Sources, pytorch/torchtitan ``docs/performance.md``:

* at commit 0413364 (2024): Llama 3 8B / 70B and Llama 2 13B / 70B, FSDP2 alone on 64 A100-80GB, local batch 1 or
  2, sequence 8192 (Llama 3) or 4096 (Llama 2), activation checkpointing none, "selective layer" (every 2nd block:
  torchtitan's ``selective_ac_option = "2"``, HybridStrategy's ``activation_checkpointing=2``), "selective op" or
  full. The page does not state the network; the planner takes the ``a100-80gb`` preset's DGX A100 (a 200 Gb/s
  NIC per GPU, 25 GB/s) and also prints each row at 400 Gb/s per node (6.25 GB/s per GPU: AWS's p4de, the cluster a
  user's comment in pytorch/torchtitan issue 394 attributes the runs to, unconfirmed there).
* at commit eaea6f6 (2025): Llama 3.1 8B, FSDP2 on 8 and 128 H100 (96 GB HBM2e at 2.4 TB/s, a 500 W power limit,
  400 Gb/s per GPU), local batch 2, sequence 8192, selective op checkpointing, eager and ``torch.compile``. The page
  says the peak FLOP/s of these power-limited GPUs is unknown (between H100 SXM's and NVL's); the planner is run at
  both ends, 989 and 835 TFLOP/s.

Where torchtitan differs from HybridStrategy: its "selective op" policy keeps every matmul output but every second
one of a block (``torchtitan/parallelisms/parallelize_llama.py`` at 9dec370, the commit the H100 page names: the
policy counts ``aten.mm`` calls per block and recomputes the even ones), so its backward runs wk, wo and w3 again;
HybridStrategy's ``"selective"`` keeps them all (less recompute, more memory). The "selective op" rows are priced
as HybridStrategy's ``"selective"`` plus those three GEMMs' forward once more (:func:`with_op_sac_recompute`). Each
row's network is an assumption.

Usage::

    python benchmarks/planner_torchtitan.py
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple, Union

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import markdown_table  # noqa: E402
from lightning_hybrid.planner.cost import estimate  # noqa: E402
from lightning_hybrid.hardware import Cluster  # noqa: E402
from lightning_hybrid.planner.kernels import gemm_seconds  # noqa: E402
from lightning_hybrid.planner.layout import OUT_OF_MEMORY, Estimate, Layout  # noqa: E402
from lightning_hybrid.planner.model import ModelShape  # noqa: E402

#: torchtitan's Llama: RMSNorm as the reference implementation writes it (fp32, eager kernels unless compiled),
#: rotary embeddings.
LLAMA3_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn_hidden=14336, gated_mlp=True, vocab=128256,
                       seq_len=8192, fp32_norm=True, rotary=True)
LLAMA3_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, gated_mlp=True,
                        vocab=128256, seq_len=8192, fp32_norm=True, rotary=True)
LLAMA2_13B = ModelShape(layers=40, hidden=5120, heads=40, ffn_hidden=13824, gated_mlp=True, vocab=32000,
                        seq_len=4096, fp32_norm=True, rotary=True)
LLAMA2_70B = ModelShape(layers=80, hidden=8192, heads=64, kv_heads=8, ffn_hidden=28672, gated_mlp=True, vocab=32000,
                        seq_len=4096, fp32_norm=True, rotary=True)


class Run(NamedTuple):
    """One published row: model, GPUs, sequences per GPU, checkpointing (HybridStrategy's spelling), compile,
    published tokens/s per GPU, and what the page calls it."""

    name: str
    model: ModelShape
    gpus: int
    local_batch: int
    checkpointing: Union[None, str, int]
    compile: bool
    published: float
    published_as: str


A100_RUNS = (
    Run("Llama 3 8B", LLAMA3_8B, 64, 1, 2, False, 2904, "selective layer"),
    Run("Llama 3 8B", LLAMA3_8B, 64, 1, "selective", False, 2973, "selective op"),
    Run("Llama 3 70B", LLAMA3_70B, 64, 1, "every", False, 331, "full"),
    Run("Llama 2 13B", LLAMA2_13B, 64, 2, None, False, 2162, "no"),
    Run("Llama 2 13B", LLAMA2_13B, 64, 2, 2, False, 1914, "selective layer"),
    Run("Llama 2 13B", LLAMA2_13B, 64, 2, "selective", False, 1904, "selective op"),
    Run("Llama 2 70B", LLAMA2_70B, 64, 1, "selective", False, 355, "selective op"),
    Run("Llama 2 70B", LLAMA2_70B, 64, 2, "every", False, 353, "full"),
)
H100_RUNS = (
    Run("Llama 3.1 8B", LLAMA3_8B, 8, 2, "selective", False, 5762, "selective op"),
    Run("Llama 3.1 8B", LLAMA3_8B, 8, 2, "selective", True, 6667, "selective op, torch.compile"),
    Run("Llama 3.1 8B", LLAMA3_8B, 128, 2, "selective", False, 5605, "selective op"),
    Run("Llama 3.1 8B", LLAMA3_8B, 128, 2, "selective", True, 6514, "selective op, torch.compile"),
)


def predict(run: Run, cluster: Cluster) -> Estimate:
    layout = Layout(dp=run.gpus, activation_checkpointing=run.checkpointing, compile=run.compile)
    result = estimate(run.model, cluster, layout, run.local_batch * run.gpus)
    return with_op_sac_recompute(result, run.model, cluster, run.local_batch) if run.checkpointing == "selective" \
        else result


def op_sac_recomputed_gemms(model: ModelShape, sequences: int, tp: int = 1) -> tuple[tuple[float, float, float], ...]:
    """(m, n, k) of the matmuls torchtitan's "selective op" policy does not keep, per block and microbatch of
    ``sequences`` sequences on one tp rank: of the forward's wq, wk, wv, wo, w1, w3, w2 (each an ``aten.mm``) the
    2nd, 4th and 6th, i.e. wk, wo and w3. Its backward runs them again; their outputs (m × n) are not saved."""
    rows, head = sequences * model.seq_len, model.hidden // model.heads
    return ((rows, model.kv_heads * head / tp, model.hidden), (rows, model.hidden, model.hidden / tp),
            (rows, model.ffn_hidden / tp, model.hidden))


def with_op_sac_recompute(result: Estimate, model: ModelShape, cluster: Cluster, sequences: int) -> Estimate:
    """``result`` (HybridStrategy's ``"selective"``, one microbatch per step, no pipeline) as torchtitan's policy runs
    it: the rank's layers × the forward of :func:`op_sac_recomputed_gemms` (in float8 with
    ``model.float8_linears``) added to compute and step, and their outputs not kept (bf16: each block's activations
    that much smaller). The data-parallel traffic that showed is kept (what nothing precedes or follows stays
    exposed, whatever the compute)."""
    gemms = op_sac_recomputed_gemms(model, sequences, result.layout.tp)
    extra = model.layers * sum(gemm_seconds(cluster, *gemm, float8=model.float8_linears) for gemm in gemms)
    time = replace(result.time, compute=result.time.compute + extra, step=result.time.step + extra)
    unkept = model.layers * sum(m * n for m, n, _ in gemms) * 2
    memory = replace(result.memory, activations=result.memory.activations - unkept)
    scale = result.time.step / time.step
    reasons = tuple(reason for reason in result.reasons if not reason.startswith(OUT_OF_MEMORY)
                    or memory.total > cluster.usable_memory)
    return replace(result, memory=memory, time=time, tokens_per_second=result.tokens_per_second * scale,
                   mfu=result.mfu * scale, reasons=reasons)


def a100(run: Run, network_gbps: float = 25) -> Cluster:
    return Cluster.preset("a100-80gb", nodes=run.gpus // 8, inter_node_bandwidth=network_gbps * 1e9)


def grand_teton(run: Run, peak_tflops: float) -> Cluster:
    """torchtitan's H100 hosts: 96 GB HBM2e at 2.4 TB/s, 400 Gb/s per GPU, a peak between SXM's and NVL's."""
    return Cluster.preset("h100-sxm", nodes=max(1, run.gpus // 8), memory_bytes=96e9, memory_bandwidth=2.4e12,
                          peak_flops=peak_tflops * 1e12)


def tokens_per_gpu(run: Run, result: Estimate) -> float:
    return result.tokens_per_second / run.gpus


def _cell(run: Run, result: Estimate) -> str:
    text = f"{tokens_per_gpu(run, result):,.0f} ({tokens_per_gpu(run, result) / run.published:.2f})"
    return text if result.feasible else text + f", out of memory ({result.memory.total / 2**30:.0f} GiB)"


def table() -> str:
    a100_rows = [[run.name, f"{run.gpus} A100", run.local_batch, run.published_as, f"{run.published:,}",
                  _cell(run, predict(run, a100(run))), _cell(run, predict(run, a100(run, 6.25)))] for run in A100_RUNS]
    h100_rows = [[run.name, f"{run.gpus} H100", run.published_as, f"{run.published:,}",
                  _cell(run, predict(run, grand_teton(run, 989))), _cell(run, predict(run, grand_teton(run, 835)))]
                 for run in H100_RUNS]
    return "\n".join([
        markdown_table(["model", "GPUs", "local batch", "checkpointing (torchtitan's name)", "published tokens/s/GPU",
                        "predicted (/ published), 25 GB/s per GPU", "at 6.25 GB/s per GPU"], a100_rows),
        "",
        markdown_table(["model", "GPUs", "checkpointing", "published tokens/s/GPU",
                        "predicted (/ published), 989 TFLOP/s", "at 835 TFLOP/s"], h100_rows),
    ])


if __name__ == "__main__":
    print(table())
