"""The watchdog: this rank's phase and progress written into its liveness record, a daemon
thread that stamps it alive, mirrors it into the job's store and backs up the collective
timeout against hangs, and the diagnosis of a failed peer (the package's docstring says how)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.console import say_error, say_line
from dtrain.dist import sealed_store
from dtrain.dist.reachability import node_label
from dtrain.dist.sealed_store import fits, warn_once
from dtrain.dist.store_link import job_store_link
from dtrain.fault import oom
from dtrain.fault.diagnosis import PeerDiagnosis
from dtrain.fault.error_log import record_error
from dtrain.fault.liveness import (
    Liveness,
    LivenessFile,
    Speed,
    liveness_path,
)
from dtrain.fault.peer_failure import (
    NetworkFailure,
    PeerFailure,
    collective_cause,
    connection_closed,
    is_collective_failure,
)
from dtrain.fault.watchdog.records import (
    FAILURE,
    KILLED,
    SILENT,
    beat_of,
    failed_ranks,
    failure_text,
    liveness_attempt,
    store_prefix,
)

# A beat follows a change of step or phase after at most this long (instead of waiting for the
# next regular beat), so the store's view of a rank on another machine is rarely more than
# that behind. Per rank: with many ranks the interval grows so that the store, which serves
# them all, gets at most about _PROMPT_BEATS_PER_S of them a second.
_PROMPT_BEAT_S = 0.2
_PROMPT_BEATS_PER_S = 2000.0

# How long the watchdog's first connection to the job's store may take.
_CONNECT_S = 30.0

# Phases the backstop leaves alone: finished ranks, and the user's after-training hook, which
# cannot tick (it is the user's code); a collective inside it has its own timeout.
_NO_BACKSTOP = frozenset({"done", "idle", "after_training"})


class InPhase:
    """A phase of the loop as a context manager (:meth:`Watchdog.in_phase`). Left by an error,
    the phase stays where the error was raised: that is what the rank's error report and its
    peers' diagnosis name. A class, not a generator: the loop enters several every step."""

    __slots__ = ("dog", "outer", "phase", "step")

    def __init__(self, dog: Watchdog, phase: str, step: int | None) -> None:
        self.dog, self.phase, self.step, self.outer = dog, phase, step, ""

    def __enter__(self) -> None:
        self.outer = self.dog.phase
        self.dog.set_phase(self.phase, self.step)

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        if kind is None:
            self.dog.set_phase(self.outer)


class Watchdog(PeerDiagnosis):
    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        heartbeat_s: float,
        timeout_s: float,
        on_hang: Callable[[str], None] | None = None,
        run_dir: Path | None = None,
        stats: Callable[[], Speed] | None = None,
    ) -> None:
        """``run_dir``: where this rank's liveness file goes (None: the record stays in
        memory); ``stats``: called on the watchdog's thread for the record's speed fields."""
        self.rank = rank
        self.world_size = world_size
        # This rank's place on its machine, as torch's agent numbers it (diagnosis: watched).
        self.local_rank = int(os.environ.get("LOCAL_RANK") or 0)
        self.local_size = int(os.environ.get("LOCAL_WORLD_SIZE") or 1)
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.host = socket.gethostname()
        self.step = 0
        self.phase = "start"
        self.run_dir = run_dir
        self.liveness = LivenessFile(
            liveness_path(run_dir, rank) if run_dir is not None else None,
            rank=rank,
            world_size=world_size,
            attempt=liveness_attempt(),
            host=self.host,
            pid=os.getpid(),
        )
        if self.liveness.error:
            say_line(
                f"dtrain: warning: rank {rank}: {self.liveness.error}; its liveness stays in "
                "memory and the job's store (hang checks go on), but `dtrain status` will not "
                "show this rank and, killed, it cannot be placed at its exact step"
            )
        self._stop = threading.Event()
        # The record's alive part has one writer: the thread, then stop(), which takes it over
        # (``_taken``) even while the thread still waits on a store call; each write of the
        # thread holds the lock and looks first.
        self._writer = threading.Lock()
        self._taken = False
        self._on_hang = on_hang or _exit_on_hang
        call_s = max(2.0, heartbeat_s * 3)
        # The first connection may wait as long as a start-up does (a loaded machine with
        # many ranks answered it in more than the few seconds a later call is given).
        self.store = job_store_link(call_s, _CONNECT_S) if world_size > 1 else None
        if self.store is None and world_size > 1:
            say_line(
                f"dtrain: warning: rank {rank}: the job's key-value store did not answer within "
                f"{_CONNECT_S:.0f}s; this rank's heartbeats stay in its liveness file, and a "
                "failed peer is named with less detail"
            )
        self._thread: threading.Thread | None = None
        # Rank 0's beat, kept while the store answers: when rank 0 hosts the store (it does
        # unless the launcher hosts it) and dies, the store dies with it, and this is all that
        # is left to name it by.
        self._rank0_beat: Liveness | None = None
        # The backstop's clock (time.monotonic()): when this rank's record last moved, and
        # rank 0's (as its beats show it).
        self._moves_seen = self.liveness.moves
        self._moved_at = time.monotonic()
        self._rank0_moved_at = float("-inf")
        self.stats = stats
        # The other ranks' probe addresses (reachability), read when first needed.
        self._addresses: dict[int, tuple[str, int]] = {}
        self.node = node_label()  # this rank's machine, as the others know it
        self._speed = Speed()
        self._speed_every_s = max(1.0, heartbeat_s)
        self._speed_mark = (0, time.monotonic())  # step and time of the last measurement
        self._looks: list[Callable[[], None]] = []  # called at every wake (:meth:`on_wake`)

    # -- this rank -----------------------------------------------------------------------

    def start(self) -> None:
        if self.store is not None:
            # Given as long as the first connection: every rank beats first at once, while
            # the store is busiest (the groups' creation); a beat bounded by a call's few
            # seconds ended ranks there in the simulation at 4,096.
            self._beat(_CONNECT_S)
        if self.store is not None and self.rank != 0:
            # Every rank gets this far at start-up, so waiting for rank 0's first beat costs
            # nothing a collective soon after would not; it is what names rank 0 if it dies early.
            key = f"{store_prefix()}hb/0"
            wait = datetime.timedelta(seconds=self.timeout_s)
            with contextlib.suppress(Exception):  # rank 0 is late or gone; a collective will tell
                self.store.call(lambda store: store.wait([key], wait), key, self.timeout_s + 1)
                self._see_rank0(self.read_beat(0), time.monotonic())
        self._moves_seen, self._moved_at = self.liveness.moves, time.monotonic()
        self.liveness.stamp(time.time(), self._speed)
        self._thread = threading.Thread(target=self._run, name="dtrain-watchdog", daemon=True)
        self._thread.start()

    def on_wake(self, look: Callable[[], None]) -> None:
        """Call ``look()`` on this thread at every wake (at least every 0.2 s) while it runs:
        in-place recovery's look at the membership, which must go on while the training
        thread is blocked in a collective. ``look`` never raises (it reports its own)."""
        self._looks.append(look)

    def stop(self) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            # The thread ends at its next wake, once its store call (if any) returns. A call
            # to a store that has stopped answering (its host stopped or cut off) returns
            # only at its bound: waited for, it held back this rank's error line -- after a
            # diagnosis that named the store's host -- by seconds. Then it is left to end on
            # its own, and writes nothing more.
            silent = self.store is not None and self.store.silent_s() > 0
            thread.join(timeout=0.0 if silent else 2 * self.heartbeat_s + 1)
            with self._writer:
                self._taken = True
                self._measure(time.monotonic())
                self.liveness.stamp(time.time(), self._speed)  # the last word: done, or where
                self.liveness.sync()
        self.liveness.close()
        if self.store is not None:
            self.store.close()

    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Called by the main thread at each phase change; cheap: no I/O, no system call, only
        a few stores into the liveness file's shared memory (well under a microsecond)."""
        self.phase = phase
        if step is not None:
            self.step = step
        self.liveness.set_phase(phase, self.step, time.time())

    def in_phase(self, phase: str, step: int | None = None) -> InPhase:
        """``with watchdog.in_phase(name):`` the record says ``name`` inside, and the phase it
        was entered from again once it is left."""
        return InPhase(self, phase, step)

    def tick(self) -> None:
        """A piece of the current phase is done (an evaluation batch, a file written or
        hashed): the backstop counts it as progress. The training thread's only: a thread
        working beside it must not vouch for it (it may be hung meanwhile)."""
        self.liveness.mark_progress(time.time())

    def report_failure(self, error: BaseException | str) -> None:
        """Post this rank's failure so the others can name it. Never raises."""
        text = failure_text(error)
        record = {
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "error": text.splitlines()[0][:400] if text else "",
        }
        self._post_failure(self.rank, record)

    def _report_dead_peer(self, rank: int, where: str, beat: Liveness) -> None:
        """Post, for a rank of this machine whose process is gone (it posts nothing itself),
        what this machine saw: the other machines can only watch its beats go stale, a few
        seconds in which rank 0 may end and take the store with it -- and then they would
        name rank 0. Never raises."""
        record = {
            "host": beat.host,
            "pid": beat.pid,
            "killed": where,  # its process is gone, where it was (for the other machines)
            "seen_by": self.rank,
        }
        self._post_failure(rank, record)

    def _report_silent_peer(
        self, rank: int, words: str, network: bool, beat: Liveness | None
    ) -> None:
        """Post, for a rank this one watches, that its beats stopped (or never began), in the
        words this rank found: the ranks that do not watch it name it from this. Never
        raises."""
        record: dict[str, Any] = {"silent": words, "network": network, "seen_by": self.rank}
        if beat is not None:
            record.update(host=beat.host, pid=beat.pid)
        self._post_failure(rank, record)

    def _first_to_scan(self) -> bool:
        """Whether this rank is the first of its attempt to claim the diagnosis's one read of
        every rank's beat. Never raises (a store that cannot be asked: not this rank)."""
        key = f"{store_prefix()}scanned"
        try:
            return self.store is not None and bool(
                self.store.call(lambda store: store.add(key, 1) == 1, "a claim")
            )
        except Exception:
            return False

    def _post_failure(self, rank: int, record: dict[str, Any]) -> None:
        if self.store is None:
            return
        key = f"{store_prefix()}failed/{rank}"
        value = sealed_store.seal(key, json.dumps(record).encode())
        # The index is appended to by every rank, and cannot be sealed: it only says which
        # records to read, and those are.
        index, entry = f"{store_prefix()}failed", f"{rank},"

        def post(store: Any) -> None:
            store.set(key, value)
            store.append(index, entry)  # the ranks that failed, for a diagnosis to read

        with contextlib.suppress(Exception):
            self.store.call(post, "posting this rank's failure")

    def _beat(self, seconds: float | None = None) -> None:
        """This rank's record, as it stands, into the store (none once stop() took over),
        within ``seconds`` (default: a call's bound)."""
        assert self.store is not None
        with self._writer:
            if self._taken:
                return
            self.liveness.stamp(time.time(), self._speed)
            record = self.liveness.record()
        key = f"{store_prefix()}hb/{self.rank}"
        value = sealed_store.seal(key, json.dumps(dataclasses.asdict(record)).encode())
        self.store.call(lambda store: store.set(key, value), "a heartbeat", seconds)

    def _measure(self, now: float) -> None:
        """This rank's speed, for the record (``now``: ``time.monotonic()``). Never raises."""
        step = self.step
        last_step, last_time = self._speed_mark
        self._speed_mark = (step, now)
        steps_per_s = (step - last_step) / (now - last_time) if now > last_time else None
        try:
            speed = self.stats() if self.stats is not None else Speed()
        except Exception:  # a speed is a nicety: it must never stop the beats
            speed = Speed()
        self._speed = dataclasses.replace(speed, steps_per_s=steps_per_s)

    def _run(self) -> None:
        # Wakes often, beats when due or soon after the step or phase changed: the main thread
        # only writes its record, all store I/O stays here.
        wake = min(self.heartbeat_s, max(_PROMPT_BEAT_S, self.world_size / _PROMPT_BEATS_PER_S))
        last_beat = last_read = last_measure = time.monotonic()
        beaten = (self.step, self.phase)
        where, where_since = beaten, last_beat  # the step and phase seen, and since when
        while not self._stop.wait(wake):
            now = time.monotonic()
            measure = now - last_measure >= self._speed_every_s
            with self._writer:
                if self._taken:
                    return
                if measure:
                    last_measure = now
                    self._measure(now)
                self.liveness.stamp(time.time(), self._speed)
                if measure:
                    self.liveness.sync()  # for readers on other machines
            for look in self._looks:
                look()
            if self.store is None:
                continue  # no peers: nothing more to beat to, nor a collective to hang in
            if (self.step, self.phase) != where:
                where, where_since = (self.step, self.phase), now
            # A prompt beat announces where a rank sits: a step or phase that has lasted a
            # wake. A loop whose phases change faster (steps of milliseconds) beats at the
            # regular pace instead of five times a second: each beat is a thread and a store
            # round trip, and the training thread waits for their handoffs of the GIL
            # (measured in docs/benchmarks.md, benchmarks/peers.py).
            moved = where != beaten and now - where_since >= wake
            # The store's host may be gone: a collective will tell.
            with contextlib.suppress(Exception):
                if moved or now - last_beat >= self.heartbeat_s:
                    # Counted as done even if it fails: a store that is gone is retried at
                    # the regular pace, not hammered.
                    beaten, last_beat = (self.step, self.phase), now
                    self._beat()
                if self.rank != 0 and now - last_read >= self.heartbeat_s:
                    last_read = now
                    self._see_rank0(self.read_beat(0), now)
            if (hung := self.check_hang(time.monotonic())) is not None:
                self._on_hang(f"{hung}; {self.diagnose()}")
                return

    def _see_rank0(self, beat: Liveness | None, now: float) -> None:
        """Rank 0's latest beat, read at ``now`` (``time.monotonic()``)."""
        if beat is None:
            return
        if self._rank0_beat is None or beat.motion != self._rank0_beat.motion:
            self._rank0_moved_at = now
        self._rank0_beat = beat

    def check_hang(self, now: float) -> str | None:
        """The backstop at ``now`` (``time.monotonic()``, called every wake of the thread):
        None, or the words naming this rank as hung -- neither its phase nor its progress
        (nor, on another rank, rank 0's) has moved for twice the collective timeout."""
        moves = self.liveness.moves
        if moves != self._moves_seen:
            self._moves_seen, self._moved_at = moves, now
        if self.phase in _NO_BACKSTOP:
            return None
        last = self._moved_at if self.rank == 0 else max(self._moved_at, self._rank0_moved_at)
        if now - last <= 2 * self.timeout_s:
            return None
        return (
            f"rank {self.rank} ({self.host}, pid {os.getpid()}) made no progress for "
            f"{now - self._moved_at:.0f}s in {self.phase} at step {self.step}"
        )

    # -- the others ----------------------------------------------------------------------

    def peers(self, seconds: float | None = None) -> dict[int, Liveness | None]:
        """Latest beat of every other rank (None where none was ever seen): one read of the
        store for all of them."""
        return self.beats(set(range(self.world_size)) - {self.rank}, seconds)

    def beats(self, ranks: set[int], seconds: float | None = None) -> dict[int, Liveness | None]:
        """Latest beat of each of ``ranks`` (None where none was ever seen): one read."""
        if self.store is None or not ranks:
            return {}
        keys = {rank: f"{store_prefix()}hb/{rank}" for rank in sorted(ranks)}
        values = self.store.read_many(list(keys.values()), seconds)
        return {rank: beat_of(key, values[key]) for rank, key in keys.items()}

    def failures(self, seconds: float | None = None) -> dict[int, dict[str, Any]]:
        """The failures other ranks posted: the index of the ranks that failed, then theirs."""
        if self.store is None:
            return {}
        listed = failed_ranks(self.store, seconds)
        ranks = sorted(listed & set(range(self.world_size)) - {self.rank})
        keys = {rank: f"{store_prefix()}failed/{rank}" for rank in ranks}
        values = self.store.read_many(list(keys.values()), seconds)
        failed: dict[int, dict[str, Any]] = {}
        for rank, key in keys.items():
            record = values[key]
            if record is not None and not any(fits(record, s) for s in (FAILURE, KILLED, SILENT)):
                warn_once(key, "it is malformed (not the record dtrain writes there)")
            elif record is not None:
                failed[rank] = record
        return failed

    def read_beat(self, rank: int, seconds: float | None = None) -> Liveness | None:
        assert self.store is not None
        key = f"{store_prefix()}hb/{rank}"
        # Rank 0's beat, read every heartbeat by every rank: once seen, its key stays (the
        # job's keys are never removed), so one store operation reads it, not two.
        present = rank == 0 and self._rank0_beat is not None
        return beat_of(key, self.store.read(key, seconds, present=present))

    def on_error(self, error: BaseException) -> BaseException:
        """What the trainer raises for an error out of its loop: a collective that failed
        becomes a :class:`PeerFailure` naming the peer at fault; an allocation that failed an
        :class:`~dtrain.fault.oom.OutOfMemory` in one line; this rank's own error is posted
        for the other ranks to name (and, but for running out of memory, stays as it is)."""
        if isinstance(error, PeerFailure):
            return error
        # Out of memory first: this rank's own failure, whatever the allocator's words.
        words = oom.describe(error, f"rank {self.rank} ({self.host})", self.where())
        if words is not None:
            error = oom.OutOfMemory(words)
        elif is_collective_failure(error):
            return self.peer_failure(error)
        self.report_failure(error)
        return error

    def where(self) -> str:
        """This rank's place, in words: ``at step 3 in forward_backward``."""
        return f"at step {self.step} in {self.phase}"

    def peer_failure(self, error: BaseException) -> PeerFailure:
        # Give a failing peer a moment to post its error (it may still be on its way out).
        time.sleep(min(1.0, self.heartbeat_s))
        words, network = self.diagnosis(connection_closed(error))
        cause = collective_cause(error)
        if network:
            return NetworkFailure(
                f"rank {self.rank} ({self.host}, {self.node}) at step {self.step} in "
                f"{self.phase}: a network failure: {words} (collective error: {cause})"
            )
        return PeerFailure(
            f"rank {self.rank} ({self.host}) at step {self.step} in {self.phase}: a collective "
            f"failed: {words} (collective error: {cause})"
        )


def _exit_on_hang(message: str) -> None:
    """Leave the diagnosis where the launcher reads a worker's failure, then end the process:
    the main thread is stuck in native code and cannot raise."""
    record_error(f"PeerFailure: {message}")
    say_error(message)
    os._exit(3)
