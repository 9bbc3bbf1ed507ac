"""``HybridStrategy(compile=True)`` next to eager: step time, and the compile time the first step pays.

Model and data: ``recipes/gpt.py``'s GPT with ``benchmarks/compare.py``'s :data:`CONFIG` (4 blocks, width 256,
8 heads, vocabulary 256, sequence 128: 3.3 M parameters), fp32, the recipe's AdamW + LambdaLR, a global batch of
:data:`GLOBAL_BATCH` sequences of random tokens (fixed seed), on CPU (inductor generates C++), gloo between ranks,
``OMP_NUM_THREADS=1`` per rank. Both sides are the same Lightning ``Trainer`` + ``HybridStrategy(monitor=False)``
and differ only in ``compile=``.

What is measured, per launch (one process per rank, started by ``benchmarks/harness.py``):

Step time
    From one ``on_train_batch_end`` to the next, after :data:`WARMUP_STEPS` steps; the median over the timed
    steps on each rank, then the maximum over ranks. Sides alternate within a round and the next round runs them
    in reverse order, so drift of the shared machine falls on both; the ratio is the median of the per-round
    ratios (range printed).
Compile time
    The first step (from ``on_train_start`` to its ``on_train_batch_end``) minus the median step: Dynamo's tracing and
    inductor's code generation for every block graph (forward and backward), each launch with an empty inductor
    cache (``TORCHINDUCTOR_CACHE_DIR`` a fresh folder), so it is the cold cost a new machine pays; the eager side's
    first-step surplus (lazy optimizer state, allocator warm-up) is printed next to it.

Usage::

    python benchmarks/compile_speed.py                       # 1 process and tp2, 3 rounds (about 6 minutes)
    python benchmarks/compile_speed.py --layouts single --rounds 5 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import alternating, launch_ranks, markdown_table, median_gap, save_rank_result  # noqa: E402

GLOBAL_BATCH = 8
WARMUP_STEPS = 2
TIMED_STEPS = 10
ROUNDS = 3
#: Layout name → HybridStrategy degrees (and the number of processes).
LAYOUTS = {"single": {}, "tp2": {"tp": 2}, "pp2": {"pp": 2}}


def world_size(layout: str) -> int:
    return max([1, *LAYOUTS[layout].values()])


def worker(layout: str, compile_blocks: bool, steps: int, out: Path, inductor_cache: str) -> None:
    """One rank of one training run: saves its first-step and median step seconds. ``inductor_cache``: an empty
    folder of the launch's own, so every launch compiles cold."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache  # read by inductor whenever it looks for its cache
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.compare import CONFIG
    from lightning_hybrid import HybridStrategy
    from recipes.gpt import GPTLightning

    torch.manual_seed(1234)
    module = GPTLightning(CONFIG, warmup_steps=2, max_steps=WARMUP_STEPS + steps + 1)
    tokens = torch.randint(0, CONFIG.vocab_size, (GLOBAL_BATCH * (WARMUP_STEPS + steps + 1), CONFIG.block_size + 1),
                           generator=torch.Generator().manual_seed(4321))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=GLOBAL_BATCH)
    degrees = LAYOUTS[layout]
    timer = _step_timer()
    trainer = pl.Trainer(accelerator="cpu", devices=world_size(layout), max_steps=WARMUP_STEPS + steps + 1,
                         strategy=HybridStrategy(**degrees, compile=compile_blocks, monitor=False), logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[timer], num_sanity_val_steps=0, limit_val_batches=0)
    trainer.fit(module, train_dataloaders=data)
    save_rank_result(out, {"first_s": timer.first_s, "step_s": timer.median_s()}, trainer.global_rank)


def _step_timer() -> Any:
    """A Lightning callback timing the first step from train start, then each step end to end (defined here, on
    first use, so the parent process never imports Lightning)."""
    import lightning.pytorch as pl

    class StepTimer(pl.Callback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.start = 0.0
            self.first_s = 0.0

        def on_train_start(self, *args: Any) -> None:
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            self.ends.append(time.perf_counter())
            if len(self.ends) == 1:
                self.first_s = self.ends[0] - self.start

        def median_s(self) -> float:
            return median_gap(self.ends, WARMUP_STEPS + 1)

    return StepTimer()


def launch(layout: str, compile_blocks: bool, steps: int) -> dict[str, float]:
    """One launch of :func:`worker` with an empty inductor cache; each figure the largest over ranks."""
    with tempfile.TemporaryDirectory() as folder:
        worker_args = ["--worker", layout, "--compile", int(compile_blocks), "--steps", steps,
                       "--inductor-cache", Path(folder) / "inductor"]
        ranks = launch_ranks(Path(__file__), worker_args, world_size(layout)).ranks
    return {key: max(rank[key] for rank in ranks) for key in ("first_s", "step_s")}


def measure(layouts: list[str], rounds: int, steps: int) -> dict[str, dict[bool, list[dict[str, float]]]]:
    """Every layout's two sides, ``rounds`` times, alternating the order round by round."""
    results: dict[str, dict[bool, list[dict[str, float]]]] = {name: {False: [], True: []} for name in layouts}
    for round_index, (name, side) in alternating([(name, side) for name in layouts for side in (False, True)], rounds):
        results[name][side].append(launch(name, side, steps))
        print(f"round {round_index + 1} {name} {'compile' if side else 'eager'}: {results[name][side][-1]}",
              flush=True)
    return results


def report(results: dict[str, dict[bool, list[dict[str, float]]]]) -> None:
    rows = []
    for name, sides in results.items():
        eager, compiled = sides[False], sides[True]
        ratios = [e["step_s"] / c["step_s"] for e, c in zip(eager, compiled)]
        rows.append([name, f"{statistics.median(e['step_s'] for e in eager) * 1e3:.1f} ms",
                     f"{statistics.median(c['step_s'] for c in compiled) * 1e3:.1f} ms",
                     f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}×)",
                     f"{statistics.median(c['first_s'] - c['step_s'] for c in compiled):.1f} s",
                     f"{statistics.median(e['first_s'] - e['step_s'] for e in eager):.2f} s"])
    print()
    print(markdown_table(["layout", "eager step", "compiled step", "speed-up (range)", "compile time",
                          "eager first-step surplus"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="single,tp2", help=f"comma-separated, of {', '.join(LAYOUTS)}")
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    parser.add_argument("--steps", type=int, default=TIMED_STEPS, help="timed steps per launch")
    parser.add_argument("--worker", choices=list(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--compile", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--inductor-cache", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, bool(args.compile), args.steps, args.out, args.inductor_cache)
        return
    report(measure(args.layouts.split(","), args.rounds, args.steps))


if __name__ == "__main__":
    main()
