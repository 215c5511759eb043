"""Who holds a run folder: one live job at a time (the protocol, on a disk and in an object
store: docs/fault-tolerance.md, "The run folder").

A stale hold is taken over only by renaming it aside first (on a store: replacing it only while
it is still the version found stale, ``If-Match``), so that of two jobs taking over at once one
wins and the other is refused. On this machine a hold is stale when its launcher's pid *and*
that process's start time are gone (a reused pid is not taken for it); from another machine
when its renewals have stopped for :data:`LEASE_S` seconds. A store that ignores conditional
writes cannot keep two jobs apart: :func:`dtrain.checkpoint.rundir.check_store` says so.

``hold.json`` is the user's alone to read (mode 0600 from its creation, whatever the umask).
The hold's token names the job to its workers (:func:`job_id`): it goes into each
checkpoint's ``meta.json``, where retention and restarts tell this job's checkpoints from
others'. Under plain ``torchrun`` (no hold) the job is its rendezvous id.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.fsutil import fsync_dir, write_atomic
from dtrain.process_exit import process_alive
from dtrain.storage.objects import Location, NoConditionalWrites, ObjectPath

HOLD_FILE = "hold.json"
JOB_ID_ENV = "DTRAIN_JOB_ID"  # the hold's token, set by the launcher for its workers
RENEW_S = 5.0  # how often a launcher renews its hold
# The hold's token names the job (its checkpoints, its workers): the user's alone to read.
# Every write of the hold creates the file with this mode; a chmod after it would leave the
# token readable for a moment, and a renewal would undo it.
HOLD_MODE = 0o600
LEASE_S = 30.0  # a hold from another machine not renewed for this long is stale


def say(text: str) -> None:
    """A line for the user on the launcher's console (stderr, beside its other words)."""
    print(f"dtrain: {text}", file=sys.stderr, flush=True)


def launch_config_path(run_dir: Path, host: str, pid: int) -> Path:
    """Where a launcher keeps, while it holds the folder, the config its own workers read
    (``RUN_DIR/config.toml`` is the resolved config of record, written by rank 0)."""
    return run_dir / f".launch-{host}-{pid}.toml"


def job_id() -> str:
    """This job's id, as its launcher gave it to the workers: the hold's token under ``dtrain
    train``; under plain ``torchrun``, its rendezvous id (none: an empty string)."""
    token = os.environ.get(JOB_ID_ENV, "")
    if token:
        return token
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun:{run_id}" if run_id and run_id != "none" else ""


@dataclass(frozen=True)
class HoldRecord:
    job: str  # run id@rendezvous endpoint, or, for a job of one machine, run id@host:pid
    token: str
    run_id: str
    host: str
    boot_id: str  # the machine, whatever its name (network namespaces share one)
    pid: int
    pid_started: int  # the launcher's start time (clock ticks after boot), 0 if unknown
    since: float
    renewals: int = 0

    def who(self) -> str:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.since))
        return f"job {self.run_id!r} (host {self.host}, pid {self.pid}, since {since})"


class Hold:
    """A run folder this launcher holds (or shares, with the other machines of its job), renewed
    by a daemon thread until :meth:`release`."""

    def __init__(self, path: Location, record: HoldRecord, joined: bool) -> None:
        self.path = path
        self.record = record
        self.joined = joined
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew, name="dtrain-hold", daemon=True)
        self._thread.start()

    @property
    def token(self) -> str:
        return self.record.token

    def _renew(self) -> None:
        renewals = self.record.renewals
        warned = False
        while not self._stop.wait(RENEW_S):
            current = read_hold(self.path)
            if current is not None and current.job != self.record.job:
                if not warned:  # taken over, which a live job's hold never is: say so once
                    say(f"warning: {self.path} is now held by {current.who()}")
                    warned = True
                continue
            renewals = max(renewals, current.renewals if current else 0) + 1
            record = replace(self.record, renewals=renewals)
            # An OSError: the folder's storage is away for a moment; the next renewal tries again.
            with contextlib.suppress(OSError):
                if current is None:
                    _create(self.path, record)
                elif isinstance(self.path, ObjectPath):
                    self.path.write_bytes(json.dumps(asdict(record)).encode())
                else:
                    write_atomic(self.path, json.dumps(asdict(record)), mode=HOLD_MODE)

    def release(self) -> None:
        """Stop renewing and remove the hold if it is still this job's (the other machines of
        a job recreate it at their next renewal while they run)."""
        self._stop.set()
        self._thread.join(timeout=RENEW_S)
        current = read_hold(self.path)
        if current is not None and current.token == self.token:
            with contextlib.suppress(OSError):
                self.path.unlink()


def read_hold(path: Location) -> HoldRecord | None:
    """The hold in ``path``; None where there is none, or it is no hold."""
    try:
        data: Any = json.loads(path.read_text())
        return HoldRecord(**{k: data[k] for k in HoldRecord.__dataclass_fields__ if k in data})
    except (OSError, ValueError, TypeError):
        return None


def take_hold(
    run_dir: Location,
    run_id: str,
    rdzv_endpoint: str,
    lease_s: float = LEASE_S,
    local_dir: Path | None = None,
) -> Hold:
    """Hold ``run_dir`` for this job, or raise a :class:`UserError` naming the live job that
    holds it. Joins the hold of another machine of the same job; takes over a stale one.
    ``local_dir``: where this machine's launch files are (default: the run folder)."""
    launch_dir = local_dir if local_dir is not None else Path(str(run_dir))
    host = socket.gethostname()
    pid = os.getpid()
    key = f"{run_id}@{rdzv_endpoint}" if rdzv_endpoint else f"{run_id}@{host}:{pid}"
    mine = HoldRecord(
        job=key,
        token=uuid.uuid4().hex,
        run_id=run_id,
        host=host,
        boot_id=_boot_id(),
        pid=pid,
        pid_started=_started(pid),
        since=time.time(),
    )
    path = run_dir / HOLD_FILE
    for _ in range(20):  # each round ends in a hold, a refusal, or someone else's move
        with contextlib.suppress(FileExistsError):
            _create(path, mine)
            return Hold(path, mine, joined=False)
        current = read_hold(path)
        if current is None:
            _set_aside_unreadable(path)
            continue
        if current.job == key:  # another machine of this job took it first
            # Renewed as this launcher's from now on (its token stays the job's).
            here = replace(current, host=host, pid=pid, boot_id=mine.boot_id)
            return Hold(path, replace(here, pid_started=mine.pid_started), joined=True)
        if _alive(current, path, lease_s):
            raise UserError(
                f"run.dir {run_dir} is in use by {current.who()}; wait for that job to end, "
                "stop it, or choose another run.dir (a job of several machines shares one "
                "folder only with the same --run-id and --rdzv-endpoint)"
            )
        if isinstance(path, ObjectPath):  # no rename there: the hold is replaced in place
            if _take_over_object(path, current, mine):
                say(f"{path} was held by {current.who()}, which is gone; taking it over")
                return Hold(path, mine, joined=False)
            continue
        if _take_over(path, current):
            # What the gone launcher left beside its hold: its workers' config.
            launch_config_path(launch_dir, current.host, current.pid).unlink(missing_ok=True)
            say(f"{path} was held by {current.who()}, which is gone; taking it over")
    raise UserError(f"run.dir {run_dir}: could not take {HOLD_FILE}: other jobs keep taking it")


def _create(path: Location, record: HoldRecord) -> None:
    """Create the hold whole or not at all (raises FileExistsError if one exists): written
    beside, then linked into place (atomic, and safe on NFS); in a store, one conditional
    write."""
    if isinstance(path, ObjectPath):
        data = json.dumps(asdict(record)).encode()
        try:
            path.create(data)
        except NoConditionalWrites:
            # Look, then write: two jobs starting in the same instant may both see none (the
            # launcher's write probe warned about such a store).
            if path.exists():
                raise FileExistsError(str(path)) from None
            path.write_bytes(data)
        return
    tmp = path.with_name(f".{path.name}.{record.token}.{os.getpid()}")
    write_atomic(tmp, json.dumps(asdict(record)), mode=HOLD_MODE)
    try:
        os.link(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent)


def _take_over_object(path: ObjectPath, stale: HoldRecord, mine: HoldRecord) -> bool:
    """Replace the stale hold in a store by ``mine`` only while it is still the stale one
    (its version, read before its content: a newer content fails the condition); False when
    another job moved first."""
    try:
        version = path.etag()
    except FileNotFoundError:
        return False
    seen = read_hold(path)
    if seen is None or seen.token != stale.token:
        return False
    data = json.dumps(asdict(mine)).encode()
    try:
        return path.replace_if(data, version)
    except NoConditionalWrites:  # as in _create: unguarded, and warned about
        path.write_bytes(data)
        return True


def _take_over(path: Path, stale: HoldRecord) -> bool:
    """Move the stale hold aside; False when another job moved or replaced it first."""
    aside = path.with_name(f".{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    moved = read_hold(aside)
    if moved is not None and moved.token != stale.token:
        # A fresh hold replaced the stale one between the read and the rename: put it back.
        with contextlib.suppress(FileExistsError):
            os.link(aside, path)
        aside.unlink(missing_ok=True)
        return False
    aside.unlink(missing_ok=True)
    return True


def _set_aside_unreadable(path: Location) -> None:
    """A hold file that is not a hold (damaged, or from something else): moved aside once it
    has stayed so for a moment (a hold is never seen half-written: it is linked whole)."""
    time.sleep(0.2)
    if isinstance(path, ObjectPath):
        if path.exists() and read_hold(path) is None:
            path.unlink(missing_ok=True)
        return
    if path.exists() and read_hold(path) is None:
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, path.with_name(f".{path.name}.unreadable-{uuid.uuid4().hex}"))


def _alive(record: HoldRecord, path: Location, lease_s: float) -> bool:
    """Whether the job holding the folder still runs."""
    if record.boot_id and record.boot_id == _boot_id():
        # This machine: its launcher's process, if it is the same process.
        return _started(record.pid) == record.pid_started if process_alive(record.pid) else False
    say(
        f"{path} is held by {record.who()}, on another machine; waiting up to {lease_s:.0f}s to "
        "see whether that job still renews it"
    )
    deadline = time.monotonic() + lease_s
    while time.monotonic() < deadline:
        time.sleep(min(1.0, lease_s / 10))
        now = read_hold(path)
        if now is None or now.token != record.token:
            return False  # released, or taken by another job: look again
        if now.renewals != record.renewals:
            return True
    return False


def _started(pid: int) -> int:
    """A process's start time in clock ticks after boot (Linux), 0 where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) is in parentheses and may hold spaces: count after it.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[19]) if len(fields) > 19 else 0


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return socket.gethostname()
