"""Host memory of loading a Hugging Face checkpoint into the sharded layout (``HybridStrategy(weights=...)``).

A Llama-style ``LlamaForCausalLM`` of :data:`CONFIG` (245 M parameters, fp32: 0.98 GB of safetensors) is built once
in this process and written with ``save_pretrained`` (the "published" checkpoint). Then 4 ranks (started by
``benchmarks/harness.py``, gloo, CPU) each build the LightningModule's model on the meta device and run
``trainer.validate`` with ``HybridStrategy(tp=2, pp=2, weights=...)``: setup splits, shards, materializes and
loads. Each rank samples its anonymous resident memory (``RssAnon`` in ``/proc/self/status``: the memory-mapped
safetensors pages it reads are file cache, not counted) every millisecond on a thread and reports, from the moment
the driver starts (model on meta: nothing allocated) to the moment loading returns:

* ``growth``: the peak RSS above the start (shards allocated + whatever loading needs at once);
* the same split by step: before materializing (tracing, splitting, sharding on meta), materializing (shards
  allocated and initialized, one module's full tensors at a time), loading alone (shards already allocated);
* ``share``: the bytes of the parameters and buffers this rank holds after setup (its ideal);

and the ratio growth / share (goal ≤ 1.3: no rank holds much more than its own shards while loading).

Run: ``python benchmarks/hf_load_memory.py`` (about 2 minutes on 2 cores; needs ~5 GB of RAM and 1 GB of disk).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import launch_ranks, markdown_table, save_rank_result  # noqa: E402

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


def validate_meta_llama(config: dict[str, Any], **strategy_kwargs: Any) -> tuple[Any, Any]:
    """Validate once a ``LlamaForCausalLM`` of ``config`` built on the meta device, under
    ``HybridStrategy(tp=2, pp=2, **strategy_kwargs)`` on :data:`WORLD` CPU ranks: (trainer, LightningModule)."""
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    from lightning_hybrid import HybridStrategy

    class Module(LightningModule):
        def configure_model(self) -> None:
            with torch.device("meta"):
                self.model = LlamaForCausalLM(LlamaConfig(**config))

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.model(batch[0], labels=batch[0]).loss)

    module = Module()
    trainer = Trainer(accelerator="cpu", devices=WORLD, strategy=HybridStrategy(tp=2, pp=2, **strategy_kwargs),
                      logger=False, enable_progress_bar=False, enable_checkpointing=False, limit_val_batches=1)
    data = DataLoader(TensorDataset(torch.randint(0, config["vocab_size"], (4, 16))), batch_size=4)
    trainer.validate(module, data)
    return trainer, module


def run_rank(weights: Path, out: Path) -> None:
    """One rank: validate once with the checkpoint loaded under tp2 × pp2; write this rank's numbers."""
    from lightning_hybrid import strategy
    from lightning_hybrid.parallel import parallelize

    peaks: dict[str, PeakRSS] = {}
    parallelize.load_pretrained = _measured(parallelize.load_pretrained, peaks, "load")
    parallelize.apply_materialization = _measured(parallelize.apply_materialization, peaks, "materialize")
    strategy.parallelize = _measured(strategy.parallelize, peaks, "driver")  # the name the strategy calls
    trainer, module = validate_meta_llama(CONFIG, weights=str(weights))
    held = [t.to_local() if hasattr(t, "to_local") else t for t in module.state_dict().values()]
    share = sum(t.numel() * t.element_size() for t in held if not t.is_meta)
    driver, load, made = peaks["driver"], peaks["load"], peaks["materialize"]
    save_rank_result(out, {"rank": trainer.global_rank, "share": share, "growth": driver.peak - driver.start,
                           "before_materialize": made.start - driver.start, "materialized": made.peak - made.start,
                           "load_growth": load.peak - load.start}, trainer.global_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", metavar="WEIGHTS", help=argparse.SUPPRESS)  # a rank, loading this checkpoint
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness: WORLD
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(Path(args.worker), args.out)
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="hf-load-bench-") as folder:
        weights = Path(folder) / "weights"
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
        parameters = sum(p.numel() for p in model.parameters())
        model.save_pretrained(weights, max_shard_size="200MB")
        del model
        ranks = launch_ranks(Path(__file__), ["--worker", weights], world=WORLD, timeout_s=1800).ranks
    print(f"LlamaForCausalLM {parameters / 1e6:.0f} M parameters ({4 * parameters / 2**30:.2f} GiB fp32),"
          f" tp2 x pp2 on {WORLD} ranks, torch {torch.__version__}")
    rows = [[r["rank"], f"{r['share'] / MiB:.0f}", f"{r['growth'] / MiB:.0f}", f"{r['growth'] / r['share']:.2f}",
             f"{r['before_materialize'] / MiB:.0f}", f"{r['materialized'] / MiB:.0f}", f"{r['load_growth'] / MiB:.0f}"]
            for r in ranks]
    print(markdown_table(["rank", "share MiB", "growth MiB (meta -> loaded)", "ratio", "before materializing",
                          "materializing (peak)", "loading (peak)"], rows))


if __name__ == "__main__":
    main()
