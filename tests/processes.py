"""Start ``dtrain train`` as a user would and watch its processes -- for system tests and
benchmarks.

:class:`Launch` runs the real CLI (torch's elastic agent, real worker processes) with every
output line kept together with the monotonic time it arrived, and ends every process it started
(on :meth:`Launch.close`, or when this process exits). The other functions read ``/proc``
(Linux only): a process's descendants, its rank, whether it is still alive.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import IO, Any

_LIVE: set[Launch] = set()


class Launch:
    """One ``python -m dtrain train CONFIG --nproc N ...``, started in ``cwd`` (the repository
    root, for a task such as ``tests.tasks:...`` to import in the workers); after
    ``exec_prefix`` when given (``Hosts.exec_prefix(i)``: in host i, see ``tests/hosts.py``)."""

    def __init__(
        self,
        config: Path,
        nproc: int,
        *args: str,
        cwd: Path | None = None,
        exec_prefix: Sequence[str] = (),
    ) -> None:
        self.command = [
            *exec_prefix,
            sys.executable,
            "-m",
            "dtrain",
            "train",
            str(config),
            "--nproc",
            str(nproc),
            *args,
        ]
        # The output is kept beside the config (job-1.log, job-2.log, ...) for a post-mortem.
        number = 1
        while (config.parent / f"{config.stem}-{number}.log").exists():
            number += 1
        self.log_path = config.parent / f"{config.stem}-{number}.log"
        self.log_path.touch()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(stream,), daemon=True)
            for stream in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()
        self.ended: float | None = None  # monotonic and wall-clock time of the exit
        self.ended_wall: float | None = None
        self.known_workers: set[int] = set()
        _LIVE.add(self)

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self._lock:
                self.lines.append((time.monotonic(), line.rstrip("\n")))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def workers(self) -> list[int]:
        pids = worker_pids(self.proc.pid) if self.alive() else []
        self.known_workers.update(pids)
        return pids

    def inplace_workers(self) -> dict[int, int]:
        """Under ``fault.recovery = 'inplace'``: member id -> pid of its worker process."""
        found: dict[int, int] = {}
        for pid in self.workers():
            try:
                with open(f"/proc/{pid}/environ", "rb") as fh:
                    environ = fh.read().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(b"DTRAIN_INPLACE_MEMBER="):
                    found[int(item.split(b"=", 1)[1])] = pid
        return found

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when it is still running after ``timeout`` seconds."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None
        if self.ended is None:
            self.ended = time.monotonic()
            self.ended_wall = time.time()
        for reader in self._readers:
            reader.join(timeout=5)
        return code

    def text(self) -> str:
        with self._lock:
            return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str, since: float = 0.0) -> tuple[float, re.Match[str]] | None:
        """The time and match of the first line (arrived after ``since``) matching."""
        regex = re.compile(pattern)
        with self._lock:
            lines = list(self.lines)
        for arrived, line in lines:
            if arrived >= since:
                match = regex.search(line)
                if match:
                    return arrived, match
        return None

    def kill_all(self) -> None:
        """SIGKILL the launcher and everything under it at once (a machine that loses power)."""
        pids = [*children_of(self.proc.pid), self.proc.pid] if self.alive() else []
        pids += [p for p in self.known_workers if p not in pids]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.wait(timeout=30)
        wait_gone(pids, 30)

    def close(self) -> None:
        if self.alive():
            self.kill_all()
        for pid in self.known_workers:  # a worker the launcher lost track of
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()
        with self._lock:
            self.log_path.write_text(
                "\n".join(f"{t - self.started:9.3f} {line}" for t, line in self.lines) + "\n"
            )
        _LIVE.discard(self)


@atexit.register
def _kill_leftovers() -> None:
    for launch in list(_LIVE):
        launch.close()


def children_of(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc; Linux only)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def worker_pids(launcher_pid: int) -> list[int]:
    """The ``dtrain.worker`` processes started under a ``dtrain train`` process."""
    pids = []
    for pid in children_of(launcher_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except OSError:
            continue
        if b"dtrain.worker" in cmdline:
            pids.append(pid)
    return sorted(pids)


def rank_of(pid: int) -> int:
    """The RANK a worker process was started with (-1 when unknown)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as fh:
            for item in fh.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return -1


def pid_alive(pid: int) -> bool:
    """True for a live (or stopped) process, False once it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            state = fh.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def metrics_records(run_dir: Path) -> list[dict[str, Any]]:
    """The records of a run's ``metrics.jsonl`` so far (a line still being written is left
    out)."""
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def started_at(pid: int) -> float:
    """When a process started, wall clock (``time.time()``; the kernel counts clock ticks of
    10 ms since boot)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22 of proc(5), starttime (the name in brackets is field 2)
    with open("/proc/stat") as fh:
        boot = next(float(line.split()[1]) for line in fh if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def wait_gone(pids: Iterable[int], timeout: float) -> float | None:
    """Seconds until none of ``pids`` is alive, or None after ``timeout``."""
    started = time.monotonic()
    pending = list(pids)
    while True:
        pending = [p for p in pending if pid_alive(p)]
        if not pending:
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            return None
        time.sleep(0.05)


def processes_of(run_dir: Path) -> list[int]:
    """Live processes whose command line names ``run_dir`` (the launcher and its workers)."""
    needle = str(run_dir).encode()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if needle in fh.read() and pid_alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
    return found
