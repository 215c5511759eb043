"""Every rank's word (a short string) on every rank, where the ranks may take long to speak:
each hashes its share of a checkpoint before it can say whether the share is whole.

A collective would wait for the slowest rank under the collective timeout (``dist.timeout_s``),
so a large enough checkpoint would fail its own resume. Instead each rank posts its word to
the job's key-value store and reads the others', waiting as long as every rank still owed
makes progress: its liveness record (step, phase, progress marks: :mod:`dtrain.fault.liveness`),
which the watchdog mirrors into the store, moves. A rank whose record has not moved for the
collective timeout, or that posted a failure, ends the wait with a
:class:`~dtrain.fault.peer_failure.PeerFailure` naming it, as a failed collective does. While
the others move, so does this rank's record (each time it sees them move), so that its own
hang backstop leaves it alone.

Without the store (a run without peers or without a store client) the words go through one
collective, under its timeout.

The words are sealed with the job's secret (:mod:`dtrain.dist.sealed_store`): one that fails
its seal (a stranger's, who reached the store's port) counts as a word not posted yet (one
warning names its key).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NoReturn

from dtrain.comm.plain import all_gather_json
from dtrain.dist import sealed_store
from dtrain.dist.runtime import store_namespace
from dtrain.fault.liveness import Liveness
from dtrain.fault.peer_failure import PeerFailure
from dtrain.fault.watchdog import Watchdog

# Called with the latest beats of the ranks still owed, at each look at them; raises to end the
# wait (a rank's beat shows it will never post its word).
BeatsWatch = Callable[[dict[int, Liveness | None]], None]

_POLL_S = (0.02, 0.25)  # the first and the longest pause between two looks at the store


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
        rank that stopped. ``watch``: given the owed ranks' beats at each look (about every
        second); what it raises ends the wait."""
        dog = self.watchdog
        if dog.world_size == 1:
            return [word]
        if dog.store is None:
            return [str(w) for w in all_gather_json(word)]
        prefix = f"{store_namespace()}words/{key}/"
        mine = f"{prefix}{dog.rank}"
        encoded = sealed_store.seal(mine, word.encode())
        self._ask(lambda s: s.set(mine, encoded), what)
        got = {dog.rank: word}
        started = time.monotonic()
        moved_at = {rank: started for rank in range(dog.world_size) if rank != dog.rank}
        motion: dict[int, Any] = {}
        pause, looked = _POLL_S[0], started
        while len(got) < dog.world_size:
            owed = [rank for rank in range(dog.world_size) if rank not in got]
            keys = [f"{prefix}{rank}" for rank in owed]
            ready = self._ask(lambda s, keys=keys: [s.check([k]) for k in keys], what)
            for rank, key_ready in zip(owed, ready):
                if key_ready:
                    name = f"{prefix}{rank}"
                    value = sealed_store.text(name, self._ask(lambda s, k=name: s.get(k), what))
                    if value is not None:
                        got[rank] = value
            if len(got) == dog.world_size:
                break
            now = time.monotonic()
            if now - looked >= min(1.0, dog.heartbeat_s):
                looked = now
                self._look_at(owed, moved_at, motion, now, what, watch)
            time.sleep(pause)
            pause = min(pause * 1.5, _POLL_S[1])
        return [got[rank] for rank in range(dog.world_size)]

    def _look_at(
        self,
        owed: list[int],
        moved_at: dict[int, float],
        motion: dict[int, Any],
        now: float,
        what: str,
        watch: BeatsWatch | None = None,
    ) -> None:
        """Raise when a rank still owed failed or has not moved for the collective timeout;
        mark this rank's own progress when one of them moved."""
        dog = self.watchdog
        quick = max(1.0, min(2.0, dog.heartbeat_s))
        try:
            failed = dog.failures(quick)
            beats = dog.peers(quick)
        except Exception as exc:
            self._fail(what, exc)
        if any(rank in failed for rank in owed):
            self._fail(what)
        if watch is not None:
            watch({rank: beats.get(rank) for rank in owed})
        for rank in owed:
            beat = beats.get(rank)
            seen = beat.motion if beat is not None else None
            if seen is not None and seen != motion.get(rank):
                motion[rank], moved_at[rank] = seen, now
                dog.tick()  # waiting on a rank that moves is progress of this rank's phase
        stalled = [rank for rank in owed if now - moved_at[rank] > dog.timeout_s]
        if stalled:
            self._fail(what)

    def _ask(self, op: Any, what: str) -> Any:
        store = self.watchdog.store
        assert store is not None
        try:
            return store.call(op, f"the ranks' words on {what}")
        except Exception as exc:
            self._fail(what, exc)

    def _fail(self, what: str, error: BaseException | None = None) -> NoReturn:
        dog = self.watchdog
        cause = f" ({type(error).__name__}: {error})" if error is not None else ""
        raise PeerFailure(
            f"rank {dog.rank} ({dog.host}) at step {dog.step} in {dog.phase}: waiting for the "
            f"other ranks' {what} failed: {dog.diagnose()}{cause}"
        )
