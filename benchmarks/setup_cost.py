"""Setup cost: seconds from ``trainer.fit()`` to the end of the first training batch, and how often setup runs the
user's step, for a Hugging Face Llama of growing depth under each layout (issue 28).

Model: transformers' ``LlamaForCausalLM`` built from a config (width 64, 4 heads over 2 key-value heads, MLP 128,
vocabulary 128, untied head, SDPA attention; nothing downloaded) with ``--blocks`` decoder layers (8, 32, 64), in a
minimal LightningModule (:class:`CountingLlama`: ``training_step`` returns the model's loss, ``train_dataloader``
serves :data:`BATCH` sequences of :data:`SEQUENCE` random tokens, AdamW); fp32, one optimizer step. Layouts (one
process per rank, started by ``benchmarks/harness.py``, gloo, one thread each): ``single`` = plain Lightning on one
device (no strategy), ``tp2`` = ``HybridStrategy(tp=2)``, ``pp2`` = ``HybridStrategy(pp=2)``, ``tp2-pp2`` =
``HybridStrategy(tp=2, pp=2)``, every other option at its default; ``pp2-unverified`` = ``HybridStrategy(pp=2,
verify_pipeline=False)``, the pipeline's setup verification's cost by difference. The Trainer keeps Lightning's defaults where
they cost setup time (the TensorBoard logger, the model summary, HybridStrategy's monitor); progress bar and
checkpointing are off.

Measured in each rank, from outside the strategy (the same script measures any version of it):

seconds
    From just before ``trainer.fit()`` to ``on_train_batch_end`` of batch 0: setup, then the first batch's forward,
    backward and optimizer step. Reported: the slowest rank, the median over ``--rounds``.
step runs at setup
    How many times the module's ``training_step`` was entered before ``on_train_batch_start`` of batch 0: the runs
    the strategy makes of the user's step to learn the model (0 under plain Lightning). Counted on the class, so a
    copy of the module the strategy runs counts too.
dataloader calls
    How many times the ``train_dataloader`` hook was called during the fit (1 under plain Lightning).

Per layout the least-squares slope of seconds over blocks (ms per block), and the slope between each pair of
consecutive depths: setup time per block must not grow with depth, so the later slopes must not exceed the first
by more than the noise.

Usage::

    python benchmarks/setup_cost.py                              # 8, 32, 64 blocks × 4 layouts, one round
    python benchmarks/setup_cost.py --layouts single,tp2 --blocks 8 16 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import (  # noqa: E402
    alternating, fit_line, launch_ranks, markdown_table, revision, save_rank_result,
)

#: Layout name → ``HybridStrategy`` keyword arguments (``None``: plain Lightning on one device).
LAYOUTS: dict[str, dict[str, int] | None] = {"single": None, "tp2": {"tp": 2}, "pp2": {"pp": 2},
                                              "tp2-pp2": {"tp": 2, "pp": 2},
                                              # the pipeline's setup verification's cost, side by side
                                              "pp2-unverified": {"pp": 2, "verify_pipeline": False}}
BLOCKS = (8, 32, 64)
LLAMA = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="sdpa")
BATCH, SEQUENCE = 8, 32


def world_size(layout: str) -> int:
    degrees = LAYOUTS[layout] or {}
    return degrees.get("tp", 1) * degrees.get("pp", 1)


# ================================================================================================ one rank
def make_module(blocks: int) -> Any:
    """A :class:`CountingLlama` of ``blocks`` decoder layers (defined on first use: the parent never imports
    Lightning)."""
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import LlamaConfig, LlamaForCausalLM

    class CountingLlama(pl.LightningModule):
        """An unmodified Hugging Face Llama in a LightningModule that counts what setup calls (class counters:
        copies of the module count too) and notes when the first batch ends."""

        counts = {"training_step": 0, "train_dataloader": 0}

        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=blocks, **LLAMA))
            self.step_runs_at_setup: int | None = None
            self.first_batch_end = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            CountingLlama.counts["training_step"] += 1
            (tokens,) = batch
            return self.model(input_ids=tokens, labels=tokens).loss

        def train_dataloader(self) -> DataLoader:
            CountingLlama.counts["train_dataloader"] += 1
            generator = torch.Generator().manual_seed(0)
            tokens = torch.randint(0, LLAMA["vocab_size"], (BATCH, SEQUENCE), generator=generator)
            return DataLoader(TensorDataset(tokens), batch_size=BATCH)

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.step_runs_at_setup = CountingLlama.counts["training_step"]

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            if batch_idx == 0:
                self.first_batch_end = time.perf_counter()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)  # the same weights on every rank
    return CountingLlama()


def measure(layout: str, blocks: int, log_dir: Path) -> dict[str, Any]:
    """This rank's seconds from ``fit()`` to the end of batch 0, step runs at setup, dataloader calls."""
    import lightning.pytorch as pl

    warnings.simplefilter("ignore")  # Lightning's advice about workers and logging intervals on a one-step run
    module = make_module(blocks)
    degrees = LAYOUTS[layout]
    if degrees is None:
        placement: dict[str, Any] = {"devices": 1}
    else:
        from lightning_hybrid import HybridStrategy

        placement = {"devices": world_size(layout), "strategy": HybridStrategy(**degrees)}
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, limit_val_batches=0, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_checkpointing=False, default_root_dir=log_dir, **placement)
    start = time.perf_counter()
    trainer.fit(module)
    return {"seconds": module.first_batch_end - start, "step_runs": module.step_runs_at_setup,
            "loader_calls": type(module).counts["train_dataloader"], "rank": trainer.global_rank}


def run_rank(layout: str, blocks: int, out: Path) -> None:
    """One rank of a launch: measure, save, leave the process group together."""
    import torch.distributed as dist

    result = measure(layout, blocks, out.parent / "logs")
    save_rank_result(out, result, result["rank"])
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()  # gloo's threads left running abort the process at exit


# ================================================================================================ the parent
def measure_all(layouts: list[str], depths: list[int], rounds: int) -> dict[tuple[str, int], list[list[dict]]]:
    """Every (layout, blocks) launched once per round, alternating; each launch's per-rank results."""
    results: dict[tuple[str, int], list[list[dict]]] = {}
    for round_index, (layout, blocks) in alternating([(name, b) for name in layouts for b in depths], rounds):
        launched = launch_ranks(Path(__file__), ["--worker", layout, blocks], world=world_size(layout))
        results.setdefault((layout, blocks), []).append(launched.ranks)
        slowest = max(rank["seconds"] for rank in launched.ranks)
        print(f"  round {round_index + 1}/{rounds} {layout:8s} {blocks:3d} blocks: {slowest:6.2f} s"
              f" (launch {launched.wall_s:.0f} s)", file=sys.stderr, flush=True)
    return results


def per_rank(values: list[Any]) -> str:
    """One value if every rank saw the same, else each rank's (by rank, ``/``-separated)."""
    return str(values[0]) if len(set(values)) == 1 else " / ".join(map(str, values))


def seconds(runs: list[list[dict]]) -> float:
    """The slowest rank's seconds, median over rounds."""
    return statistics.median(max(rank["seconds"] for rank in ranks) for ranks in runs)


def cost_table(results: dict[tuple[str, int], list[list[dict]]]) -> str:
    rows = []
    for (layout, blocks), runs in results.items():
        first = runs[0]
        rows.append([layout, blocks, f"{seconds(runs):.2f}", per_rank([rank["step_runs"] for rank in first]),
                     per_rank([rank["loader_calls"] for rank in first])])
    return markdown_table(["layout", "blocks", "seconds to the end of batch 0", "step runs at setup",
                           "dataloader calls"], rows)


def slope_table(results: dict[tuple[str, int], list[list[dict]]], layouts: list[str], depths: list[int]) -> str:
    rows = []
    for layout in layouts:
        times = [seconds(results[layout, blocks]) for blocks in depths]
        slope, intercept = fit_line(depths, times)
        steps = [f"{1e3 * (t1 - t0) / (b1 - b0):.1f}" for (b0, t0), (b1, t1) in pairwise(zip(depths, times))]
        rows.append([layout, f"{1e3 * slope:.1f}", f"{intercept:.2f}", ", ".join(steps)])
    return markdown_table(["layout", "slope ms per block (least squares)", "intercept s",
                           "ms per block between consecutive depths"], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--blocks", type=int, nargs="+", default=list(BLOCKS), help="depths (at least two)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--worker", nargs=2, metavar=("LAYOUT", "BLOCKS"), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker[0], int(args.worker[1]), args.out)
        return
    layouts, depths = args.layouts.split(","), sorted(args.blocks)
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or len(depths) < 2:
        parser.error(f"layouts of {', '.join(LAYOUTS)} (not {unknown}) and at least two depths")
    started = time.perf_counter()
    results = measure_all(layouts, depths, args.rounds)
    print(f"lightning_hybrid at {revision()}; LlamaForCausalLM {LLAMA}, batch {BATCH} x {SEQUENCE} tokens;"
          f" {args.rounds} round(s); {time.perf_counter() - started:.0f} s\n")
    print(cost_table(results))
    print()
    print(slope_table(results, layouts, depths))


if __name__ == "__main__":
    main()
