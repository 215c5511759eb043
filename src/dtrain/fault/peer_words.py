"""Every rank's word (a short string) on every rank, where the ranks may take long to speak:
each hashes its share of a checkpoint before it can say whether the share is whole.

A collective would wait for the slowest rank under the collective timeout (``dist.timeout_s``),
so a large enough checkpoint would fail its own resume. Instead each rank posts its word to
the job's key-value store and counts itself on one counter; rank 0 (the collector) waits for
the count, reads the words in one call and posts them all as one verdict, which every other
rank waits for. So a gathering costs O(W) store calls in all and O(1) per rank other than the
collector (every rank reading every other rank's key cost about 2W² calls: minutes of store
time at thousands of ranks).

The wait lasts as long as the ranks still owed make progress: their liveness records (step,
phase, progress marks: :mod:`dtrain.fault.liveness`), which the watchdogs mirror into the
store, move. The collector watches every rank's record; one still owed that has not moved for
the collective timeout, or a posted failure, ends the gathering with a
:class:`~dtrain.fault.peer_failure.PeerFailure` naming it, posted as the verdict so that every
rank raises the same. The other ranks watch the collector's record (a few seconds longer, so
that a live collector names the rank at fault first) and the collector's posted failure.
Each rank marks its own progress when the record it watches moves, so that its own hang
backstop leaves it alone while it waits.

Without the store (a run without peers or without a store client) the words go through one
collective, under its timeout.

The words and the verdict are sealed with the job's secret (:mod:`dtrain.dist.sealed_store`):
one that fails its seal (a stranger's, who reached the store's port) counts as not posted yet
(one warning names its key). The counter is not sealed (a store counter cannot be): a
stranger who bumps it only makes the collector read early and find a word still missing.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any, NoReturn

from dtrain.comm.plain import all_gather_json
from dtrain.dist import sealed_store
from dtrain.dist.runtime import store_namespace
from dtrain.dist.store_link import StoreTimeout
from dtrain.fault.diagnosis import quick_read_s, stale_after_s
from dtrain.fault.liveness import Liveness
from dtrain.fault.peer_failure import PeerFailure
from dtrain.fault.watchdog import Watchdog

# Called at each look (about every second) with the latest beats of the ranks this rank
# watches (the collector: every rank not yet heard from; the others: the collector); raises to
# end the wait (a rank's beat shows it will never post its word).
BeatsWatch = Callable[[dict[int, Liveness | None]], None]

_POLL_S = (0.02, 0.25)  # the first and the longest pause between two looks at the store
_COLLECTOR = 0
# How much longer than the collective timeout the other ranks give the collector before they
# name it: a collector that is alive names the rank at fault (in its verdict) first.
_GRACE_S = 5.0
_VERDICT = {"words": [str]}
_FAILED = {"failed": str}


class PeerWords:
    """Gathers words through the job's store for one rank (see the module's doc)."""

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def tick(self) -> None:
        """A piece of this rank's own share is done (its progress mark)."""
        self.watchdog.tick()

    def gather(self, key: str, word: str, what: str, watch: BeatsWatch | None = None) -> list[str]:
        """Every rank's word posted under ``key`` (the same on every rank, new for each
        gathering), by rank. ``what``: what the ranks were doing, for the error that names a
        rank that stopped. ``watch``: given the watched ranks' beats at each look; what it
        raises ends the wait."""
        dog = self.watchdog
        if dog.world_size == 1:
            return [word]
        if dog.store is None:
            return [str(w) for w in all_gather_json(word)]
        prefix = f"{store_namespace()}words/{key}/"
        mine = f"{prefix}{dog.rank}"
        sealed = sealed_store.seal(mine, word.encode())
        self._ask(lambda s: (s.set(mine, sealed), s.add(f"{prefix}posted", 1)), what)
        if dog.rank == _COLLECTOR:
            return self._collect(prefix, word, what, watch)
        return self._await_verdict(prefix, what, watch)

    # -- the collector -------------------------------------------------------------------

    def _collect(
        self, prefix: str, word: str, what: str, watch_beats: BeatsWatch | None
    ) -> list[str]:
        dog = self.watchdog
        got = {dog.rank: word}
        others = [rank for rank in range(dog.world_size) if rank != dog.rank]
        watch = _Motion(dog, others, dog.timeout_s)
        counted, pause = 0, _POLL_S[0]
        while len(got) < dog.world_size:
            posted = int(self._ask(lambda s: s.add(f"{prefix}posted", 0), what))
            if posted >= dog.world_size and posted != counted:
                counted = posted  # read again only when the count moves (a stranger's bump)
                owed = [rank for rank in range(dog.world_size) if rank not in got]
                got.update(self._read_words(prefix, owed, what))
            if len(got) == dog.world_size:
                break
            if watch.due():
                self._watch_all(prefix, got, watch, what, watch_beats)
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_S[1])
        words = [got[rank] for rank in range(dog.world_size)]
        self._post_verdict(prefix, {"words": words}, what)
        return words

    def _read_words(self, prefix: str, ranks: list[int], what: str) -> dict[int, str]:
        """The words of ``ranks`` that are posted (and pass their seal): one call when all are."""
        keys = [f"{prefix}{rank}" for rank in ranks]
        raws = self._ask(lambda store: sealed_store.get_many(store, keys), what)
        words = {rank: sealed_store.text(k, raw) for rank, k, raw in zip(ranks, keys, raws)}
        return {rank: text for rank, text in words.items() if text is not None}

    def _watch_all(
        self,
        prefix: str,
        got: dict[int, str],
        watch: _Motion,
        what: str,
        watch_beats: BeatsWatch | None,
    ) -> None:
        """Fail, posting why, when a rank failed or a rank still owed has not moved for the
        collective timeout. Every rank's record is read in one call; which of the still ones
        are owed is read only then (the count says how many, not which)."""
        dog = self.watchdog
        quick = quick_read_s(dog.heartbeat_s)
        try:
            failed, beats = dog.failures(quick), dog.peers(quick)
        except Exception as exc:
            if self._busy(exc):
                return  # looked at again at the next look
            self._fail_all(prefix, what, exc)
        if watch_beats is not None:
            watch_beats({rank: beat for rank, beat in beats.items() if rank not in got})
        stopped = set(failed) | set(watch.see(beats))
        suspects = sorted(stopped - set(got))
        if suspects:  # a rank that failed or stood still after it spoke holds nothing up
            got.update(self._read_words(prefix, suspects, what))
            if any(rank not in got for rank in suspects):
                self._fail_all(prefix, what)

    def _post_verdict(self, prefix: str, verdict: dict[str, Any], what: str) -> None:
        name = f"{prefix}verdict"
        sealed = sealed_store.seal(name, json.dumps(verdict).encode())
        self._ask(lambda s: s.set(name, sealed), what)

    def _fail_all(self, prefix: str, what: str, error: BaseException | None = None) -> NoReturn:
        failure = self._failure(what, error)
        with contextlib.suppress(PeerFailure):  # the store failed: the others see it too
            self._post_verdict(prefix, {"failed": str(failure)}, what)
        raise failure

    # -- the others ----------------------------------------------------------------------

    def _await_verdict(self, prefix: str, what: str, watch_beats: BeatsWatch | None) -> list[str]:
        dog = self.watchdog
        name = f"{prefix}verdict"
        watch = _Motion(dog, [_COLLECTOR], dog.timeout_s + _GRACE_S)
        pause = _POLL_S[0]
        while True:
            raw = self._ask(lambda s: s.get(name) if s.check([name]) else None, what)
            verdict: Any = sealed_store.parse(name, raw, dict) if raw is not None else None
            if sealed_store.fits(verdict, _VERDICT) and len(verdict["words"]) == dog.world_size:
                return [str(w) for w in verdict["words"]]
            if sealed_store.fits(verdict, _FAILED):
                raise PeerFailure(f"rank {dog.rank} ({dog.host}): {verdict['failed']}")
            if watch.due():
                quick = quick_read_s(dog.heartbeat_s)
                try:
                    failed = _COLLECTOR in dog.failures(quick)
                    beats = {_COLLECTOR: dog.read_beat(_COLLECTOR, quick)}
                except Exception as exc:
                    if not self._busy(exc):
                        raise self._failure(what, exc) from exc
                    failed, beats = False, {}
                if watch_beats is not None:
                    watch_beats(beats)
                still = watch.see(beats)
                if failed or still:  # the others are the collector's to watch
                    raise self._failure(what)
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_S[1])

    # -- both ----------------------------------------------------------------------------

    def _busy(self, exc: BaseException) -> bool:
        """Whether a look that raised ``exc`` met only a busy store: a read that timed out
        while the store has answered within as long as a beat takes to go stale (the
        diagnosis's patience). Failed at once, one such read under load ended the resume
        check of every rank (1 in 8 at 1,024 ranks in the control-plane simulation)."""
        store = self.watchdog.store
        patience = stale_after_s(self.watchdog.heartbeat_s)
        return isinstance(exc, StoreTimeout) and store is not None and store.silent_s() < patience

    def _ask(self, op: Any, what: str) -> Any:
        store = self.watchdog.store
        assert store is not None
        try:
            return store.call(op, f"the ranks' words on {what}")
        except Exception as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, error: BaseException | None = None) -> PeerFailure:
        dog = self.watchdog
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        return PeerFailure(
            f"rank {dog.rank} ({dog.host}) at step {dog.step} in {dog.phase}: waiting for the "
            f"other ranks' {what} failed: {dog.diagnose()}{cause}"
        )


class _Motion:
    """When each watched rank's liveness record last moved, seen through its beats; a move
    marks this rank's own progress (waiting on a rank that moves is progress)."""

    def __init__(self, dog: Watchdog, ranks: list[int], patience_s: float) -> None:
        self.dog, self.patience_s = dog, patience_s
        now = time.monotonic()
        self.moved_at = {rank: now for rank in ranks}
        self.motion: dict[int, Any] = {}
        self.looked = now

    def due(self) -> bool:
        """Whether a look is due (at most one a second)."""
        now = time.monotonic()
        if now - self.looked < min(1.0, self.dog.heartbeat_s):
            return False
        self.looked = now
        return True

    def see(self, beats: dict[int, Any]) -> list[int]:
        """Take in the watched ranks' beats; the ranks that have not moved for the patience."""
        now = time.monotonic()
        for rank in self.moved_at:
            beat = beats.get(rank)
            seen = beat.motion if beat is not None else None
            if seen is not None and seen != self.motion.get(rank):
                self.motion[rank], self.moved_at[rank] = seen, now
                self.dog.tick()
        return [rank for rank, at in self.moved_at.items() if now - at > self.patience_s]
