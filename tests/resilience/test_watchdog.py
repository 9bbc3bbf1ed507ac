"""The stuck-rank watchdog (``lightning_hybrid/resilience/watchdog.py``): the decision on a fake clock, the beating
threads over an in-process store, and one 2-rank fit in which rank 1 is SIGSTOPped while a checkpoint is written."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from lightning_hybrid.checkpoint.export import load_module_state
from lightning_hybrid.options.hybrid_options import HybridOptions
from lightning_hybrid.resilience.watchdog import (
    EXIT_CODE,
    FIRST_BATCH_ALLOWANCE,
    SETUP_PHASE,
    Beat,
    VERDICT_KEY,
    Heartbeat,
    StallDetector,
    Watchdog,
    announcement,
    describe,
)
from tests.conftest import CHECKPOINTED_LAYERS
from tests.helpers import free_port, start_ranks

TIMEOUT = 5.0


def _beats(*beats: Beat) -> dict[int, Beat]:
    return dict(enumerate(beats))


def test_a_rank_whose_heartbeat_stops_is_named_once_the_bound_has_passed() -> None:
    detector = StallDetector(world_size=3, rank=0, timeout=TIMEOUT, now=0.0)
    assert detector.observe(1.0, _beats(Beat(1, 3), Beat(1, 3), Beat(1, 3))) is None
    # Rank 2 keeps beating; rank 1's last beat was seen at t=1.
    assert detector.observe(5.9, _beats(Beat(5, 4), Beat(1, 3), Beat(5, 4))) is None
    verdict = detector.observe(6.1, _beats(Beat(6, 4), Beat(1, 3), Beat(6, 4)))
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("silent", (1,))
    assert verdict.seconds == pytest.approx((5.1,)) and verdict.beats == (Beat(1, 3),)


def test_a_rank_never_seen_gets_the_startup_allowance_and_a_finished_one_is_not_named() -> None:
    detector = StallDetector(world_size=3, rank=0, timeout=TIMEOUT, now=0.0)
    starting = {0: Beat(1), 1: None, 2: Beat(1)}
    assert detector.observe(TIMEOUT + 1, starting) is None
    verdict = detector.observe(TIMEOUT * FIRST_BATCH_ALLOWANCE + 1, {**starting, 2: Beat(2, done=True)})
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("silent", (1,))  # rank 2 left: not named


def test_a_stall_names_the_rank_behind_after_the_first_batch_allowance() -> None:
    detector = StallDetector(world_size=2, rank=0, timeout=TIMEOUT, now=0.0)
    # Both beat, neither finishes a batch: the first batch may take FIRST_BATCH_ALLOWANCE times the bound.
    for second in range(1, int(TIMEOUT * FIRST_BATCH_ALLOWANCE)):
        assert detector.observe(second, _beats(Beat(second), Beat(second))) is None, second
    verdict = detector.observe(TIMEOUT * FIRST_BATCH_ALLOWANCE + 1.1, _beats(Beat(99), Beat(99)))  # first seen at 1
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("stalled", (0, 1))  # none is behind
    assert describe(verdict, TIMEOUT).startswith("no rank finished a batch, and none is behind")
    # After the first batch, the plain bound; rank 1 finished one batch fewer (stuck in the next).
    detector = StallDetector(world_size=2, rank=0, timeout=TIMEOUT, now=0.0)
    ahead, behind = Beat(1, 8, "train", 4, warming=False), Beat(1, 7, "train", 3, warming=False)
    assert detector.observe(1.0, _beats(ahead, behind)) is None
    assert detector.observe(1.0 + TIMEOUT, _beats(Beat(2, 8, warming=False), Beat(2, 7, warming=False))) is None
    verdict = detector.observe(1.1 + TIMEOUT, _beats(Beat(3, 8, warming=False), Beat(3, 7, warming=False)))
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("behind", (1,))
    assert "rank(s) 1 fell behind" in describe(verdict, TIMEOUT)


def test_during_setup_only_liveness_is_bounded_and_the_progress_bound_starts_with_the_loops() -> None:
    """Setting up (tracing, parallelizing, loading weights) may take long: no stall verdict while a rank is in it,
    but a rank that stops beating is named; the loop's first-batch allowance counts from when setup ended."""
    setup = FIRST_BATCH_ALLOWANCE * TIMEOUT * 3
    detector = StallDetector(world_size=2, rank=0, timeout=TIMEOUT, now=0.0)
    for second in range(1, int(setup)):
        assert detector.observe(second, _beats(Beat(second, phase=SETUP_PHASE), Beat(second))) is None, second
    started = _beats(Beat(int(setup)), Beat(int(setup)))
    assert detector.observe(setup, started) is None  # both left setup at once: the allowance starts now
    assert detector.observe(setup + TIMEOUT * FIRST_BATCH_ALLOWANCE - 1, started) is not None  # beats stopped
    detector = StallDetector(world_size=2, rank=0, timeout=TIMEOUT, now=0.0)
    for second in range(1, int(setup)):
        beats = _beats(Beat(second, phase=SETUP_PHASE), Beat(second, phase=SETUP_PHASE))
        assert detector.observe(second, beats) is None, second
    beats = _beats(Beat(int(setup) + 1), Beat(int(setup) + 1))
    assert detector.observe(setup + 1, beats) is None
    for second in range(int(setup) + 2, int(setup + TIMEOUT * FIRST_BATCH_ALLOWANCE)):
        assert detector.observe(second, _beats(Beat(second), Beat(second))) is None, second
    verdict = detector.observe(setup + TIMEOUT * FIRST_BATCH_ALLOWANCE + 1.5, _beats(Beat(999), Beat(999)))
    assert verdict is not None and verdict.kind == "stalled"
    # Frozen in setup: no beats, named as silent after the bound.
    detector = StallDetector(world_size=2, rank=0, timeout=TIMEOUT, now=0.0)
    assert detector.observe(1.0, _beats(Beat(1, phase=SETUP_PHASE), Beat(1, phase=SETUP_PHASE))) is None
    verdict = detector.observe(2.0 + TIMEOUT, _beats(Beat(9, phase=SETUP_PHASE), Beat(1, phase=SETUP_PHASE)))
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("silent", (1,))


def test_a_store_that_stops_answering_names_its_host_rank_0() -> None:
    detector = StallDetector(world_size=2, rank=1, timeout=TIMEOUT, now=0.0)
    assert detector.observe(1.0, _beats(Beat(1), Beat(1))) is None
    assert detector.observe(1.0 + TIMEOUT, None) is None
    verdict = detector.observe(1.1 + TIMEOUT, None)
    assert verdict is not None and (verdict.kind, verdict.ranks) == ("store", (0,))


def test_the_message_names_the_ranks_the_bound_and_how_to_change_it() -> None:
    detector = StallDetector(world_size=4, rank=0, timeout=TIMEOUT, now=0.0)
    detector.observe(0.0, _beats(*[Beat(1, 10, "validation", 6, warming=False)] * 4))
    verdict = detector.observe(7.0, _beats(Beat(8, 12), Beat(1, 10, "validation", 6), Beat(8, 12), Beat(1, 10)))
    message = announcement(0, describe(verdict, TIMEOUT), found_by=0)
    assert message.startswith("[lightning-hybrid watchdog] rank 0: rank(s) 1, 3 stopped sending heartbeats")
    assert "rank 1: 7.0 s, last reported validation batch end at step 6 (10 batches)" in message
    assert f"The bound is 5 s ({FIRST_BATCH_ALLOWANCE}x" in message and f"exit code {EXIT_CODE}" in message
    assert "HybridStrategy(watchdog_timeout=SECONDS)" in message and "watchdog_timeout=None" in message
    assert Beat.decode(Beat(3, 10, "validation", 6, False, True).encode()) == Beat(3, 10, "validation", 6, False, True)


def _heartbeats(store: dist.Store, timeout: float) -> tuple[list[Heartbeat], list[str]]:
    messages: list[str] = []
    heartbeats = [Heartbeat(lambda: store, world_size=2, rank=rank, timeout=timeout, on_verdict=messages.append)
                  for rank in range(2)]
    for heartbeat in heartbeats:
        heartbeat.start()
    return heartbeats, messages


def test_beating_threads_name_a_rank_that_stops_and_not_one_that_finishes() -> None:
    """Two ranks' threads over one in-process store: rank 1 stops without saying it is done (as a frozen process
    does), and rank 0 names it within the bound and a beat."""
    heartbeats, messages = _heartbeats(dist.PrefixStore("frozen/", dist.HashStore()), timeout=0.5)
    time.sleep(0.3)
    stopped = time.monotonic()
    heartbeats[1].stop(done=False)
    while not messages and time.monotonic() - stopped < 5:
        heartbeats[0].progressed("train", step=1)  # rank 0 keeps training: only the silence is due
        time.sleep(0.01)
    assert time.monotonic() - stopped < 0.5 + 2 * heartbeats[0].interval + 0.2
    heartbeats[0].stop(done=True)
    assert len(messages) == 1 and "rank(s) 1 stopped sending heartbeats" in messages[0]
    # A rank that leaves its loop first says so and is not named while the other goes on.
    heartbeats, messages = _heartbeats(dist.PrefixStore("finished/", dist.HashStore()), timeout=0.5)
    time.sleep(0.2)
    heartbeats[1].stop(done=True)
    for _ in range(100):
        heartbeats[0].progressed("train", step=1)
        time.sleep(0.01)
    heartbeats[0].stop(done=True)
    assert messages == []


def test_every_rank_ends_with_the_verdict_the_first_one_announced() -> None:
    """Rank 0 may host the store and end first: the others read its verdict instead of a closed connection."""
    store = dist.PrefixStore("announced/", dist.HashStore())
    store.set(VERDICT_KEY, "1|rank(s) 2 stopped sending heartbeats")
    heartbeats, messages = _heartbeats(store, timeout=60.0)  # nothing is due by itself
    deadline = time.monotonic() + 5
    while len(messages) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    for heartbeat in heartbeats:
        heartbeat.stop(done=True)
    assert sorted(messages) == ["[lightning-hybrid watchdog] rank 0 (as rank 1 found): rank(s) 2 stopped sending"
                                " heartbeats", "[lightning-hybrid watchdog] rank 1: rank(s) 2 stopped sending heartbeats"]


def test_a_restarted_attempt_does_not_end_on_the_verdict_of_the_failed_one(monkeypatch) -> None:
    """torchrun keeps its rendezvous store across restarts: the restarted processes (a fresh count of watched
    calls) must not read the verdict the failed attempt left there, or every restart would end at once."""
    import lightning_hybrid.resilience.watchdog as watchdog_module

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    environment = SimpleNamespace(main_address="127.0.0.1", main_port=port)
    trainer = SimpleNamespace(world_size=2, global_rank=0, strategy=SimpleNamespace(cluster_environment=environment))
    ended: dict[str, list[str]] = {"0": [], "1": []}
    for attempt, watch_s in (("0", 0.5 * FIRST_BATCH_ALLOWANCE + 1.5), ("1", 1.0)):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        monkeypatch.setattr(watchdog_module, "_watched_calls", itertools.count())  # a new process counts anew
        monkeypatch.setattr(watchdog_module, "end_process", lambda message, linger_s: ended[attempt].append(message))
        watchdog = Watchdog(timeout=0.5)
        watchdog.on_fit_start(trainer, None)  # rank 1 of this fake job never beats
        time.sleep(watch_s)
        watchdog.teardown(trainer, None, "fit")
    assert len(ended["0"]) == 1 and "rank(s) 1 stopped sending heartbeats" in ended["0"][0]
    assert ended["1"] == []  # within its startup allowance, and the old verdict is not its own
    del server


def test_the_option_is_validated_and_off_means_no_watchdog() -> None:
    assert HybridOptions().watchdog_timeout == 180.0
    assert HybridOptions(watchdog_timeout=30).watchdog_timeout == 30.0
    assert HybridOptions(watchdog_timeout=0).watchdog_timeout is None
    assert HybridOptions(watchdog_timeout=None).watchdog_timeout is None
    for wrong in (-1, True, "3 minutes", float("nan")):
        with pytest.raises(ValueError, match=r"HybridStrategy\(watchdog_timeout=.*\) is invalid: watchdog_timeout"
                                             r" must be a positive number of seconds.*or None / 0 to turn"):
            HybridOptions(watchdog_timeout=wrong)
    single_process = SimpleNamespace(world_size=1, global_step=0)
    watchdog = Watchdog(timeout=TIMEOUT)
    watchdog.on_fit_start(single_process, None)  # type: ignore[arg-type]
    watchdog.on_train_batch_end(single_process)  # type: ignore[arg-type]
    assert watchdog.heartbeat is None and not any(t.name.startswith("lightning-hybrid-watchdog")
                                                   for t in threading.enumerate())


# ------------------------------------------------------------------------------------------------ two ranks
@pytest.mark.slow
def test_a_rank_stopped_mid_save_is_named_and_the_job_ends_within_the_bound(tmp_path: Path) -> None:
    """Rank 1 SIGSTOPs itself when its third checkpoint save starts (step 8; steps 4 wrote ``epoch=0-step=4.ckpt``
    and ``last.ckpt``), while rank 0 writes its shard and then waits for rank 1's in the save's collective."""
    folder, out = tmp_path / "checkpoints", tmp_path / "stopped.pt"
    args = ["--model", "gpt", "--layers", CHECKPOINTED_LAYERS, "--dp", 2, "--devices", 2, "--steps", 10,
            "--checkpoint-dir", folder, "--stop", "1:save:3", "--strategy-kwargs", f'{{"watchdog_timeout": {TIMEOUT}}}',
            "--out", out]
    procs, logs = start_ranks([str(arg) for arg in args], out)
    try:
        procs[0].wait(timeout=240)
        exited = time.time()
    finally:
        for proc in procs:  # the stopped rank never exits by itself
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stopped_at = float(re.search(r"stop switch: SIGSTOP at ([\d.]+)", logs[1].read_text()).group(1))
    rank0 = logs[0].read_text()
    print(f"rank 0 exited {exited - stopped_at:.1f} s after rank 1 stopped (bound {TIMEOUT:g} s)")
    assert procs[0].returncode == EXIT_CODE, rank0[-3000:]
    assert exited - stopped_at < TIMEOUT + 10  # a beat interval, the exit and two shared cores' scheduling
    assert rank0.count("[lightning-hybrid watchdog]") == 1
    assert "[lightning-hybrid watchdog] rank 0: rank(s) 1 stopped sending heartbeats" in rank0
    # As of rank 1's last beat (one per second here), at most one second before it stopped at step 8: a step it had
    # reached by then. (Which one depends on how many of these tiny steps and saves fit in that second: 0 to 8 were
    # all seen on 2 shared cores.)
    found = re.search(r"rank 1: ([\d.]+) s, last reported (?:train|validation) batch end at step (\d+) \((\d+) batches",
                      rank0)
    seconds, step, batches = float(found[1]), int(found[2]), int(found[3])
    assert 0 <= step <= 8 and batches >= 1 and seconds >= TIMEOUT
    # The save in progress was never published; the earlier ones are complete and load.
    published = ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert sorted(p.name for p in folder.iterdir()) == sorted([*published, "epoch=1-step=8.ckpt.partial"])
    assert not (folder / "epoch=1-step=8.ckpt.partial" / "meta.pt").exists()
    first, last = (load_module_state(folder / name) for name in published)
    assert first.keys() == last.keys() and len(first) > 0
    assert all(torch.equal(first[name], last[name]) for name in first)  # both written at step 4
