"""The diagnosis after a failed collective at many ranks: ranks as threads of this process, each
a real :class:`~dtrain.fault.watchdog.Watchdog` with its own connection to a real TCPStore, on
made-up machines of 8 ranks. Every rank names the rank at fault, and what each reads of the
store does not grow with the world size (it read every rank's beat, every round: W² in all)."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pytest

from dtrain.dist import sealed_store
from dtrain.dist.store_link import job_store_link
from dtrain.fault.watchdog import Watchdog
from tests.test_peer_words import job_store  # noqa: F401  (restart mode's store, a fixture)

PER_MACHINE = 8
AT_FAULT = 13  # machine 1, its sixth rank: watched by rank 12 (its machine) and rank 5 (machine 0)
WATCHERS = (12, 5)


class Sleeps:
    """The diagnosis's clock: real, but its sleeps counted and skipped (a rank that names the
    rank at fault at its first reading never sleeps)."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        with self.lock:
            self.count += 1


@dataclass
class Counted:
    """A rank's store client with its calls counted: calls, keys named, bytes read back."""

    client: Any
    calls: int = 0
    keys: int = 0
    read: int = 0
    stall: threading.Event | None = None  # set: the first call waits for it (a busy store)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.client, name)

        def counted(*args: Any) -> Any:
            with self.lock:
                self.calls += 1
                stall, self.stall = self.stall, None
            if args and isinstance(args[0], list):
                self.keys += len(args[0])
            elif name in ("get", "set", "append", "add"):
                self.keys += 1
            if stall is not None:
                stall.wait()
            value = method(*args)
            if isinstance(value, bytes):
                self.read += len(value)
            elif isinstance(value, list):
                self.read += sum(len(v) for v in value)
            return value

        return counted


def beat(rank: int, pid: int, age: float) -> str:
    alive = time.time() - age
    return json.dumps(
        {
            "rank": rank,
            "host": f"m{rank // PER_MACHINE}",
            "pid": pid,
            "attempt": 0,
            "world_size": 64,
            "step": 7,
            "phase": "forward_backward",
            "phase_since": alive,
            "progress": 0,
            "progress_at": alive,
            "alive_at": alive,
        }
    )


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def diagnose_all(
    world: int, at_fault_pid: int, age: float, monkeypatch: pytest.MonkeyPatch
) -> tuple[dict[int, str], dict[int, Counted], int]:
    """Every rank's diagnosis of ``AT_FAULT`` (its beat ``age`` s old, its process
    ``at_fault_pid``): its watchers first, then every other rank at once, one of them (rank
    2) finding the store busy at its first call. Each rank's words, counts, and the sleeps."""
    sleeps = Sleeps()
    monkeypatch.setattr("dtrain.fault.diagnosis.time", sleeps)
    # One connection to the store, shared by every rank's link (each new connection costs a
    # reverse DNS lookup on the store's one thread, seconds where the resolver drops one:
    # benchmarks/store_accept.py); each rank's calls on it are counted apart.
    link = job_store_link(5.0, 5.0)
    assert link is not None
    monkeypatch.setattr("dtrain.fault.watchdog.dog.job_store_link", lambda *_: copy.copy(link))
    dogs: dict[int, Watchdog] = {}
    counts: dict[int, Counted] = {}
    for rank in range(world):
        if rank == AT_FAULT:
            continue
        dog = Watchdog(rank, world, heartbeat_s=1.0, timeout_s=5.0)
        dog.host, dog.local_size = f"m{rank // PER_MACHINE}", PER_MACHINE
        dog.local_rank = rank % PER_MACHINE
        assert dog.store is not None
        counts[rank] = dog.store._client = Counted(link.client)
        dogs[rank] = dog
    for rank in range(world):
        pid = at_fault_pid if rank == AT_FAULT else os.getpid()
        key = f"dtrain/watchdog/hb/{rank}"
        sealed_store.put(link.client, key, beat(rank, pid, age if rank == AT_FAULT else 0.2))
    released = threading.Event()
    counts[2].stall = released
    words: dict[int, str] = {}
    for rank in WATCHERS:
        words[rank] = dogs[rank].diagnose()
    assert sleeps.count == 0  # each named it at its first reading
    rest = [rank for rank in dogs if rank not in WATCHERS]
    try:
        with ThreadPoolExecutor(max_workers=len(rest)) as pool:
            for rank, said in zip(rest, pool.map(lambda r: dogs[r].diagnose(), rest), strict=True):
                words[rank] = said
    finally:
        released.set()
    return words, counts, sleeps.count


def per_rank(counts: dict[int, Counted]) -> tuple[int, int, int]:
    """The most calls, keys and bytes any rank but the stalled one (rank 2) made or read."""
    steady = [c for rank, c in counts.items() if rank != 2]
    return (
        max(c.calls for c in steady),
        max(c.keys for c in steady),
        max(c.read for c in steady),
    )


@pytest.mark.usefixtures("job_store")
def test_a_killed_rank_is_named_by_every_rank_with_reads_that_do_not_grow_with_w(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pid = dead_pid()
    link = job_store_link(5.0, 5.0)
    assert link is not None
    seen: dict[int, tuple[int, int, int]] = {}
    for world in (16, 64):
        for key in ("dtrain/watchdog/failed", f"dtrain/watchdog/failed/{AT_FAULT}"):
            link.client.delete_key(key)
        words, counts, sleeps = diagnose_all(world, pid, 0.5, monkeypatch)
        # Rank 12 shares its machine: it sees the process gone and posts it; every other rank,
        # rank 5 (which watches it across machines, its beat still fresh) included, names
        # it from that post at its first reading. Rank 2's first read timed out (a busy
        # store): read again half a second later, it names the killed rank, not rank 0.
        gone = f"rank {AT_FAULT} (m1, pid {pid}) died: its process is gone (killed or crashed)"
        assert words[12].startswith(gone), words[12]
        for rank, said in words.items():
            # Its machine's ranks see its process themselves; the others name it by the post.
            by = "" if rank // PER_MACHINE == 1 else " (seen by rank 12 on its machine)"
            assert said.startswith(gone) and said.endswith(f"forward_backward{by}"), said
            assert said.count("rank ") == 1 + bool(by), said  # the rank at fault, nobody else
        assert sleeps == 1, sleeps  # rank 2's, after its read timed out
        seen[world] = per_rank(counts)
    # The same few calls and keys per rank at 16 and at 64 ranks (the index and the records
    # it lists, the two watched beats): it was all W beats per rank, every half second.
    assert seen[16][:2] == seen[64][:2], seen
    assert seen[64][1] <= 12 and seen[64][2] < 1600, seen


@pytest.mark.usefixtures("job_store")
def test_a_stopped_rank_is_named_by_its_watchers_and_from_their_word_by_every_other(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Alive (this process's pid) but silent for 10 s: stopped, as by SIGSTOP.
    words, counts, sleeps = diagnose_all(64, os.getpid(), 10.0, monkeypatch)
    stopped = rf"rank {AT_FAULT} \(m1, pid {os.getpid()}\) stopped responding: its last heartbeat, "
    old = r"(\d+\.\d)s old, was at step 7 in forward_backward"
    for rank, said in words.items():
        # Rank 12 (its machine's) found it and posted it first; its machine's ranks look at
        # its record themselves; the others, rank 5 (its watcher across machines) among
        # them, name it from rank 12's word.
        by = "" if rank // PER_MACHINE == 1 else r" \(seen by rank 12\)"
        assert re.fullmatch(stopped + old + by, said), said
    assert sleeps == 1
    calls, keys, read = per_rank(counts)
    assert keys <= 12 and read < 1600, (calls, keys, read)
