"""Measure the hardware a job runs on, as a :class:`~lightning_hybrid.hardware.Cluster` for the auto layout.

GPUs are recognised by name (:data:`~lightning_hybrid.hardware.GPU_PRESETS`, memory read from the device, or
Lightning's FLOPs table with assumed links); CPUs are probed: fp32 matmul FLOP/s per process with every process
busy, and all-reduce latency and bandwidth over the job (gloo reduces on the cores that compute, so nothing
overlaps). Every process must call :func:`detect_cluster` (the probe communicates).

Example::

    cluster, source = detect_cluster(torch.device("cpu"), nodes=1, devices_per_node=2, precision="32-true")
"""

from __future__ import annotations

import math
import os
import re
import statistics
import time
from typing import Optional

import torch
import torch.distributed as dist

from lightning_hybrid.hardware import GIB, GPU_PRESETS, Cluster


def detect_cluster(device: torch.device, nodes: int, devices_per_node: int, precision: str) -> tuple[Cluster, str]:
    """The job's hardware as a :class:`Cluster`, and where its numbers come from. Every process must call it
    (the CPU probe all-reduces over the default process group)."""
    if device.type == "cuda":
        return _gpu_cluster(device, nodes, devices_per_node, precision)
    return _probed_cpu_cluster(nodes, devices_per_node)


def device_peak_flops(device: torch.device, precision: str) -> Optional[float]:
    """A GPU's dense peak FLOP/s in the training dtype (fp32 for ``32-true``, else 16-bit): the datasheet number of
    its :data:`GPU_PRESETS` entry when it has one, else Lightning's table — which lists some GPUs with their
    sparse peak (the H200's bf16 as 2.0e15 where dense is 989e12), so the presets come first. ``None`` for a CPU or
    a GPU neither knows."""
    if device.type != "cuda":
        return None
    memory = float(torch.cuda.get_device_properties(device).total_memory)
    preset = _preset_for(torch.cuda.get_device_name(device), memory)
    if preset is not None:
        return Cluster.preset(preset, precision=precision).peak_flops
    from lightning.fabric.utilities.throughput import get_available_flops  # Lightning's table of GPU peaks

    return get_available_flops(device, torch.float32 if precision == "32-true" else torch.bfloat16)


def _gpu_cluster(device: torch.device, nodes: int, devices_per_node: int, precision: str) -> tuple[Cluster, str]:
    name = torch.cuda.get_device_name(device)
    memory = float(torch.cuda.get_device_properties(device).total_memory)
    preset = _preset_for(name, memory)
    if preset is not None:
        cluster = Cluster.preset(preset, nodes=nodes, gpus_per_node=devices_per_node, precision=precision,
                                 memory_bytes=memory)
        return cluster, f"{name}, preset {preset!r} (peak, links), {memory / GIB:.1f} GiB from the device"
    peak = device_peak_flops(device, precision)
    if peak is None:
        raise ValueError(
            f"HybridStrategy(tp='auto'/pp='auto') does not know the peak FLOP/s of {name!r}. Describe it:"
            " HybridStrategy(..., cluster=Cluster(nodes=..., gpus_per_node=..., memory_bytes=..., peak_flops=...,"
            " intra_node_bandwidth=..., inter_node_bandwidth=...)) (lightning_hybrid.Cluster)."
        )
    # Links unknown: assume PCIe Gen4 within a node and 100 Gb/s between nodes (the L4 preset's numbers).
    links = GPU_PRESETS["l4"]
    cluster = Cluster(nodes=nodes, gpus_per_node=devices_per_node, memory_bytes=memory, peak_flops=peak,
                      intra_node_bandwidth=links.intra_node_gbps * 1e9, inter_node_bandwidth=links.inter_node_gbps * 1e9)
    return cluster, f"{name}, peak {peak / 1e12:.0f} TFLOP/s from Lightning's table, links assumed PCIe/100 Gb/s"


def _preset_for(name: str, memory: float) -> Optional[str]:
    lowered = name.lower()
    if "h200" in lowered:
        return "h200"
    if "h100" in lowered:
        return "h100-sxm"
    if "a100" in lowered:
        return "a100-80gb" if memory > 50 * GIB else "a100-40gb"
    if re.search(r"\bl4\b", lowered):
        return "l4"
    return None


def _probed_cpu_cluster(nodes: int, devices_per_node: int) -> tuple[Cluster, str]:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / devices_per_node
    if dist.is_initialized():
        dist.barrier()  # every process probes at once: the rate each gets while all of them compute
    flops = matmul_flops()
    latency, bandwidth = all_reduce_link()
    # gloo reduces on the cores that compute: nothing hides behind compute
    cluster = Cluster(nodes=nodes, gpus_per_node=devices_per_node, memory_bytes=memory, peak_flops=flops,
                      intra_node_bandwidth=bandwidth, inter_node_bandwidth=bandwidth, efficiency=1.0, latency=latency,
                      overlap_communication=False)
    links = "no links (one process)" if math.isinf(bandwidth) else (
        f"all-reduce {latency * 1e6:.0f} µs + {bandwidth / 1e9:.2f} GB/s")
    return cluster, (f"CPU probe: matmul {flops / 1e9:.0f} GFLOP/s per process, {links}, {memory / GIB:.1f} GiB of"
                     " RAM per process")


def matmul_flops(size: int = 512, repeats: int = 5) -> float:
    """FLOP/s of one fp32 ``size``² matmul on this process's CPU threads (median of ``repeats``)."""
    a, b = torch.ones(size, size), torch.ones(size, size)  # not random: the user's random streams stay untouched
    a @ b
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        seconds.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(seconds)


def all_reduce_link(size_bytes: int = 4 * 2**20, repeats: int = 3) -> tuple[float, float]:
    """(latency s, bus bandwidth bytes/s) of all-reduces over the default process group, the α and β of the
    planner: α = a 1 KiB all-reduce's time, bandwidth = 2·(n−1)/n × bytes / (time − α) at ``size_bytes``; each the
    slowest rank's median. (0, infinite) with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 0.0, math.inf
    world = dist.get_world_size()
    latency = _slowest_median_all_reduce(256, repeats)
    seconds = _slowest_median_all_reduce(size_bytes // 4, repeats)
    return latency, 2 * (world - 1) / world * size_bytes / max(seconds - latency, 1e-9)


def _slowest_median_all_reduce(elements: int, repeats: int) -> float:
    buffer = torch.zeros(elements)
    dist.all_reduce(buffer)
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        dist.all_reduce(buffer)
        seconds.append(time.perf_counter() - start)
    slowest = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)
