"""A rank that stops making progress is named, and the job ended, within a bounded time (:class:`Watchdog`).

A rank that dies closes its sockets and the others fail at once; a rank that hangs (a frozen host, a SIGSTOPped
process, a kernel that never returns) keeps them waiting in a collective until the process-group timeout (30
minutes by default), and nothing says which rank it was. The watchdog keeps a heartbeat per rank outside the
training collectives: a daemon thread publishes this rank's beat every few seconds to the job's rendezvous store
(the c10d ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT``, through a client of its own) and reads every rank's.

* A rank whose beat stopped for longer than the bound (``HybridStrategy(watchdog_timeout=...)``, default
  180 s) is **silent**: its process is frozen or its host gone.
* When every rank still beats but none has finished a batch for longer than the bound, the job is **stalled**
  (a rank stuck in a kernel, the others waiting for it in a collective); the ranks with the fewest finished
  batches are named, or all of them when none is behind.
* A store that does not answer for longer than the bound names its host, global rank 0 under Lightning's
  launcher.

Every rank that sees it prints one message to stderr and exits with :data:`EXIT_CODE`; a checkpoint being written
at that moment stays under its ``.partial`` name (see :mod:`lightning_hybrid.glue.checkpoint_io`). Progress
is any batch end (training, validation, test, predict): all the training thread does is count it. Until a rank
has finished the first batch of a loop or epoch, or after it started saving a checkpoint, the progress bound is
:data:`FIRST_BATCH_ALLOWANCE` times longer (compilation, shape inference, writing); liveness is bounded alike
from the start, since the beating thread does not wait for training. During the strategy's setup (tracing the
first step, parallelizing, loading weights: its length depends on the model and the disk) only liveness is
watched; the progress bound starts when the loops do.

Example::

    trainer = Trainer(..., strategy=HybridStrategy(tp=2, watchdog_timeout=300))   # the strategy adds it
    trainer = Trainer(..., strategy=HybridStrategy(tp=2, watchdog_timeout=None))  # off
"""

from __future__ import annotations

import itertools
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

#: The exit status of a rank the watchdog ends (EX_TEMPFAIL: the job may be retried once the rank is replaced).
EXIT_CODE = 75
#: How many times the bound a rank may take for its first batch of a loop or epoch, or a checkpoint save.
FIRST_BATCH_ALLOWANCE = 5
#: Seconds between beats at most; shorter bounds beat five times per bound.
BEAT_INTERVAL_S = 5.0
#: Where the beats live in the store; one namespace per torchrun attempt and watched trainer call (fit, validate,
#: test, predict).
KEY_PREFIX = "lightning_hybrid/watchdog"
#: The phase of a rank whose strategy is still setting up (liveness watched, progress not yet).
SETUP_PHASE = "setup"
#: The key under which the first rank to reach a verdict announces it (``"<rank>|<message>"``).
VERDICT_KEY = "verdict"
_watched_calls = itertools.count()  # every rank makes the same trainer calls in the same order


@dataclass(frozen=True)
class Beat:
    """What one rank publishes: its beat counter, finished batches, the loop and step of the last one, and whether
    it is in a first batch or a save (``warming``) or finished watching (``done``)."""

    beats: int = 0
    batches: int = 0
    phase: str = "start"
    step: int = 0
    warming: bool = True
    done: bool = False

    def encode(self) -> str:
        return f"{self.beats},{self.batches},{self.phase},{self.step},{int(self.warming)},{int(self.done)}"

    @staticmethod
    def decode(text: str) -> "Beat":
        beats, batches, phase, step, warming, done = text.split(",")
        return Beat(int(beats), int(batches), phase, int(step), warming == "1", done == "1")


@dataclass(frozen=True)
class Verdict:
    """Why the watchdog ends the job, ``kind``: ``"silent"`` (no beat), ``"behind"`` (fewest batches, none
    finished since), ``"stalled"`` (no batch finished, none behind) or ``"store"`` (no answer); ``ranks`` are the
    ones named, each with the seconds since its last beat or progress and its last beat's contents."""

    kind: str
    ranks: tuple[int, ...]
    seconds: tuple[float, ...]
    beats: tuple[Optional[Beat], ...]


class StallDetector:
    """The watchdog's decision from the beats it read, with no threads or store: :meth:`observe` is called with
    each reading (``None`` when the store did not answer) and the time, and returns a :class:`Verdict` once one
    is due. Ages are measured on this rank's clock from when a value changed, so hosts' clocks need not agree.

    Example::

        detector = StallDetector(world_size=2, rank=0, timeout=5.0, now=0.0)
        detector.observe(1.0, {0: Beat(beats=1), 1: Beat(beats=1)})   # None: both beat
        detector.observe(7.0, {0: Beat(beats=7), 1: Beat(beats=1)})   # Verdict("silent", ranks=(1,), ...)
    """

    def __init__(self, world_size: int, rank: int, timeout: float, now: float) -> None:
        self.rank, self.timeout = rank, timeout
        self.latest: list[Optional[Beat]] = [None] * world_size
        self.beat_at = [now] * world_size
        self.progress_at = [now] * world_size
        self.answered_at = now

    def observe(self, now: float, beats: Optional[dict[int, Optional[Beat]]]) -> Optional[Verdict]:
        if beats is None:
            waited = now - self.answered_at
            return Verdict("store", (0,), (waited,), (self.latest[0],)) if waited > self.timeout else None
        self.answered_at = now
        for rank, beat in beats.items():
            if beat is None:
                continue
            seen = self.latest[rank]
            if seen is None or beat.beats != seen.beats:
                self.beat_at[rank] = now
            left_setup = seen is not None and seen.phase == SETUP_PHASE != beat.phase
            if seen is None or beat.batches != seen.batches or left_setup:
                self.progress_at[rank] = now
            self.latest[rank] = beat
        return self._silent(now) or self._stalled(now)

    def _watched(self) -> list[int]:
        return [rank for rank, beat in enumerate(self.latest) if beat is None or not beat.done]

    def _silent(self, now: float) -> Optional[Verdict]:
        def allowed(rank: int) -> float:  # a rank not yet seen may still be starting
            return self.timeout if self.latest[rank] is not None else self.timeout * FIRST_BATCH_ALLOWANCE

        silent = [r for r in self._watched() if r != self.rank and now - self.beat_at[r] > allowed(r)]
        return self._verdict("silent", silent, self.beat_at, now) if silent else None

    def _stalled(self, now: float) -> Optional[Verdict]:
        watched = self._watched()
        beats = [self.latest[rank] for rank in watched]
        if not watched or any(beat is None or beat.phase == SETUP_PHASE for beat in beats):
            return None
        warming = any(beat.warming for beat in beats)  # type: ignore[union-attr]
        bound = self.timeout * (FIRST_BATCH_ALLOWANCE if warming else 1)
        if any(now - self.progress_at[rank] <= bound for rank in watched):
            return None
        fewest = min(beat.batches for beat in beats)  # type: ignore[union-attr]
        behind = [rank for rank in watched if self.latest[rank].batches == fewest]  # type: ignore[union-attr]
        return self._verdict("stalled" if len(behind) == len(watched) else "behind", behind, self.progress_at, now)

    def _verdict(self, kind: str, ranks: Sequence[int], since: list[float], now: float) -> Verdict:
        return Verdict(kind, tuple(ranks), tuple(now - since[r] for r in ranks), tuple(self.latest[r] for r in ranks))


def describe(verdict: Verdict, timeout: float, store_address: str = "") -> str:
    """What a verdict means, with the bound and how to change it (the body of :func:`announcement`)."""
    def last(beat: Optional[Beat]) -> str:  # as of its last published beat, up to one beat interval old
        if beat is None or beat.batches == 0:
            return "no batch finished yet"
        return f"last reported {beat.phase} batch end at step {beat.step} ({beat.batches} batches)"

    named = "; ".join(f"rank {r}: {s:.1f} s, {last(b)}" for r, s, b in zip(verdict.ranks, verdict.seconds,
                                                                             verdict.beats))
    if verdict.kind == "silent":
        what = (f"rank(s) {_ranks(verdict.ranks)} stopped sending heartbeats (frozen or stopped process, lost"
                f" host) — seconds since the last heartbeat: {named}")
    elif verdict.kind == "store":
        what = (f"the rendezvous store {store_address} did not answer ({named}); it runs in global rank 0's"
                " process under Lightning's launcher, so rank 0 is frozen or gone")
    elif verdict.kind == "stalled":
        what = (f"no rank finished a batch, and none is behind — every rank still sends heartbeats, so one is"
                f" stuck inside a kernel or collective and the others wait for it: {named}")
    else:
        what = (f"rank(s) {_ranks(verdict.ranks)} fell behind and no rank finished a batch since (still sending"
                f" heartbeats: stuck inside a kernel or collective) — seconds since their last progress: {named}")
    return (f"{what}. The bound is {timeout:g} s"
            f" ({FIRST_BATCH_ALLOWANCE}x for a first batch or a checkpoint save). Ending this rank with exit code"
            f" {EXIT_CODE}; a checkpoint being written stays under its .partial name. Change the bound with"
            " HybridStrategy(watchdog_timeout=SECONDS), or turn the watchdog off with watchdog_timeout=None.")


def announcement(rank: int, body: str, found_by: int) -> str:
    """The one line rank ``rank`` prints before it ends: ``body`` as rank ``found_by`` described it."""
    who = f"rank {rank}" if found_by == rank else f"rank {rank} (as rank {found_by} found)"
    return f"[lightning-hybrid watchdog] {who}: {body}"


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def end_process(message: str, linger_s: float) -> None:
    """Print ``message`` and end this process after ``linger_s`` seconds, in which the other ranks read the
    announced verdict (the store may live in this process) instead of failing on its closed connections first.
    The main thread is blocked inside a collective's C++ wait, where neither an exception raised in this thread nor
    a signal handled in Python reaches it; ``os._exit`` ends the process from here (no cleanup runs: a checkpoint
    folder being written is never renamed)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    time.sleep(linger_s)
    os._exit(EXIT_CODE)


class Heartbeat:
    """One rank's heartbeat: :meth:`progressed` is all the training thread does per batch (a counter and two
    attributes set); a daemon thread publishes this rank's :class:`Beat` every ``interval`` seconds, reads
    every rank's and, once a verdict is due here or announced by another rank, hands the message to
    ``on_verdict`` (default: :func:`end_process`, lingering two beat intervals).

    Example::

        heartbeat = Heartbeat(lambda: dist.PrefixStore("w/", store), world_size=2, rank=0, timeout=180.0)
        heartbeat.start(); ...; heartbeat.progressed("train", step=1); ...; heartbeat.stop(done=True)
    """

    def __init__(self, connect: Callable[[], dist.Store], world_size: int, rank: int, timeout: float, *,
                 store_address: str = "", on_verdict: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.connect, self.world_size, self.rank, self.timeout = connect, world_size, rank, timeout
        self.store_address, self.clock = store_address, clock
        self.interval = min(BEAT_INTERVAL_S, timeout / 5)
        self.on_verdict = on_verdict or (lambda message: end_process(message, linger_s=2 * self.interval))
        #: ``(rank, body)`` of a verdict another rank announced, once read.
        self.announced: Optional[tuple[int, str]] = None
        self.batches, self.phase, self.step, self.warming = 0, SETUP_PHASE, 0, True
        self.beats = 0
        self.detector = StallDetector(world_size, rank, timeout, now=clock())
        self._store: Optional[dist.Store] = None
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"lightning-hybrid-watchdog-{rank}", daemon=True)

    def progressed(self, phase: str, step: int) -> None:
        """A batch ended on this rank (called by the training thread)."""
        self.batches += 1
        self.phase, self.step, self.warming = phase, step, False

    def beat(self, done: bool = False) -> Beat:
        return Beat(self.beats, self.batches, self.phase, self.step, self.warming, done)

    def start(self) -> None:
        self._thread.start()

    def stop(self, done: bool) -> None:
        """End the thread; ``done`` also tells the other ranks this one stopped watching (a rank that leaves a
        loop first is not named), unless the store is what stopped answering."""
        self._stopping.set()
        self._thread.join(timeout=self.interval + 1.0)
        if done and self._store is not None and not self._thread.is_alive():
            try:
                self._store.set(str(self.rank), self.beat(done=True).encode())
            except (RuntimeError, OSError):
                pass  # the store's host left first: nobody is left to read it

    def _run(self) -> None:
        while not self._stopping.is_set():
            verdict = self.detector.observe(self.clock(), self.exchange())
            if self._stopping.is_set():
                return
            if self.announced is None and verdict is not None:
                self.announced = (self.rank, describe(verdict, self.timeout, self.store_address))
                self._announce(*self.announced)
            if self.announced is not None:
                found_by, body = self.announced
                self.on_verdict(announcement(self.rank, body, found_by))
                return
            self._stopping.wait(self.interval)

    def _announce(self, rank: int, body: str) -> None:
        """Tell the other ranks, so that every rank ends with the message, not with a closed connection."""
        try:
            if self._store is not None:
                self._store.set(VERDICT_KEY, f"{rank}|{body}")
        except (RuntimeError, OSError):
            pass  # the store is what stopped answering: each rank finds that itself

    def exchange(self) -> Optional[dict[int, Optional[Beat]]]:
        """Publish this rank's beat and read every rank's; ``None`` when the store did not answer (its client
        gives up after the bound)."""
        try:
            if self._store is None:
                self._store = self.connect()
            self.beats += 1
            self._store.set(str(self.rank), self.beat().encode())
            beats = read_beats(self._store, self.world_size)
            if self._store.check([VERDICT_KEY]):
                found_by, body = self._store.get(VERDICT_KEY).decode().split("|", 1)
                self.announced = (int(found_by), body)
            return beats
        except (RuntimeError, OSError):  # torch's DistStoreError / DistNetworkError are RuntimeErrors
            return None


def read_beats(store: dist.Store, world_size: int) -> dict[int, Optional[Beat]]:
    """Every rank's last published beat (``None`` for a rank that has not published one yet). ``multi_get`` would
    wait for missing keys, so they are looked for first."""
    keys = [str(rank) for rank in range(world_size)]
    if store.check(keys):
        values: list[Optional[bytes]] = list(store.multi_get(keys))
    else:
        values = [store.get(key) if store.check([key]) else None for key in keys]
    return {rank: None if value is None else Beat.decode(value.decode()) for rank, value in enumerate(values)}


def store_client(host: str, port: int, prefix: str, timeout: float) -> dist.Store:
    """A client of the job's rendezvous ``TCPStore`` with keys under ``prefix``. A client of our own rather than
    the process group's store: its operations give up after ``timeout`` (the process group's wait up to its own
    timeout, 30 minutes by default), and the process group's store is reached only through a private torch name."""
    client = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    return dist.PrefixStore(prefix, client)


class Watchdog(Callback):
    """Ends every rank with one message naming the rank(s) that stopped making progress for longer than
    ``timeout`` seconds (see the module docstring). Watches a fit, validate, test or predict call from its
    setup hook to its teardown; not in a single-process run (no other rank to wait for).

    Example::

        trainer = Trainer(..., callbacks=[Watchdog(timeout=300.0)])   # HybridStrategy adds it itself
    """

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.heartbeat: Optional[Heartbeat] = None

    def watch(self, trainer: Trainer) -> None:
        """Start watching this trainer call's ranks, unless already watching (every hook that starts a call or
        a loop calls it)."""
        if self.heartbeat is None and trainer.world_size > 1:
            environment = trainer.strategy.cluster_environment  # type: ignore[attr-defined]
            host, port = environment.main_address, environment.main_port
            # torchrun's store outlives a failed attempt: each attempt keeps its beats (and verdict) apart.
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            prefix = f"{KEY_PREFIX}/{attempt}/{next(_watched_calls)}/"
            self.heartbeat = Heartbeat(lambda: store_client(host, port, prefix, self.timeout), trainer.world_size,
                                       trainer.global_rank, self.timeout, store_address=f"{host}:{port}")
            self.heartbeat.start()

    def _start_loop(self, trainer: Trainer, *_: Any) -> None:
        self.watch(trainer)  # a watchdog added after setup starts here
        if self.heartbeat is not None and self.heartbeat.phase == SETUP_PHASE:
            self.heartbeat.phase = "start"  # the progress bound applies from here
        self._warm()

    def _warm(self, *_: Any) -> None:
        if self.heartbeat is not None:
            self.heartbeat.warming = True  # the next batch may compile, infer shapes or follow a save

    def _stop(self, done: bool) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(done)
            self.heartbeat = None

    def _progressed(self, trainer: Trainer, phase: str) -> None:
        if self.heartbeat is not None:
            self.heartbeat.progressed(phase, trainer.global_step)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self.watch(trainer)  # before the strategy's setup: a rank frozen while it traces or loads is named

    on_fit_start = on_train_start = on_validation_start = on_test_start = on_predict_start = _start_loop
    on_train_epoch_start = _warm
    on_save_checkpoint = _warm

    def on_train_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self._progressed(trainer, "train")

    def on_validation_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self._progressed(trainer, "validation")

    def on_test_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self._progressed(trainer, "test")

    def on_predict_batch_end(self, trainer: Trainer, *_: Any) -> None:
        self._progressed(trainer, "predict")

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        self._stop(done=False)  # a failing rank that lingers is named: it may hold the others

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._stop(done=True)


def add_watchdog(trainer: Trainer, timeout: Optional[float]) -> None:
    """Add a :class:`Watchdog` with ``timeout`` to ``trainer`` unless it has one or ``timeout`` is ``None`` (off),
    and start it: called from the strategy's setup, after the callbacks' setup hooks, so that the rest of that setup
    is watched too."""
    if timeout is None:
        return
    watchdog = next((callback for callback in trainer.callbacks if isinstance(callback, Watchdog)), None)
    if watchdog is None:
        watchdog = Watchdog(timeout)
        trainer.callbacks.append(watchdog)
    watchdog.watch(trainer)
