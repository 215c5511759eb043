"""Hang and failure detection that names the rank at fault.

Every rank beats into the job's key-value store (hosted by rank 0 under ``dtrain train``, by
torch's agent under plain ``torchrun``):
``dtrain/hb/<rank>`` holds its host, pid, step, phase and the time of the beat, refreshed by a
daemon thread every ``heartbeat_s`` seconds. A rank that raises posts ``dtrain/failed/<rank>``
before it exits.

When a collective fails on a rank -- a peer's socket closed, or the collective timeout
(``dist.timeout_s``) expired because a peer stopped responding -- :meth:`Watchdog.diagnose`
reads the store and names who is missing: ranks that posted a failure, ranks on this machine
whose process is gone (killed outright, so their last beat is still fresh), ranks whose beats are
stale (a stopped or hung process), ranks that never beat; when the store itself is gone or
frozen with rank 0, rank 0 by its last beat (every store call is bounded in time, so a frozen
store never hangs a rank). The trainer raises that as a
:class:`PeerFailure`. As a backstop for hangs outside a collective with a timeout, the thread
also watches this rank's own progress: when a phase has not moved for twice the collective
timeout, it writes the diagnosis as this worker's error and ends the process, so the launcher
stops (or restarts) the group instead of hanging.
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
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def _prefix() -> str:
    # Keys of an earlier attempt (before a restart) must not be read as this one's.
    from dtrain.runtime import store_namespace

    return store_namespace() + "watchdog/"


class PeerFailure(RuntimeError):
    """A collective failed because another rank died, raised or stopped responding."""


def connect_store(timeout_s: float) -> Any:
    """A client of the launcher's store (MASTER_ADDR:MASTER_PORT), or None without one."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return dist.TCPStore(  # type: ignore[attr-defined]
            host,
            int(port),
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
    except Exception:
        return None


class StoreTimeout(TimeoutError):
    """The store did not answer in time (its host is stopped, hung or cut off)."""


def bounded(call: Callable[[], T], seconds: float, what: str) -> T:
    """``call()``, given up after ``seconds``. A store client whose server process is stopped
    (SIGSTOP) or whose machine is cut off can block a call forever despite its own timeout; the
    call is left to a daemon thread and this raises :class:`StoreTimeout` instead."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=run, name="watchdog-store-call", daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise StoreTimeout(f"no answer to {what} in {seconds:.0f}s")
    if "error" in box:
        raise box["error"]
    return box["value"]


class Watchdog:
    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        heartbeat_s: float,
        timeout_s: float,
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
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

    # -- this rank -----------------------------------------------------------------------

    def start(self) -> None:
        if self.store is None:
            return
        self._beat()
        if self.rank != 0:
            # Every rank gets this far at start-up, so waiting for rank 0's first beat costs
            # nothing a collective soon after would not; it is what names rank 0 if it dies early.
            key = f"{_prefix()}hb/0"
            wait = datetime.timedelta(seconds=self.timeout_s)
            try:
                self._ask(lambda store: store.wait([key], wait), key, self.timeout_s + 1)
                self._rank0_beat = self._read(key)
            except Exception:
                pass  # rank 0 is late or gone; a collective will tell
        self._thread = threading.Thread(target=self._run, name="dtrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.heartbeat_s + 1)
            self._thread = None

    def set_phase(self, phase: str, step: int | None = None) -> None:
        """Called by the main thread at each phase change; cheap (no I/O)."""
        self.phase = phase
        if step is not None:
            self.step = step
        self._phase_since = time.monotonic()

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
        }
        key, value = f"{_prefix()}hb/{self.rank}", json.dumps(record)
        self._ask(lambda store: store.set(key, value), "a heartbeat")

    def _run(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                self._beat()
                if self.rank != 0:
                    self._rank0_beat = self._read(f"{_prefix()}hb/0") or self._rank0_beat
            except Exception:
                pass  # the store's host may be gone; a collective will tell
            stalled = time.monotonic() - self._phase_since
            if self.phase not in ("done", "idle") and stalled > 2 * self.timeout_s:
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
        for rank, beat in sorted(beats.items()):
            if rank in failed:
                continue
            if beat is None:
                parts.append(f"rank {rank} never checked in")
            elif beat["host"] == self.host and not process_alive(int(beat["pid"])):
                # A rank killed outright (kill -9, the OOM killer) still has a fresh beat.
                parts.append(
                    f"rank {rank} ({beat['host']}, pid {beat['pid']}) died: its process is "
                    f"gone (killed or crashed) after step {beat['step']} in {beat['phase']}"
                )
            elif now - beat["time"] > stale_after:
                parts.append(
                    f"rank {rank} ({beat['host']}, pid {beat['pid']}) stopped "
                    f"responding: last heartbeat {now - beat['time']:.1f}s ago at step "
                    f"{beat['step']} in {beat['phase']}"
                )
        if not parts:
            return "every other rank is still beating (the failure may be in the network)"
        return "; ".join(parts)

    def _store_lost(self, why: str, timed_out: bool, launcher_hosted: bool) -> str:
        """The diagnosis when the store cannot be reached: its host has died."""
        beat = self._rank0_beat
        if launcher_hosted or beat is None:
            host = "the launcher" if launcher_hosted else "rank 0"
            return (
                f"the job's key-value store is unreachable {why}: {host}, which hosts it, has died"
            )
        who = f"rank 0 ({beat['host']}, pid {beat['pid']})"
        where = f"after step {beat['step']} in {beat['phase']}"
        if beat["host"] == self.host and not process_alive(int(beat["pid"])):
            fate = f"died: its process is gone (killed or crashed) {where}"
        elif timed_out:  # alive but silent: stopped (SIGSTOP), hung or cut off
            fate = f"stopped responding {where}"
        else:
            fate = f"is unreachable (died, or its machine was cut off) {where}"
        return f"{who} {fate}; it hosted the job's key-value store, now unreachable {why}"

    def peer_failure(self, error: BaseException) -> PeerFailure:
        # Give a failing peer a moment to post its error (it may still be on its way out).
        time.sleep(min(1.0, self.heartbeat_s))
        text = str(error).strip()
        cause = text.splitlines()[0] if text else type(error).__name__
        cause = cause.split("] ", 1)[-1][:160]  # drop gloo's source location
        return PeerFailure(
            f"rank {self.rank} ({self.host}) at step {self.step} in {self.phase}: a collective "
            f"failed: {self.diagnose()} (collective error: {cause})"
        )


def process_alive(pid: int) -> bool:
    """Whether a process of this machine is alive (a zombie, dead but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


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
