"""The pipeline's own CPU cost per microbatch and per step, next to a hand-written ``PipelineStage`` + schedule.

Model and data: :class:`TinyLM`, a parallelism-unaware LightningModule (an embedding, :data:`BLOCKS` residual
blocks of two ``Linear(WIDTH, WIDTH)`` with a tanh between them, a head; width 16, vocabulary 32, fp32, SGD) whose
``training_step`` computes a token cross-entropy and ``self.log``\\ s it; every step a global batch of
:data:`BATCH` sequences of :data:`SEQUENCE` random tokens (fixed seed, the same on every side and rank). The blocks
are so small that the compute is a small part of a step and the per-microbatch overhead dominates. The global batch
is the same for every microbatch count ``m``, so the FLOPs per step stay the same as ``m`` grows.

Sides (2 CPU processes, pp=2, 1F1B, gloo, ``OMP_NUM_THREADS=1``, started by ``benchmarks/harness.py`` with the
environment variables that ``torch.distributed.run`` sets):

``A``  Lightning ``Trainer`` + ``HybridStrategy(pp=2, microbatches=m, pp_split=(2, 2), monitor=False)``, the module
       unchanged.
``B``  No Lightning: ``init_process_group("gloo")``, the same model cut by hand at the same block boundary (2 | 2)
       into one stage module per rank (:class:`FirstStage`, :class:`LastStage`), ``PipelineStage`` +
       ``Schedule1F1B(n_microbatches=m, loss_fn=...)``; loop: ``schedule.step``, ``optimizer.step()``,
       ``zero_grad()``.

What is measured: a step runs from the end of the previous one to its own end (``on_train_batch_end`` for A, the
loop iteration's end for B), so A's figure also holds Lightning's own per-step work. After :data:`WARMUP_STEPS`
steps (shape inference, allocator warm-up), ``--steps`` timed steps: per rank the median ``time.process_time()``
per step (CPU time of the whole process, gloo's threads included: the low-noise figure on a shared machine; it
leaves out waiting, so the pipeline bubble is seen only in wall time) and the median ``time.perf_counter()`` per
step. Rank r runs stage r. With ``--rounds`` > 1 the sides alternate (A, B, then B, A, ...) and the medians over
rounds are reported. Per stage and side, a least-squares line over m = 2, 8, 16 gives the *per-microbatch* cost
(the slope, ms per microbatch) and the *per-step* cost (the intercept, ms); A−B is what HybridStrategy and
Lightning add to torch's pipelining.

``--profile DIR`` runs each rank's timed steps under ``cProfile`` (``DIR/{side}-m{m}-rank{r}.prof``, read with
``python -m pstats``); its times are inflated by the profiler and no table is printed.

Usage::

    python benchmarks/pipeline_overhead.py --steps 30 --rounds 1
    python benchmarks/pipeline_overhead.py --profile /tmp/ppcost --microbatches 16
"""

from __future__ import annotations

import argparse
import cProfile
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.harness import (  # noqa: E402
    alternating, fit_line, launch_ranks, markdown_table, median_gap, save_rank_result,
)

WIDTH, VOCAB, BLOCKS, BATCH, SEQUENCE, WARMUP_STEPS, LR = 16, 32, 4, 16, 8, 5, 0.1
MICROBATCHES = (2, 8, 16)
#: Blocks per stage, on both sides (the FLOP-balanced split would give the head's stage fewer blocks).
SPLIT = (BLOCKS // 2, BLOCKS // 2)


# ============================================================================================ the model
class Block(nn.Module):
    """A tiny residual MLP block."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Embedding, blocks, head: what both sides train."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def make_data(steps: int) -> tuple[Tensor, Tensor]:
    """Every step's batch, tokens and next-token targets, the same on every side and rank."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(VOCAB, (steps * BATCH, SEQUENCE + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_lightning_module() -> Any:
    """:class:`TinyLM`: an ordinary LightningModule around :class:`Net` (imported here: side B needs no Lightning)."""
    import lightning.pytorch as pl

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Net()

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            tokens, targets = batch
            loss = token_loss(self.model(tokens), targets)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    return TinyLM()


# ============================================================================================ the sides
def run_hybrid(microbatches: int, steps: int, profile: Optional[Path]) -> tuple[list[float], list[float]]:
    """Side A: per-step end times ``(process_time, perf_counter)`` of this rank, Lightning + HybridStrategy."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hybrid import HybridStrategy

    ends: tuple[list[float], list[float]] = ([], [])
    profiler = cProfile.Profile()

    class StepEnds(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *unused: Any) -> None:
            ends[0].append(time.process_time())
            ends[1].append(time.perf_counter())
            if profile is not None and len(ends[0]) == WARMUP_STEPS:
                profiler.enable()

    torch.manual_seed(0)
    module = make_lightning_module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, max_steps=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[StepEnds()],
        strategy=HybridStrategy(pp=2, microbatches=microbatches, pp_split=SPLIT, monitor=False),
    )
    trainer.fit(module, DataLoader(TensorDataset(*make_data(steps)), batch_size=BATCH))
    if profile is not None:
        profiler.disable()
        profiler.dump_stats(profile / f"A-m{microbatches}-rank{trainer.global_rank}.prof")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()  # gloo's threads left running abort the process at exit
    return ends


class FirstStage(nn.Module):
    """The embedding and the first half of the blocks (``Net.forward`` up to the cut)."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.embed, self.blocks = net.embed, nn.ModuleList(net.blocks[:SPLIT[0]])

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return x


class LastStage(nn.Module):
    """The second half of the blocks and the head (``Net.forward`` after the cut)."""

    def __init__(self, net: Net) -> None:
        super().__init__()
        self.blocks, self.head = nn.ModuleList(net.blocks[SPLIT[0]:]), net.head

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def run_manual(microbatches: int, steps: int, profile: Optional[Path]) -> tuple[list[float], list[float]]:
    """Side B: per-step end times ``(process_time, perf_counter)`` of this rank, a hand-written pipeline loop."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = Net()
    stage_module = FirstStage(net) if rank == 0 else LastStage(net)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=microbatches, loss_fn=token_loss)
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=LR)
    tokens, targets = make_data(steps)
    ends: tuple[list[float], list[float]] = ([], [])
    profiler = cProfile.Profile()
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        if rank == 0:
            schedule.step(tokens[batch])
        else:
            schedule.step(target=targets[batch])
        optimizer.step()
        optimizer.zero_grad()
        ends[0].append(time.process_time())
        ends[1].append(time.perf_counter())
        if profile is not None and len(ends[0]) == WARMUP_STEPS:
            profiler.enable()
    if profile is not None:
        profiler.disable()
        profiler.dump_stats(profile / f"B-m{microbatches}-rank{rank}.prof")
    dist.barrier()
    dist.destroy_process_group()
    return ends


def worker(args: argparse.Namespace) -> None:
    """One rank of one side: save the median CPU and wall milliseconds per timed step."""
    warnings.filterwarnings("ignore")
    steps = WARMUP_STEPS + args.steps
    profile = Path(args.profile) if args.profile else None
    if args.side == "A":
        cpu, wall = run_hybrid(args.worker_microbatches, steps, profile)
    else:
        cpu, wall = run_manual(args.worker_microbatches, steps, profile)
    medians = {name: 1e3 * median_gap(ends, WARMUP_STEPS) for name, ends in (("cpu", cpu), ("wall", wall))}
    save_rank_result(args.out, medians)


# ============================================================================================ the parent
def launch(side: str, microbatches: int, args: argparse.Namespace) -> list[dict[str, float]]:
    """Run one side at ``microbatches`` on 2 ranks; per rank, its median CPU and wall ms per step."""
    worker_args = ["--side", side, "--worker-microbatches", microbatches, "--steps", args.steps]
    return launch_ranks(Path(__file__), worker_args + (["--profile", args.profile] if args.profile else []), 2).ranks


def print_table(measured: dict[tuple[str, int], list[dict[str, float]]], microbatches: list[int], key: str) -> None:
    """One markdown table of ``key`` ("cpu" or "wall") ms per step, per stage and side, with slope and intercept."""
    print(f"\n{key.upper()} time per step (ms, median of steps and rounds), per stage; slope = ms per microbatch,"
          " intercept = ms per step\n")
    rows = []
    for stage in range(2):
        values = {side: [measured[side, m][stage][key] for m in microbatches] for side in ("A", "B")}
        values["A−B"] = [a - b for a, b in zip(values["A"], values["B"])]
        for side, row in values.items():
            slope, intercept = fit_line(microbatches, row)
            rows.append([stage, side, *(f"{v:.2f}" for v in row), f"{slope:.3f}", f"{intercept:.2f}"])
    print(markdown_table(["stage", "side", *(f"m={m}" for m in microbatches), "per microbatch", "per step"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps per launch (after the warm-up)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--microbatches", type=int, nargs="+", default=list(MICROBATCHES))
    parser.add_argument("--profile", help="folder: run the timed steps under cProfile, one .prof per side, rank, m")
    parser.add_argument("--side", choices=("A", "B"), help=argparse.SUPPRESS)  # a worker rank
    parser.add_argument("--worker-microbatches", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side is not None:
        worker(args)
        return
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    rounds: dict[tuple[str, int], list[list[dict[str, float]]]] = {}
    launches = [(side, m) for m in args.microbatches for side in ("A", "B")]
    for _, (side, m) in alternating(launches, args.rounds):  # drift of the machine falls on both sides
        rounds.setdefault((side, m), []).append(launch(side, m, args))
    if args.profile:
        print(f"profiles in {args.profile}")
        return
    measured = {key: [{name: statistics.median(r[stage][name] for r in runs) for name in ("cpu", "wall")}
                      for stage in range(2)] for key, runs in rounds.items()}
    print(f"pp=2 1F1B, batch {BATCH}x{SEQUENCE}, {BLOCKS} blocks of width {WIDTH}; {args.steps} timed steps after"
          f" {WARMUP_STEPS}, {args.rounds} round(s); A = Lightning + HybridStrategy, B = hand-written PipelineStage")
    for key in ("cpu", "wall"):
        print_table(measured, args.microbatches, key)


if __name__ == "__main__":
    main()
