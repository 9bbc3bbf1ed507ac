"""The hardware the planner plans for: :class:`Cluster` (GPUs, memory, peak FLOP/s, links, per-message latency) and
published GPU numbers (:data:`GPU_PRESETS`). Plain Python: ``lightning-hybrid plan --help`` reads the preset names
without importing torch. Measuring the hardware a job runs on is :mod:`lightning_hybrid.planner.hardware_probe`.

Example::

    Cluster.preset("h100-sxm", nodes=4)                   # 4 × 8 GPUs, datasheet numbers
    Cluster(nodes=1, gpus_per_node=2, memory_bytes=8 * GIB, peak_flops=1e11, intra_node_bandwidth=1e9,
            inter_node_bandwidth=1e9, overlap_communication=False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

from lightning_hybrid.checks import check_positive_values

GIB = 2**30


class GpuSpec(NamedTuple):
    """One GPU's public numbers: memory, dense peak TFLOP/s (16-bit tensor cores; fp32 without TF32, which torch
    leaves off for fp32 matmuls by default), NVLink/PCIe GB/s per direction, the inter-node GB/s per GPU of
    a typical system (assumed: one NIC per GPU, as in NVIDIA's DGX; a ring collective over whole nodes uses all of
    a node's, :meth:`Cluster.collective_bandwidth`), memory bandwidth (GB/s) and the host link
    (PCIe GB/s per direction)."""

    memory_gib: float
    bf16_tflops: float
    fp32_tflops: float
    intra_node_gbps: float
    inter_node_gbps: float
    memory_gbps: float
    host_gbps: float
    sms: int  # streaming multiprocessors: a GEMM's tiles run in waves of this many (planner/kernels.py)
    matmul_efficiency: float  # share of peak a large aligned GEMM sustains: fitted per generation (BENCHMARKS.md)
    attention_efficiency: float  # share of peak flash SDPA reaches, forward + backward (published kernel benchmarks)


#: The share of the dense peak a large, tile-aligned bf16 GEMM sustains, per GPU generation: the one constant the
#: planner fits per generation (planner/kernels.py models the rest from the GEMMs' shapes), so that the geometric
#: mean of predicted / published over its fitted runs is 1. A100: Narayanan et al. 2021's Table 1 and llm-foundry's
#: MPT 1B and 13B; H100: llm-foundry's MPT 1B, 7B and 30B on 8 H100s and torchtitan's Llama 3.1 8B on 8 H100s
#: (eager). The other published runs are held out (benchmarks/planner_kernels.py; BENCHMARKS.md, "Planner on modern
#: kernels (issue 32)").
A100_MATMUL_EFFICIENCY = 0.77
H100_MATMUL_EFFICIENCY = 0.53

GPU_PRESETS: dict[str, GpuSpec] = {
    # A100 SXM datasheet: 312 TFLOPS BF16 dense, 19.5 FP32, NVLink 3 600 GB/s (300 per direction), HBM2 1,555
    # GB/s (40 GB) / HBM2e 2,039 GB/s (80 GB), PCIe Gen4 64 GB/s (32 per direction); DGX A100: one 200 Gb/s HDR
    # InfiniBand port per GPU = 25 GB/s.
    # 108 SMs. FlashAttention-2 (Dao 2023) forward + backward at head dim 128: about 55 % of the A100's peak.
    "a100-40gb": GpuSpec(40, 312, 19.5, 300, 25, 1555, 32, 108, A100_MATMUL_EFFICIENCY, 0.55),
    "a100-80gb": GpuSpec(80, 312, 19.5, 300, 25, 2039, 32, 108, A100_MATMUL_EFFICIENCY, 0.55),
    # H100 SXM datasheet: 989 TFLOPS BF16 dense (1979 with sparsity), 67 FP32, NVLink 4 900 GB/s, HBM3 3.35 TB/s,
    # PCIe Gen5 128 GB/s; DGX H100: one 400 Gb/s NDR port per GPU = 50 GB/s.
    # 132 SMs. FlashAttention-2 on H100 (the baseline of FlashAttention-3, Shah et al. 2024) forward + backward at
    # head dim 128: about 35 % of peak (it does not use Hopper's asynchronous tensor cores).
    "h100-sxm": GpuSpec(80, 989, 67, 450, 50, 3350, 64, 132, H100_MATMUL_EFFICIENCY, 0.35),
    # H200 SXM: H100's compute and NVLink, 141 GB HBM3e at 4.8 TB/s (the driver reports about 140 GiB).
    "h200": GpuSpec(140, 989, 67, 450, 50, 4800, 64, 132, H100_MATMUL_EFFICIENCY, 0.35),
    # L4 datasheet: 121 TFLOPS BF16 dense (242 with sparsity), 30.3 FP32, 24 GB GDDR6 at 300 GB/s, no NVLink: PCIe
    # Gen4 x16 32 GB/s per direction; network assumed 100 Gb/s per GPU.
    # 58 SMs; not checked against a published run: A100's efficiencies assumed.
    "l4": GpuSpec(24, 121, 30.3, 32, 12.5, 300, 32, 58, A100_MATMUL_EFFICIENCY, 0.55),
}

#: CPU memory bandwidth per GPU for an offloaded optimizer step (assumed: a DGX A100's two 8-channel DDR4-3200
#: sockets, 410 GB/s, shared by 8 GPUs is 51 GB/s each; half of that for torch's CPU AdamW).
HOST_MEMORY_BANDWIDTH = 25e9


#: α of the GPU presets: NCCL's time for a tiny collective is tens of microseconds (assumed, one value for NVLink and
#: the network; small next to the bandwidth term except for many small messages: deep tensor parallelism or many
#: pipeline microbatches).
NCCL_LATENCY = 20e-6


@dataclass(frozen=True)
class Cluster:
    """GPUs, memory per GPU (bytes), peak FLOP/s per GPU in the training dtype, link bandwidths (bytes/s per GPU
    and direction). ``efficiency``: the share of peak that compute reaches: with ``memory_bandwidth`` given, that of
    the matrix multiplications alone (a large aligned GEMM's where ``streaming_multiprocessors`` is given, as the
    presets do: :data:`A100_MATMUL_EFFICIENCY`, :data:`H100_MATMUL_EFFICIENCY`), the memory-bound kernels
    (norms, activations, residual adds, softmax, the optimizer) then cost their bytes ÷ ``memory_bandwidth``;
    without it, of all compute (0.5: well-tuned dense transformer training reports 40-60% MFU).
    ``host_bandwidth`` (bytes/s per GPU and direction, PCIe) and ``host_memory_bandwidth`` (the CPU memory's
    bytes/s per GPU) time CPU offload. ``usable_memory_fraction``: room for the CUDA context, NCCL buffers and
    allocator fragmentation. ``latency``: seconds every collective call or point-to-point message costs whatever
    its size (α of the α–β model: a message of n bytes takes α + n / bandwidth). ``overlap_communication``:
    whether data-parallel traffic can hide behind compute (GPUs: NCCL on its own stream); ``False`` where the
    collectives need the compute's own cores (CPUs with gloo)."""

    nodes: int
    gpus_per_node: int
    memory_bytes: float
    peak_flops: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    efficiency: float = 0.5
    usable_memory_fraction: float = 0.9
    latency: float = 0.0
    overlap_communication: bool = True
    memory_bandwidth: Optional[float] = None
    host_bandwidth: Optional[float] = None
    host_memory_bandwidth: Optional[float] = None
    # the GPU's kernel profile (the presets give it): with it, matmuls are timed from their shapes at
    # ``efficiency`` for a large aligned GEMM, flash attention at ``attention_efficiency`` (planner/kernels.py)
    streaming_multiprocessors: Optional[int] = None
    attention_efficiency: Optional[float] = None

    def __post_init__(self) -> None:
        check_positive_values("Cluster", nodes=self.nodes, gpus_per_node=self.gpus_per_node)
        check_positive_values("Cluster", integer=False, memory_bytes=self.memory_bytes, peak_flops=self.peak_flops,
                        intra_node_bandwidth=self.intra_node_bandwidth, inter_node_bandwidth=self.inter_node_bandwidth,
                        efficiency=self.efficiency, usable_memory_fraction=self.usable_memory_fraction)
        for name in ("efficiency", "usable_memory_fraction"):
            if getattr(self, name) > 1:
                raise ValueError(f"Cluster({name}={getattr(self, name)!r}) is invalid: a fraction, at most 1.")
        given = {name: getattr(self, name) for name in ("memory_bandwidth", "host_bandwidth", "host_memory_bandwidth")}
        check_positive_values("Cluster", integer=False, **{k: v for k, v in given.items() if v is not None})
        if not self.latency >= 0:
            raise ValueError(f"Cluster(latency={self.latency!r}) is invalid: seconds per message, at least 0.")

    @classmethod
    def preset(cls, gpu: str, nodes: int = 1, gpus_per_node: int = 8, precision: str = "bf16-mixed",
               **overrides: Any) -> "Cluster":
        """Nodes of :data:`GPU_PRESETS` GPUs; ``precision`` picks the peak (fp32 for ``32-true``); ``overrides``
        replace any field."""
        spec = GPU_PRESETS.get(gpu.lower())
        if spec is None:
            raise ValueError(f"Unknown GPU preset {gpu!r}. Choose one of: {', '.join(GPU_PRESETS)}.")
        tflops = spec.fp32_tflops if precision == "32-true" else spec.bf16_tflops
        fields = dict(nodes=nodes, gpus_per_node=gpus_per_node, memory_bytes=spec.memory_gib * GIB,
                      peak_flops=tflops * 1e12, intra_node_bandwidth=spec.intra_node_gbps * 1e9,
                      inter_node_bandwidth=spec.inter_node_gbps * 1e9, latency=NCCL_LATENCY,
                      efficiency=spec.matmul_efficiency, memory_bandwidth=spec.memory_gbps * 1e9,
                      host_bandwidth=spec.host_gbps * 1e9, host_memory_bandwidth=HOST_MEMORY_BANDWIDTH,
                      streaming_multiprocessors=spec.sms, attention_efficiency=spec.attention_efficiency)
        return cls(**{**fields, **overrides})

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_memory(self) -> float:
        return self.memory_bytes * self.usable_memory_fraction

    def link_bandwidth(self, size: int, stride: int) -> float:
        """Bandwidth of the mesh groups of ``size`` ranks ``stride`` apart. They tile aligned blocks of
        size·stride consecutive ranks, so all of them lie within nodes iff such a block divides a node."""
        return self.intra_node_bandwidth if self._within_nodes(size, stride) else self.inter_node_bandwidth

    def _within_nodes(self, size: int, stride: int) -> bool:
        return self.nodes == 1 or size == 1 or self.gpus_per_node % (size * stride) == 0

    def collective_bandwidth(self, size: int, stride: int) -> float:
        """Bandwidth of a ring all-gather, reduce-scatter or all-reduce over the mesh groups of ``size`` ranks
        ``stride`` apart, as NCCL runs it: one ring per channel through all ranks, the channels spread over the
        node's NICs. A ring enters and leaves each node once per channel, so the bytes that cross a node boundary
        are one rank's share ((n−1)/n × the buffer), not each local rank's; the ``stride`` groups side by side in a
        node share its ``gpus_per_node`` NICs, so each group's boundary traffic runs over ``gpus_per_node / stride``
        of them (at least one) and inside the node over NVLink, whichever is slower (the ring is pipelined). NCCL's
        maintainers measure 192 GB/s all-reduce bus bandwidth across DGX A100s with 8 × 200 Gb/s NICs, 8 × 25 GB/s
        less 4 % (NVIDIA/nccl issue 812); point-to-point messages and all-to-alls use :meth:`link_bandwidth`."""
        if self._within_nodes(size, stride):
            return self.intra_node_bandwidth
        local = max(1, min(size, self.gpus_per_node // stride))  # the group's ranks in one node: its NICs
        return min(self.intra_node_bandwidth, local * self.inter_node_bandwidth)
