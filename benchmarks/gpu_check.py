"""The GPU check: what only a GPU can show, in one process on one GPU, in a few minutes.

Runs, one after the other in this process, bf16-mixed training of ``recipes/gpt.py``'s GPT at a GPU-sized config
on random tokens — by default a 1B-class decoder (16 blocks, width 2048, 16 heads, sequence 2048, vocabulary
50304: 1.0B parameters), with ``--model gpt2-small`` GPT-2 small (12 blocks, width 768, sequence 1024: 124M):

``lightning``    plain single-device Lightning (``strategy="auto"``): the baseline.
``hybrid``       ``HybridStrategy()`` on the one device (FSDP2 on a 1-rank mesh: bf16-mixed's policy).
``compiled``     ``HybridStrategy(compile=True)``: every block compiled (inductor); compile time reported apart.
``offload``      ``HybridStrategy(offload=True)``: sharded parameters, gradients and optimizer state in pinned CPU
                 memory, copied to the GPU per block.

Every side carries the strategy's ``ParallelMonitor`` (added as a callback to the plain side too), so step time,
tokens/s, MFU against the device's dense bf16 peak (``get_available_flops``: 989 TFLOP/s for an H100/H200 SXM) and
peak memory (``torch.cuda.max_memory_allocated``) are the figures the monitor logs, taken from its logger calls. Next
to them, for the strategy's sides, the planner's prediction of the same layout on this GPU (the monitor's
``plan/mfu`` and ``plan/memory_gib``: the cost model's per-device figures, which one GPU can check — it cannot run a
multi-rank layout, but the planner multiplies these per-device terms out).
Step time is the monitor's mean over its window after the first batch; each side runs ``--steps`` steps with a
log window of ``--steps - 1``. The first step of ``compiled`` (compilation) is timed separately.

Finally the pipeline's CUDA-event timeline path (``pipeline.timing.StepRecorder`` with ``torch.cuda.Event``) runs on
a one-stage torch pipeline schedule of two GPT blocks: the recorded forward/backward spans must be ordered and
positive, and their sum must not exceed the step.

Usage::

    python benchmarks/gpu_check.py                        # on a GPU machine: the table for BENCHMARKS.md
    python benchmarks/gpu_check.py --device cpu --tiny    # a smoke run of the same code on a CPU (seconds)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks.harness import markdown_table  # noqa: E402
from lightning_hybrid import HybridStrategy, ParallelMonitor  # noqa: E402
from recipes.gpt import GPTConfig, GPTLightning  # noqa: E402

GPU_CONFIGS = {"1b": GPTConfig(vocab_size=50304, block_size=2048, n_layer=16, n_head=16, n_embd=2048),
               "gpt2-small": GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768)}
TINY_CONFIG = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32)
SIDES = ("lightning", "hybrid", "compiled", "offload")


class MetricsLogger(Logger):
    """Keeps every ``log_metrics`` call in memory (the monitor's figures)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "gpu_check"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Optional[int] = None) -> None:
        self.metrics.append(dict(metrics))

    def last(self, key: str) -> float:
        return next((m[key] for m in reversed(self.metrics) if key in m), float("nan"))


class FirstStepTimer(Callback):
    """Wall time of the first training batch (with ``compile=True``: compilation plus one step)."""

    def __init__(self) -> None:
        self.first_step_s = float("nan")
        self._start: Optional[float] = None

    def on_train_batch_start(self, trainer: Trainer, *args: Any) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: Trainer, *args: Any) -> None:
        if self._start is not None and math.isnan(self.first_step_s):  # the first batch
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.first_step_s = time.perf_counter() - self._start


def strategy_for(side: str, monitor: ParallelMonitor) -> Any:
    if side == "lightning":
        return "auto"
    options = {"hybrid": {}, "compiled": {"compile": True}, "offload": {"offload": True}}[side]
    return HybridStrategy(monitor=monitor, **options)


def run_side(side: str, config: GPTConfig, args: argparse.Namespace) -> dict[str, float]:
    """One fit of ``args.steps`` steps; the monitor's last window (all steps after the first)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (args.batch * args.steps, config.block_size + 1))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=args.batch)
    logger, timer = MetricsLogger(), FirstStepTimer()
    monitor = ParallelMonitor(log_every_n_steps=args.steps - 1)  # one window: every step after the first
    callbacks: list[Callback] = [timer]
    if side == "lightning":  # the strategy adds its monitor itself; the plain side gets the same one as a callback
        callbacks.append(monitor)
    strategy = strategy_for(side, monitor)
    trainer = Trainer(accelerator=args.device, devices=1, strategy=strategy, precision=args.precision,
                      max_steps=args.steps, logger=logger, callbacks=callbacks, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=args.steps - 1)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(GPTLightning(config, warmup_steps=2, max_steps=args.steps), data)
    return {"step_ms": 1e3 * logger.last("throughput/step_time_sec"),
            "tokens_per_s": logger.last("throughput/tokens_per_sec"), "mfu": logger.last("flops/mfu"),
            "tflops": logger.last("flops/tflops_per_sec_per_device"),
            "peak_gib": logger.last("memory/peak_gib_max"), "first_step_s": timer.first_step_s,
            "plan_mfu": logger.last("plan/mfu"), "plan_gib": logger.last("plan/memory_gib")}


def check_cuda_timeline(config: GPTConfig, device: torch.device) -> str:
    """The pipeline recorder's CUDA-event path on a one-stage torch schedule; returns a one-line summary."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from lightning_hybrid.pipeline.step_recorder import StepRecorder
    from recipes.gpt import Block

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="tcp://127.0.0.1:29533",
                                rank=0, world_size=1)
    blocks = torch.nn.Sequential(Block(config), Block(config)).to(device)
    stage = PipelineStage(blocks, 0, 1, device)
    recorder = StepRecorder(device)
    recorder.wrap(stage)
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: F.mse_loss(out, target))
    hidden = torch.randn(8, config.block_size, config.n_embd, device=device)
    schedule.step(hidden, target=torch.zeros_like(hidden))  # shape inference and warm-up, not recorded
    recorder.recording = True
    recorder.start()
    schedule.step(hidden, target=torch.zeros_like(hidden))
    timeline = recorder.timeline(pp_rank=0)
    spans = timeline.actions
    ordered = all(a.end <= b.start + 1e-6 for a, b in zip(spans, spans[1:]))
    positive = all(a.end > a.start >= 0 for a in spans)
    busy = sum(a.end - a.start for a in spans)
    verdict = "ok" if ordered and positive and busy <= timeline.duration and len(spans) == 8 else "FAILED"
    return (f"CUDA-event timeline ({'cuda' if device.type == 'cuda' else 'cpu clock'}): {len(spans)} actions"
            f" ({''.join(a.kind for a in spans)}), busy {1e3 * busy:.2f} of {1e3 * timeline.duration:.2f} ms:"
            f" {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="gpu", choices=("gpu", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny model (a smoke run of the script on a CPU)")
    parser.add_argument("--model", default="1b", choices=tuple(GPU_CONFIGS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    args = parser.parse_args()
    config = TINY_CONFIG if args.tiny else GPU_CONFIGS[args.model]
    device = torch.device("cuda" if args.device == "gpu" else "cpu")
    if device.type == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = {side: run_side(side, config, args) for side in args.sides}
    print(f"GPT {sum(p.numel() for p in GPTLightning(config).parameters()) / 1e6:.1f}M, batch {args.batch} x"
          f" {config.block_size} tokens, {args.precision}, {args.steps} steps (first excluded)")
    base = results.get("lightning", {}).get("step_ms", float("nan"))
    rows = [[side, f"{r['step_ms']:.1f}", f"{r['step_ms'] / base:.3f}", f"{r['tokens_per_s']:.0f}",
             f"{r['tflops']:.1f}", _or_dash(r["mfu"], ".3f"), _or_dash(r["plan_mfu"], ".3f"), f"{r['peak_gib']:.2f}",
             _or_dash(r["plan_gib"], ".2f"), f"{r['first_step_s']:.1f}"]
            for side, r in results.items()]
    print(markdown_table(["side", "step ms", "vs lightning", "tokens/s", "TFLOP/s", "MFU", "planner MFU", "peak GiB",
                          "planner GiB", "first step s"], rows))
    print(check_cuda_timeline(config, device))


def _or_dash(value: float, spec: str) -> str:
    """A figure, or "-" where the side has none (plain Lightning has no planner prediction; CPUs no MFU)."""
    return "-" if math.isnan(value) else format(value, spec)


if __name__ == "__main__":
    main()
