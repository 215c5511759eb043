"""What benchmarks/chaos.py and benchmarks/bench_checkpoint.py share: starting ``dtrain train``
as a user would (the real CLI, torch's elastic agent, real worker processes), watching its
output with timestamps, killing every process it started, and writing a section of
docs/benchmarks.md."""

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
from collections.abc import Iterable, Mapping
from pathlib import Path

from _report import machine
from dtrain.testing import children_of, worker_pids

REPO = Path(__file__).resolve().parent.parent

_LIVE: set[Launch] = set()


def write_config(path: Path, run_dir: Path, **sections: Mapping[str, object]) -> Path:
    """A TOML config: ``write_config(p, d, train={"steps": 20}, task={...})``."""
    run = {"dir": str(run_dir), **sections.get("run", {})}
    lines = ["[run]", *(f"{k} = {json.dumps(v)}" for k, v in run.items())]
    for name, values in sections.items():
        if name != "run":
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


class Launch:
    """One ``python -m dtrain train CONFIG --nproc N ...`` started from the repository root
    (so that ``tests.tasks:...`` imports in the workers), with every output line kept together
    with the monotonic time it arrived."""

    def __init__(self, config: Path, nproc: int, *args: str) -> None:
        self.command = [
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
            cwd=REPO,
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

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
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


def metrics_step(run_dir: Path) -> int:
    """The highest step in RUN_DIR/metrics.jsonl so far (0 when none)."""
    path = run_dir / "metrics.jsonl"
    best = 0
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        try:
            best = max(best, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            pass  # a line being written
    return best


def wait_for_step(run_dir: Path, step: int, launch: Launch, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not launch.alive():
            raise RuntimeError(
                f"the run ended (exit {launch.returncode}) before step {step}:\n"
                + launch.text()[-3000:]
            )
        if metrics_step(run_dir) >= step:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the run did not reach step {step} within {timeout:.0f}s")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def machine_line() -> str:
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{machine()}; load average {load} when it finished"
