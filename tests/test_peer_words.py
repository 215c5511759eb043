"""The ranks' words on a checkpoint (:mod:`dtrain.fault.peer_words`), gathered through a real
store hosted in this process, the ranks played by threads (as in test_sealed_store.py): each
rank other than the collector touches a fixed handful of keys whatever the world size, and the
collector reads each word once -- O(W) store calls in all, where every rank reading every other
rank's word cost about 2W². A rank that never speaks is named on every rank."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any

import pytest

from dtrain.dist.runtime import NAMESPACE_ENV
from dtrain.dist.stores import host_store
from dtrain.fault.peer_failure import PeerFailure
from dtrain.fault.peer_words import PeerWords
from dtrain.fault.watchdog import Watchdog


@pytest.fixture
def job_store(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Restart mode's job store: the ranks' watchdogs reach it at MASTER_ADDR."""
    store = host_store("127.0.0.1", 0, 10.0)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # keys under dtrain/
    monkeypatch.delenv(NAMESPACE_ENV, raising=False)
    return store


class Recorder:
    """A store client that counts the keys each call touches."""

    def __init__(self, store: Any) -> None:
        self._store, self.touched = store, Counter[str]()

    def __getattr__(self, name: str) -> Any:
        call = getattr(self._store, name)

        def counted(keys: Any, *args: Any) -> Any:
            self.touched.update([keys] if isinstance(keys, str) else keys)
            return call(keys, *args)

        return counted


def gather_all(dogs: list[Watchdog], words: list[str]) -> list[Any]:
    """Each rank's gathering (its words, or the error it raised), the ranks as threads."""
    out: list[Any] = [None] * len(dogs)

    def rank(r: int) -> None:
        try:
            out[r] = PeerWords(dogs[r]).gather("resume", words[r], "the check")
        except PeerFailure as exc:
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(dogs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return out


def test_each_rank_touches_a_handful_of_keys_and_the_collector_reads_each_word_once(
    job_store: Any,
) -> None:
    world = 12
    dogs = [Watchdog(r, world, heartbeat_s=1.0, timeout_s=30.0) for r in range(world)]
    recorders = []
    for dog in dogs:
        assert dog.store is not None
        recorders.append(Recorder(dog.store.client))
        dog.store._client = recorders[-1]
    words = [f"word {r}" if r % 5 else "" for r in range(world)]
    assert gather_all(dogs, words) == [words] * world
    prefix = "dtrain/words/resume/"
    for r in range(1, world):
        keys = set(recorders[r].touched)
        assert keys <= {f"{prefix}{r}", f"{prefix}posted", f"{prefix}verdict"} | {
            k for k in keys if k.startswith("dtrain/watchdog/")
        }, (r, keys)
        assert not {k for k in keys if k.startswith("dtrain/watchdog/hb/")} - {
            "dtrain/watchdog/hb/0"
        }, (r, keys)  # a waiting rank watches the collector only
    read = recorders[0].touched
    # check + multi_get of the words owed, once the count is full: each word read once
    assert [read[f"{prefix}{r}"] for r in range(1, world)] == [2] * (world - 1)


def test_a_rank_that_never_speaks_is_named_on_every_rank(job_store: Any) -> None:
    world = 3
    dogs = [Watchdog(r, world, heartbeat_s=0.5, timeout_s=1.0) for r in range(world - 1)]
    out = gather_all(dogs, ["", ""])  # rank 2 never starts: it never checks in, never speaks
    assert all(isinstance(e, PeerFailure) for e in out), out
    for r, error in enumerate(out):
        assert f"rank {r} " in str(error)
        assert "rank 2 never checked in" in str(error), error
