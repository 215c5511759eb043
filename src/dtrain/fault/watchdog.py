"""Hang and failure detection that names the rank at fault, and where it was.

Every rank beats into the job's key-value store (hosted by rank 0 under ``dtrain train``, by
torch's agent under plain ``torchrun``): ``dtrain/hb/<rank>`` holds its host, pid, step, phase,
the time of the beat and the path of its progress file. A daemon thread writes it every
``heartbeat_s`` seconds, and soon (within ~0.4 s) after it enters a step or phase that lasts,
so a rank's beat is rarely far behind where it sits; the main thread only sets attributes and
never waits on the store.
A rank that raises posts ``dtrain/failed/<rank>`` before it exits.

A beat can still be behind: a rank whose steps take milliseconds may be dozens of steps past its
last beat when it is killed. So each rank also keeps its live step and phase in a small
memory-mapped file (:mod:`dtrain.fault.progress`), updated by :meth:`Watchdog.set_phase` at every
phase change for well under a microsecond and without a system call. The file outlives a rank
killed outright, and the ranks of its machine read it.

When a collective fails on a rank -- a peer's socket closed, or the collective timeout
(``dist.timeout_s``) expired because a peer stopped responding -- :meth:`Watchdog.diagnose`
reads the store and names who is missing, and where:

- a rank that posted a failure: its error, and the step and phase it raised in;
- a rank of this machine whose process is gone (``kill -9``, the OOM killer): the exact step
  and phase it died in, from its progress file (which the last rank of the machine to read it
  then removes); without a readable file, the step is said to be unknown and the last beat is
  given with its age;
- a rank whose beat is stale (stopped, hung, or on a machine that was cut off): how long it has
  made no progress and where, from its progress file on this machine; elsewhere, its last
  beat with its age -- never a stale step presented as where it is;
- a rank that never beat;
- when the store itself is gone or frozen with rank 0: rank 0, by its last beat (kept while the
  store answered) or its progress file. Every store call is bounded in time, so a frozen store
  never hangs a rank.

The trainer raises that as a :class:`~dtrain.fault.peer_failure.PeerFailure`. As a backstop for
hangs outside a collective with a timeout, the thread also watches this rank's own progress: when
a phase has not moved for twice the collective timeout, it writes the diagnosis as this worker's
error and ends the process, so the launcher stops (or restarts) the group instead of hanging.

Each rank also writes its beat to ``RUN_DIR/heartbeats/rankN.json`` from the same thread
(:mod:`dtrain.fault.beats`), for ``dtrain status`` and anyone else outside the job; a job of
one rank, which has no store, writes that file too.

A rank removes its own progress file when it stops; files of ranks killed with no rank left to
read them (their whole group killed) are removed by the next job that starts on that machine,
once no rank of their job can still need them (twice its collective timeout, plus a minute,
after the rank was last seen alive).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dtrain.fault.beats import write_beat
from dtrain.fault.peer_failure import (
    PeerFailure,
    beat_words,
    collective_cause,
    is_collective_failure,
    who,
)
from dtrain.fault.progress import (
    Progress,
    ProgressFile,
    process_alive,
    progress_path,
    read_progress,
    remove_progress_file,
    sweep_progress_files,
)
from dtrain.fault.store_client import StoreTimeout, bounded, connect_store

T = TypeVar("T")

# A beat follows a change of step or phase after at most this long (instead of waiting for the
# next regular beat), so the store's view of a rank on another machine is rarely more than
# that behind. Per rank: with many ranks the interval grows so that the store, which serves
# them all, gets at most about _PROMPT_BEATS_PER_S of them a second.
_PROMPT_BEAT_S = 0.2
_PROMPT_BEATS_PER_S = 2000.0


def _prefix() -> str:
    # Keys of an earlier attempt (before a restart) must not be read as this one's.
    from dtrain.runtime import store_namespace

    return store_namespace() + "watchdog/"


class Watchdog:
    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        heartbeat_s: float,
        timeout_s: float,
        on_hang: Callable[[str], None] | None = None,
        run_dir: Path | None = None,
        stats: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """``run_dir``: where this rank's beat file goes (None: no file); ``stats``: called on
        the watchdog's thread for the file's speed fields."""
        self.rank = rank
        self.world_size = world_size
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.host = socket.gethostname()
        self.step = 0
        self.phase = "start"
        self._phase_since = time.monotonic()
        self._stop = threading.Event()
        self._on_hang = on_hang or _exit_on_hang
        self._store_timeout_s = max(2.0, heartbeat_s * 3)
        self.store = connect_store(timeout_s=self._store_timeout_s) if world_size > 1 else None
        # Set when a call was given up on: that call still holds the client's connection, so
        # the next one connects afresh.
        self._client_stuck = False
        self._thread: threading.Thread | None = None
        # Rank 0's beat, kept while the store answers: when rank 0 hosts the store (it does
        # unless the launcher hosts it) and dies, the store dies with it, and this is all that
        # is left to name it by.
        self._rank0_beat: dict[str, Any] | None = None
        # This rank's live step and phase, for the ranks of its machine (see progress.py);
        # None without peers or where the file cannot be made.
        self._progress: ProgressFile | None = None
        # What dead peers' progress files said, by pid: the file is removed once read, and a
        # later diagnosis must still say the same.
        self._last_words: dict[int, Progress] = {}
        self.run_dir = run_dir
        self.stats = stats
        self._file_every_s = max(1.0, heartbeat_s)
        self._file_mark = (0, 0.0)  # step and time of the last beat file, for its speed

    # -- this rank -----------------------------------------------------------------------

    def start(self) -> None:
        if self.store is not None:
            self._open_progress()
            self._beat()
        elif self.run_dir is None:
            return
        if self.store is not None and self.rank != 0:
            # Every rank gets this far at start-up, so waiting for rank 0's first beat costs
            # nothing a collective soon after would not; it is what names rank 0 if it dies early.
            key = f"{_prefix()}hb/0"
            wait = datetime.timedelta(seconds=self.timeout_s)
            try:
                self._ask(lambda store: store.wait([key], wait), key, self.timeout_s + 1)
                self._rank0_beat = self._read(key)
            except Exception:
                pass  # rank 0 is late or gone; a collective will tell
        self._file_mark = (self.step, time.monotonic())
        self._write_beat_file()
        self._thread = threading.Thread(target=self._run, name="dtrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s + 1)
            self._thread = None
            self._write_beat_file()  # the last word: "done", or where it failed
        if self._progress is not None:  # this rank ends normally: nobody needs its file
            self._progress.close()
            self._progress = None

    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Called by the main thread at each phase change; cheap: no I/O, no system call, only
        a few stores into the progress file's shared memory (~0.4 µs in all)."""
        self.phase = phase
        if step is not None:
            self.step = step
        self._phase_since = now = time.monotonic()
        if self._progress is not None:
            self._progress.write(self.step, phase, now)

    def _open_progress(self) -> None:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            # Files of killed ranks that no rank removed (their whole group was killed).
            sweep_progress_files()
        # Every rank of the job has read this rank's file (or been ended by its own hang
        # check) within twice the collective timeout of its death.
        keep_s = 2 * self.timeout_s + 60
        try:
            self._progress = ProgressFile(progress_path(self.rank), self.rank, keep_s)
        except (OSError, ValueError):
            self._progress = None  # the beat alone will have to do
            return
        self._progress.write(self.step, self.phase, self._phase_since)

    def report_failure(self, error: BaseException | str) -> None:
        """Post this rank's failure so the others can name it. Never raises."""
        if self.store is None:
            return
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        record = {
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "error": text.splitlines()[0][:400] if text else "",
        }
        key, value = f"{_prefix()}failed/{self.rank}", json.dumps(record)
        try:
            self._ask(lambda store: store.set(key, value), "posting this rank's failure")
        except Exception:
            pass

    def _beat(self) -> None:
        assert self.store is not None
        record = {
            "host": self.host,
            "pid": os.getpid(),
            "step": self.step,
            "phase": self.phase,
            "time": time.time(),
            # Where the ranks of this machine read this rank's live step if it is killed.
            "progress": self._progress.path if self._progress is not None else None,
        }
        key, value = f"{_prefix()}hb/{self.rank}", json.dumps(record)
        self._ask(lambda store: store.set(key, value), "a heartbeat")

    def _write_beat_file(self) -> None:
        """This rank's beat in the run folder (see :mod:`dtrain.fault.beats`). Never raises."""
        if self.run_dir is None:
            return
        step, now = self.step, time.monotonic()
        last_step, last_time = self._file_mark
        record: dict[str, Any] = {
            "rank": self.rank,
            "world_size": self.world_size,
            "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "host": self.host,
            "pid": os.getpid(),
            "step": step,
            "phase": self.phase,
            "time": time.time(),
            "steps_per_s": (step - last_step) / (now - last_time) if now > last_time else None,
        }
        self._file_mark = (step, now)
        try:
            if self.stats is not None:
                record.update(self.stats())
            write_beat(self.run_dir, self.rank, record)
        except Exception:
            pass  # a full disk or a folder removed under the run: the next beat retries

    def _run(self) -> None:
        # Wakes often, beats when due or soon after the step or phase changed: the main thread
        # only sets attributes, all store I/O stays here.
        prompt_s = max(_PROMPT_BEAT_S, self.world_size / _PROMPT_BEATS_PER_S)
        tick = min(self.heartbeat_s, prompt_s)
        last_beat = last_read = last_file = time.monotonic()
        beaten = (self.step, self.phase)
        while not self._stop.wait(tick):
            now = time.monotonic()
            if self._progress is not None:
                self._progress.alive()
            if now - last_file >= self._file_every_s:
                last_file = now
                self._write_beat_file()
            if self.store is None:
                continue  # no peers: nothing more to beat to, nor a collective to hang in
            # A prompt beat announces where a rank sits: a step or phase that has lasted a tick.
            # A loop whose phases change faster (steps of milliseconds) beats at the regular
            # pace instead of five times a second: each beat is a thread and a store round
            # trip, and the training thread waits for their handoffs of the GIL (measured in
            # docs/benchmarks.md, benchmarks/peers.py).
            moved = (self.step, self.phase) != beaten and now - self._phase_since >= tick
            try:
                if moved or now - last_beat >= self.heartbeat_s:
                    # Counted as done even if it fails: a store that is gone is retried at
                    # the regular pace, not hammered.
                    beaten, last_beat = (self.step, self.phase), now
                    self._beat()
                if self.rank != 0 and now - last_read >= self.heartbeat_s:
                    last_read = now
                    self._rank0_beat = self._read(f"{_prefix()}hb/0") or self._rank0_beat
            except Exception:
                pass  # the store's host may be gone; a collective will tell
            stalled = time.monotonic() - self._phase_since
            if self.phase not in ("done", "idle") and stalled > 2 * self.timeout_s:
                if self._progress is not None:
                    # The default reaction ends the process without running stop().
                    remove_progress_file(self._progress.path)
                self._on_hang(
                    f"rank {self.rank} ({self.host}, pid {os.getpid()}) made no "
                    f"progress for {stalled:.0f}s in {self.phase} at step "
                    f"{self.step}; {self.diagnose()}"
                )
                return

    # -- the others ----------------------------------------------------------------------

    def peers(self, seconds: float | None = None) -> dict[int, dict[str, Any] | None]:
        """Latest beat of every other rank (None where none was ever seen)."""
        out: dict[int, dict[str, Any] | None] = {}
        if self.store is None:
            return out
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            out[rank] = self._read(f"{_prefix()}hb/{rank}", seconds)
        return out

    def failures(self, seconds: float | None = None) -> dict[int, dict[str, Any]]:
        out: dict[int, dict[str, Any]] = {}
        if self.store is None:
            return out
        for rank in range(self.world_size):
            record = self._read(f"{_prefix()}failed/{rank}", seconds)
            if record is not None and rank != self.rank:
                out[rank] = record
        return out

    def _ask(self, op: Callable[[Any], T], what: str, seconds: float | None = None) -> T:
        """One store operation, bounded in time (see :func:`bounded`); raises when the store
        cannot be reached or does not answer."""
        assert self.store is not None
        limit = seconds if seconds is not None else self._store_timeout_s
        if self._client_stuck:
            fresh = bounded(
                lambda: connect_store(timeout_s=self._store_timeout_s), limit, "a new connection"
            )
            if fresh is None:
                raise ConnectionError("cannot connect to the job's key-value store")
            self.store, self._client_stuck = fresh, False
        store = self.store
        try:
            return bounded(lambda: op(store), limit, what)
        except StoreTimeout:
            self._client_stuck = True
            raise

    def _read(self, key: str, seconds: float | None = None) -> dict[str, Any] | None:
        """A record, or None when there is none; a store that cannot be reached raises."""

        def read(store: Any) -> bytes | None:
            return store.get(key) if store.check([key]) else None

        raw = self._ask(read, f"reading {key}", seconds)
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None

    def diagnose(self) -> str:
        """Who is missing, in words."""
        if self.store is None:
            return "no rendezvous store to ask which rank is missing"
        # A healthy store answers in milliseconds; a short bound keeps the whole diagnosis
        # (after the collective's own timeout) within the time a user waits for it.
        quick = max(1.0, min(2.0, self.heartbeat_s))
        try:
            failed = self.failures(quick)
            beats = self.peers(quick)
        except Exception as exc:
            from dtrain.runtime import store_hosted_by_launcher

            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            why = f"({type(exc).__name__}: {first})"
            return self._store_lost(why, isinstance(exc, StoreTimeout), store_hosted_by_launcher())
        now = time.time()
        stale_after = max(3 * self.heartbeat_s, 3.0)
        parts = []
        for rank, record in sorted(failed.items()):
            parts.append(
                f"rank {rank} ({record['host']}, pid {record['pid']}) failed at step "
                f"{record['step']} in {record['phase']}: {record['error']}"
            )
        read_files = []
        for rank, beat in sorted(beats.items()):
            if rank in failed:
                continue
            if beat is None:
                parts.append(f"rank {rank} never checked in")
            elif beat["host"] == self.host and not process_alive(int(beat["pid"])):
                # Killed outright (kill -9, the OOM killer): no error posted, and a beat that
                # may be many steps behind; its progress file says where it was.
                parts.append(f"{who(rank, beat)} died: {self._last_words_of(beat, now)}")
                read_files.append(beat.get("progress"))
            elif now - beat["time"] > stale_after:
                parts.append(f"{who(rank, beat)} stopped responding: {self._last_known(beat, now)}")
        if read_files and not self._peer_alive_here(beats):
            # No other rank of this machine is left to read the dead ranks' files.
            for path in read_files:
                if path:
                    remove_progress_file(path)
        if not parts:
            return "every other rank is still beating (the failure may be in the network)"
        return "; ".join(parts)

    def _peer_alive_here(self, beats: dict[int, dict[str, Any] | None]) -> bool:
        return any(
            beat is not None and beat["host"] == self.host and process_alive(int(beat["pid"]))
            for beat in beats.values()
        )

    def _last_words_of(self, beat: dict[str, Any], now: float) -> str:
        """Where a rank of this machine whose process is gone was when it died."""
        pid = int(beat["pid"])
        progress = self._last_words.get(pid)
        if progress is None and beat.get("progress"):
            progress = read_progress(str(beat["progress"]), pid)
            if progress is not None:
                self._last_words[pid] = progress
        gone = "its process is gone (killed or crashed)"
        if progress is None:  # no file to read: say plainly how old what we know is
            return f"{gone} at an unknown step: {beat_words(beat, now)}"
        return f"{gone} {progress.where()}"

    def _last_known(self, beat: dict[str, Any], now: float) -> str:
        """Where a rank that is alive but silent is: exact for a rank of this machine (from
        its progress file), else its last heartbeat and how old it is."""
        progress = None
        if beat["host"] == self.host and beat.get("progress"):
            progress = read_progress(str(beat["progress"]), int(beat["pid"]))
        if progress is None:
            return beat_words(beat, now)
        still = max(0.0, time.monotonic() - progress.since)
        age = max(0.0, now - beat["time"])
        return f"no progress for {still:.1f}s, {progress.where()} (last heartbeat {age:.1f}s ago)"

    def _store_lost(self, why: str, timed_out: bool, launcher_hosted: bool) -> str:
        """The diagnosis when the store cannot be reached: its host has died."""
        beat = self._rank0_beat
        if launcher_hosted or beat is None:
            host = "the launcher" if launcher_hosted else "rank 0"
            return (
                f"the job's key-value store is unreachable {why}: {host}, which hosts it, has died"
            )
        now = time.time()
        if beat["host"] == self.host and not process_alive(int(beat["pid"])):
            fate = f"died: {self._last_words_of(beat, now)}"
            if self.world_size == 2 and beat.get("progress"):
                remove_progress_file(str(beat["progress"]))  # no other rank can need it
        elif timed_out:  # alive but silent: stopped (SIGSTOP), hung or cut off
            fate = f"stopped responding: {self._last_known(beat, now)}"
        else:
            fate = f"is unreachable (died, or its machine was cut off): {beat_words(beat, now)}"
        return f"{who(0, beat)} {fate}; it hosted the job's key-value store, now unreachable {why}"

    def on_error(self, error: BaseException) -> BaseException:
        """What the trainer raises for an error out of its loop: a collective that failed
        becomes a :class:`PeerFailure` naming the peer at fault; this rank's own error is
        posted for the other ranks to name, and stays as it is."""
        if isinstance(error, PeerFailure):
            return error
        if is_collective_failure(error):
            return self.peer_failure(error)
        self.report_failure(error)
        return error

    def peer_failure(self, error: BaseException) -> PeerFailure:
        # Give a failing peer a moment to post its error (it may still be on its way out).
        time.sleep(min(1.0, self.heartbeat_s))
        return PeerFailure(
            f"rank {self.rank} ({self.host}) at step {self.step} in {self.phase}: a collective "
            f"failed: {self.diagnose()} (collective error: {collective_cause(error)})"
        )


def _exit_on_hang(message: str) -> None:
    """Leave the diagnosis where the launcher reads a worker's failure, then end the process:
    the main thread is stuck in native code and cannot raise."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        try:
            with open(error_file, "w") as fh:
                json.dump({"message": f"PeerFailure: {message}", "timestamp": int(time.time())}, fh)
        except OSError:
            pass
    print(f"dtrain: error: {message}", file=sys.stderr, flush=True)
    os._exit(3)
