"""What the stuck-rank watchdog costs: per batch on the training thread, per beat on its own thread.

* **Per batch** (the training thread's only work): ``Watchdog.on_train_batch_end`` with a real ``Trainer`` (its
  ``global_step`` read included), timed with ``timeit`` against an empty callback hook of the same signature; the
  difference is what a step pays. Median of ``--repeats`` runs of ``--number`` calls.
* **Per beat** (the daemon thread, every ``min(5 s, bound / 5)``): one publish and one read of every rank's beat
  against a ``TCPStore`` served in this process on localhost, for several world sizes (the other ranks' keys
  written beforehand), and the share of the default 5 s interval it is busy.

Usage::

    python benchmarks/watchdog_cost.py
    python benchmarks/watchdog_cost.py --number 200000 --world-sizes 2 64 512
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch import Callback, Trainer

from lightning_hybrid.resilience.watchdog import BEAT_INTERVAL_S, Beat, Heartbeat, Watchdog


def per_batch_ns(number: int, repeats: int) -> tuple[float, float]:
    """Median ns per call of the watchdog's batch-end hook and of an empty hook."""
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, enable_checkpointing=False)
    watchdog, empty = Watchdog(timeout=180.0), Callback()
    watchdog.heartbeat = Heartbeat(lambda: dist.HashStore(), world_size=2, rank=0, timeout=180.0)  # not started
    timings = {}
    for name, hook in (("watchdog", watchdog.on_train_batch_end), ("empty", empty.on_train_batch_end)):
        runs = timeit.repeat(lambda: hook(trainer, None, None, None, 0), number=number, repeat=repeats)
        timings[name] = statistics.median(runs) / number * 1e9
    return timings["watchdog"], timings["empty"]


def per_beat_ms(world_size: int, beats: int) -> float:
    """Median ms of one beat (publish + read every rank) over a localhost TCPStore with ``world_size`` keys."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    client = dist.PrefixStore("bench/", dist.TCPStore("127.0.0.1", server.port, is_master=False,
                                                      wait_for_workers=False, timeout=timedelta(seconds=30)))
    for rank in range(1, world_size):
        client.set(str(rank), Beat(1, 10).encode())
    heartbeat = Heartbeat(lambda: client, world_size=world_size, rank=0, timeout=180.0)
    heartbeat.exchange()  # connects; not timed
    times = []
    for _ in range(beats):
        start = time.perf_counter()
        assert heartbeat.exchange() is not None
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=100_000, help="hook calls per timed run")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--beats", type=int, default=200, help="beats timed per world size")
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 8, 64, 512])
    args = parser.parse_args()
    watchdog_ns, empty_ns = per_batch_ns(args.number, args.repeats)
    print(f"per batch: watchdog hook {watchdog_ns:.0f} ns, empty hook {empty_ns:.0f} ns,"
          f" added {watchdog_ns - empty_ns:.0f} ns per batch")
    for world_size in args.world_sizes:
        beat_ms = per_beat_ms(world_size, args.beats)
        share = beat_ms / (BEAT_INTERVAL_S * 1e3) * 100
        print(f"per beat, world size {world_size:4d}: {beat_ms:.3f} ms (publish + read all): the thread busy"
              f" {share:.4f} % of the time at one beat per {BEAT_INTERVAL_S:g} s")


if __name__ == "__main__":
    main()
