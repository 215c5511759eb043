"""Reading a rank's shards ahead of its steps, from an object store, into its bounded cache.

The loader knows the plan of every step to come (a pure function of the position,
:mod:`dtrain.data.partition`); :class:`ReadAhead` walks the same plans on a background thread,
holds the pieces of this rank's share of each step (:mod:`dtrain.data.store_shards`) and fetches
them, several requests at once, while the pieces held stay within this rank's share of
``data.cache_bytes`` (the ranks of a machine share its cache) and the step no more than
:data:`MAX_STEPS` ahead. When the loader passes a step, its pieces are given
back (and evicted as room is needed). The reads themselves hold what they touch, so a step the
thread has not reached yet is still read right, fetched there and then: the read-ahead changes
when bytes arrive, never which.

It starts as soon as the run's position is known, before the first step asks
(:meth:`dtrain.data.loader.RankLoader.warm`: at the start, while the model is set up; on a
resume, once the checkpoint is chosen, while the rest of it loads), so the first steps find
their window fetched; never from a guessed position, whose pieces would be the wrong ones.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dtrain.data.partition import StepPlan
from dtrain.data.store_shards import StoreShards
from dtrain.errors import DataError

MAX_STEPS = 64  # steps held ahead at most: enough to keep a link busy, a bound on the thread
REQUESTS = 4  # range requests in flight at once (a run of pieces each)


class CacheTooSmall(DataError):
    """One step's share reads more than ``data.cache_bytes`` holds."""


class ReadAhead:
    def __init__(
        self, store: StoreShards, pieces_of: Callable[[np.ndarray], np.ndarray], rank: int
    ) -> None:
        self.store = store
        self.pieces_of = pieces_of
        self.rank = rank
        self._held: collections.deque[tuple[int, np.ndarray]] = collections.deque()
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what stopped the thread, if anything
        # What the loader's plans started from (its position, shares, skipped ranges) while
        # the thread runs and no step was passed; else None. The loader keeps a read-ahead
        # whose origin is its own (started before the first step: data.loader.RankLoader.warm).
        self.origin: Hashable | None = None

    def start(self, plans: Iterator[StepPlan], origin: Hashable = None) -> None:
        """Read ahead of ``plans``, the loader's own steps from its position (``origin``)."""
        self.stop()
        self.error = None  # the old plans' (a cache too small for them is not for these)
        self.origin = origin
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run,
            args=(plans, self._stop),
            name=f"dtrain-read-ahead-rank{self.rank}",
            daemon=True,
        )
        self._thread.start()

    def passed(self, end: int) -> None:
        """The loader has taken the steps that end at or before position ``end``. A cache
        too small for one step is raised here, to the training loop."""
        if isinstance(self.error, CacheTooSmall):
            raise self.error
        self.origin = None  # past it: a return to that position starts afresh
        with self._lock:
            while self._held and self._held[0][0] <= end:
                self.store.give_back(self._held.popleft()[1])
            self._lock.notify_all()

    def stop(self) -> None:
        """Stop the thread and give back every piece it holds (a reset, the end)."""
        self._stop.set()
        self.origin = None
        # Woken where it waits for room or for the loader (else up to half a second: a warm
        # read-ahead waits there once its window is fetched, and a reset waits for it).
        self.store.wake()
        with self._lock:
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            while self._held:
                self.store.give_back(self._held.popleft()[1])

    def _run(self, plans: Iterator[StepPlan], stop: threading.Event) -> None:
        # A failure stops the read-ahead only: the step that needs the piece fetches it itself
        # and raises the failure there, where the rank reports it.
        try:
            with ThreadPoolExecutor(REQUESTS, thread_name_prefix="dtrain-piece") as pool:
                for plan in plans:
                    if not self._hold_step(plan, stop):
                        return
                    pieces = self._held[-1][1]
                    missing = pieces[~self.store.present(pieces)]
                    # A run of consecutive pieces a task, REQUESTS at a time: the step's runs
                    # in parallel.
                    for done in pool.map(self.store.fetch, self.store.runs(missing)):
                        del done
                        if stop.is_set():
                            return
        except BaseException as exc:
            self.error = exc

    def _hold_step(self, plan: StepPlan, stop: threading.Event) -> bool:
        mine = plan.rank_ids(self.rank)
        ids = np.concatenate(mine) if mine else np.empty(0, dtype=np.int64)
        pieces = self.pieces_of(ids)
        need = self.store.bytes_of(pieces)
        if need > self.store.budget:
            sharers = self.store.sharers
            each = f" over {sharers} ranks of this machine" if sharers > 1 else ""
            raise CacheTooSmall(
                f"data.cache_bytes = {self.store.limit}{each} is less than the {need} bytes "
                f"({len(pieces)} pieces) that rank {self.rank}'s share of the step at stream "
                f"position {plan.start} reads from {self.store.root}; raise data.cache_bytes"
            )
        with self._lock:
            while len(self._held) >= MAX_STEPS and not stop.is_set():
                self._lock.wait(0.5)
        if not self.store.wait_room(self.store.new_bytes(pieces), stop):
            return False
        with self._lock:
            self.store.take(pieces)
            self._held.append((plan.end, pieces))
        return True
