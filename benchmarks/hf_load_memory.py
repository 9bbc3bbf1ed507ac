"""Host memory of loading a Hugging Face checkpoint into the sharded layout (``HybridStrategy(weights=...)``).

A Llama-style ``LlamaForCausalLM`` of :data:`CONFIG` (245 M parameters, fp32: 0.98 GB of safetensors) is built once
in this process and written with ``save_pretrained`` (the "published" checkpoint). Then 4 ranks (torchrun, gloo,
CPU) each build the LightningModule's model on the meta device and run ``trainer.validate`` with
``HybridStrategy(tp=2, pp=2, weights=...)``: setup splits, shards, materializes and loads. Each rank samples its
anonymous resident memory (``RssAnon`` in ``/proc/self/status``: the memory-mapped safetensors pages it reads are
file cache, not counted) every millisecond on a thread and reports, from the moment the driver starts (model on
meta: nothing allocated) to the moment loading returns:

* ``growth``: the peak RSS above the start (shards allocated + whatever loading needs at once);
* the same split by step: before materializing (tracing, splitting, sharding on meta), materializing (shards
  allocated and initialized, one module's full tensors at a time), loading alone (shards already allocated);
* ``share``: the bytes of the parameters and buffers this rank holds after setup (its ideal);

and the ratio growth / share (goal ≤ 1.3: no rank holds much more than its own shards while loading).

Run: ``python benchmarks/hf_load_memory.py`` (about 2 minutes on 2 cores; needs ~5 GB of RAM and 1 GB of disk).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
              num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=64, tie_word_embeddings=False,
              attn_implementation="eager")
WORLD, MiB = 4, 2**20


class PeakRSS:
    """The largest resident set size seen by a sampling thread while the context is open, in bytes."""

    def __init__(self) -> None:
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.001)

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss()
        self._thread.start()
        return self

    def __exit__(self, *args: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())


def _rss() -> int:
    """Anonymous resident memory: safetensors files are memory-mapped, and the page-cache pages a rank reads
    through the mapping count towards its RSS although they are the kernel's file cache, shared and reclaimable."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def _measured(function: Callable[..., Any], into: dict[str, PeakRSS], name: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with PeakRSS() as peak:
            into[name] = peak
            return function(*args, **kwargs)
    return wrapper


def run_rank(weights: Path, out: Path) -> None:
    """One rank: validate once with the checkpoint loaded under tp2 × pp2; write this rank's numbers."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_hybrid import HybridStrategy, strategy
    from lightning_hybrid.parallel import parallelize

    class Module(LightningModule):
        def configure_model(self) -> None:
            with torch.device("meta"):
                self.model = LlamaForCausalLM(LlamaConfig(**CONFIG))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.model(batch[0], labels=batch[0]).loss)

    peaks: dict[str, PeakRSS] = {}
    parallelize.load_pretrained = _measured(parallelize.load_pretrained, peaks, "load")
    parallelize.apply_materialization = _measured(parallelize.apply_materialization, peaks, "materialize")
    strategy.parallelize = _measured(strategy.parallelize, peaks, "driver")  # the name the strategy calls
    module = Module()
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=HybridStrategy(tp=2, pp=2, weights=str(weights)),
                      logger=False, enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=1)
    data = DataLoader(TensorDataset(torch.randint(0, CONFIG["vocab_size"], (4, 16))), batch_size=4)
    trainer.validate(module, data)
    held = [t.to_local() if hasattr(t, "to_local") else t for t in module.state_dict().values()]
    share = sum(t.numel() * t.element_size() for t in held if not t.is_meta)
    driver, load, made = peaks["driver"], peaks["load"], peaks["materialize"]
    out.write_text(json.dumps({"rank": trainer.global_rank, "share": share, "growth": driver.peak - driver.start,
                               "before_materialize": made.start - driver.start, "materialized": made.peak - made.start,
                               "load_growth": load.peak - load.start}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", nargs=2, metavar=("WEIGHTS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(Path(args.worker[0]), Path(args.worker[1]) / f"rank{os.environ['RANK']}.json")
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf-load-bench-") as folder:
        weights, out = Path(folder) / "weights", Path(folder)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(weights, max_shard_size="200MB")
        del model
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
                   str(Path(__file__).resolve()), "--worker", str(weights), str(out)]
        done = subprocess.run(command, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1800)
        if done.returncode:
            raise SystemExit(f"ranks failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
        ranks = sorted((json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)), key=lambda r: r["rank"])
    print(f"LlamaForCausalLM {parameters / 1e6:.0f} M parameters ({4 * parameters / 2**30:.2f} GiB fp32),"
          f" tp2 x pp2 on {WORLD} ranks, torch {torch.__version__}")
    print("| rank | share MiB | growth MiB (meta -> loaded) | ratio | before materializing | materializing (peak)"
          " | loading (peak) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in ranks:
        print(f"| {r['rank']} | {r['share'] / MiB:.0f} | {r['growth'] / MiB:.0f} | {r['growth'] / r['share']:.2f} |"
              f" {r['before_materialize'] / MiB:.0f} | {r['materialized'] / MiB:.0f} | {r['load_growth'] / MiB:.0f} |")


if __name__ == "__main__":
    main()
