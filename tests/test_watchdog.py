"""The watchdog's progress file and the words of its diagnosis, without training processes:
the peers' heartbeats are written into a real store by hand."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtrain.fault import progress
from dtrain.fault.progress import (
    Progress,
    ProgressFile,
    progress_path,
    read_progress,
    sweep_progress_files,
)
from dtrain.fault.watchdog import Watchdog
from dtrain.testing import loopback_store
from tests.conftest import REPO


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A job store on loopback, as the launcher's rank 0 would host it."""
    server, port = loopback_store(10)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # keys under dtrain/
    yield server


HB0, HB1 = "dtrain/watchdog/hb/0", "dtrain/watchdog/hb/1"  # the keys of ranks 0 and 1


def beat_of(**fields: Any) -> str:
    return json.dumps({"step": 0, "phase": "start", "time": time.time(), **fields})


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_the_progress_file_reads_back_the_last_phase_and_is_removed_on_close(
    tmp_path: Path,
) -> None:
    path = progress_path(3, folder=str(tmp_path))
    mine = ProgressFile(path, 3, keep_s=60.0)
    assert read_progress(path, os.getpid()) is None  # nothing recorded yet
    mine.write(7, "data", 1.5)
    mine.write(7, "forward_backward", 2.5)
    assert read_progress(path, os.getpid()) == Progress(7, "forward_backward", 2.5, False)
    mine.write(8, "data", 3.5)  # the other slot now holds the newest record
    assert read_progress(path, os.getpid()) == Progress(8, "data", 3.5, False)
    assert read_progress(path, os.getpid() + 1) is None  # not that process's file
    mine.close()
    assert not os.path.exists(path)
    assert read_progress(path, os.getpid()) is None
    mine.write(9, "data", 4.5)  # after close: ignored, never an error
    (tmp_path / "garbage").write_bytes(b"x" * 300)
    assert read_progress(str(tmp_path / "garbage"), os.getpid()) is None


class _KilledMidWrite:
    """Stands in for the record body's packer: the process "dies" after the record's odd
    sequence number is written and before its body is."""

    size = progress._BODY.size

    def pack_into(self, *args: object) -> None:
        raise KeyboardInterrupt


def test_a_torn_write_is_recognised_and_the_record_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = progress_path(0, folder=str(tmp_path))
    mine = ProgressFile(path, 0, keep_s=60.0)
    mine.write(5, "clip_grad_norm", 1.0)
    mine.write(5, "optimizer", 2.0)
    with monkeypatch.context() as patch:
        patch.setattr(progress, "_BODY", _KilledMidWrite())
        with pytest.raises(KeyboardInterrupt):
            mine.write(6, "data", 3.0)
    last = read_progress(path, os.getpid())
    assert last == Progress(5, "optimizer", 2.0, interrupted=True)
    assert last.where() == "at step 5, as it left optimizer"
    mine.close()


_KILLED_CHILD = """
import os, signal, sys, time
from dtrain.fault.progress import ProgressFile
mine = ProgressFile(sys.argv[1], 1, keep_s=60.0)
for step in range(1, 27):
    for phase in ("data", "all_reduce(item count)", "forward_backward"):
        mine.write(step, phase, time.monotonic())
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_local_peer_is_named_with_its_exact_step_and_its_file_removed(
    tmp_path: Path, store: Any
) -> None:
    path = progress_path(1, folder=str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, path], cwd=REPO)
    assert child.wait(timeout=60) == -9
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    # Its last beat is from start-up, as in a run whose steps take milliseconds.
    beat = beat_of(host=watchdog.host, pid=child.pid, time=time.time() - 0.8, progress=path)
    store.set(HB1, beat)
    expected = (
        f"rank 1 ({watchdog.host}, pid {child.pid}) died: its process is gone (killed or "
        "crashed) at step 26 in forward_backward"
    )
    assert watchdog.diagnose() == expected
    assert not os.path.exists(path)  # read and removed: no other rank here needs it
    assert watchdog.diagnose() == expected  # and a second diagnosis says the same


def test_a_killed_local_peer_without_a_progress_file_is_not_placed_at_its_stale_step(
    store: Any,
) -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    pid = dead_pid()
    store.set(HB1, beat_of(host=watchdog.host, pid=pid, time=time.time() - 2.5))
    assert re.fullmatch(
        rf"rank 1 \({watchdog.host}, pid {pid}\) died: its process is gone \(killed or "
        r"crashed\) at an unknown step: its last heartbeat, 2\.\ds old, was at step 0 in start",
        watchdog.diagnose(),
    )


def test_a_silent_remote_peer_is_reported_by_the_age_of_its_last_heartbeat(store: Any) -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    beat = beat_of(
        host="elsewhere", pid=4121, step=3, phase="forward_backward", time=time.time() - 4.1
    )
    store.set(HB1, beat)
    assert re.fullmatch(
        r"rank 1 \(elsewhere, pid 4121\) stopped responding: its last heartbeat, 4\.[01]s old, "
        r"was at step 3 in forward_backward",
        watchdog.diagnose(),
    )


def test_a_silent_local_peer_is_reported_at_the_phase_it_is_stuck_in(
    tmp_path: Path, store: Any
) -> None:
    # A stopped (SIGSTOP) or hung rank of this machine: alive, its file says where it is.
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    path = progress_path(1, folder=str(tmp_path))
    stuck = ProgressFile(path, 1, keep_s=60.0)
    stuck.write(5, "forward_backward", time.monotonic() - 6.0)
    beat = beat_of(host=watchdog.host, pid=os.getpid(), time=time.time() - 5.0, progress=path)
    store.set(HB1, beat)
    assert re.fullmatch(
        rf"rank 1 \({watchdog.host}, pid {os.getpid()}\) stopped responding: no progress for "
        r"6\.\ds, at step 5 in forward_backward \(last heartbeat 5\.\ds ago\)",
        watchdog.diagnose(),
    )
    assert os.path.exists(path)  # alive: its file is its own to remove
    stuck.close()


def test_rank0_lost_with_its_store_is_reported_by_the_age_of_its_kept_beat(store: Any) -> None:
    watchdog = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=5.0)
    watchdog._rank0_beat = json.loads(
        beat_of(host="elsewhere", pid=812, step=9, phase="data", time=time.time() - 4.0)
    )
    text = watchdog._store_lost("(StoreTimeout: ...)", True, False)
    assert re.fullmatch(
        r"rank 0 \(elsewhere, pid 812\) stopped responding: its last heartbeat, 4\.[01]s old, "
        r"was at step 9 in data; it hosted the job's key-value store, now unreachable "
        r"\(StoreTimeout: \.\.\.\)",
        text,
    )


def test_a_rank_beats_soon_after_its_step_changes_and_removes_its_file_at_stop(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")  # no start-up sweep of the machine's shared memory
    watchdog = Watchdog(0, 2, heartbeat_s=30.0, timeout_s=60.0)
    watchdog.start()
    try:
        first = json.loads(store.get(HB0))
        path = first["progress"]
        assert first["step"] == 0 and os.path.exists(path)
        watchdog.set_phase("forward_backward", 7)
        assert read_progress(path, os.getpid()) is not None
        changed = time.monotonic()
        while json.loads(store.get(HB0))["step"] != 7:
            assert time.monotonic() - changed < 3.0, "no prompt beat (the next is due in 30s)"
            time.sleep(0.02)
    finally:
        watchdog.stop()
    assert not os.path.exists(path)
    watchdog.set_phase("done")  # after stop: no file to write, never an error


def test_the_sweep_removes_only_files_no_rank_can_still_need(tmp_path: Path) -> None:
    folder, dead = str(tmp_path), dead_pid()

    def left_by(rank: int, pid: int, keep_s: float) -> str:
        path = progress_path(rank, pid=pid, folder=folder)
        ProgressFile(path, rank, keep_s).close(remove=False)  # as a killed process leaves it
        return path

    expired = left_by(0, dead, keep_s=0.0)  # dead, and its job's ranks are done with it
    recent = left_by(1, dead, keep_s=3600.0)  # dead, but a rank of its job may yet read it
    alive = left_by(2, os.getpid(), keep_s=0.0)
    cut_short = progress_path(3, pid=dead, folder=folder)
    Path(cut_short).write_bytes(b"dtr")
    os.utime(cut_short, (time.time() - 7200, time.time() - 7200))
    remote = os.path.join(folder, f"dtrain-progress-otherhost-pid{dead}-rank0")
    unrelated = os.path.join(folder, "unrelated")
    for path in (remote, unrelated):
        Path(path).write_bytes(b"")
    time.sleep(0.01)
    assert sweep_progress_files(folder) == 2
    kept = {os.path.basename(p) for p in (recent, alive, remote, unrelated)}
    assert set(os.listdir(folder)) == kept
    assert not {os.path.basename(p) for p in (expired, cut_short)} & set(os.listdir(folder))
