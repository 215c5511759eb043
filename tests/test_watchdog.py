"""The liveness record, the hang backstop and the words of the watchdog's diagnosis, without
training processes: the peers' records are written into a real store (and their files) by
hand."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dtrain.dist import sealed_store
from dtrain.dist.store_link import StoreTimeout
from dtrain.fault import liveness
from dtrain.fault.liveness import (
    Liveness,
    LivenessFile,
    Speed,
    liveness_path,
    read_liveness,
)
from dtrain.fault.watchdog import Watchdog
from tests.conftest import REPO
from tests.ranks import loopback_store


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A job store on loopback, as the launcher's rank 0 would host it."""
    server, port = loopback_store(10)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # keys under dtrain/
    yield server


HB0, HB1 = "dtrain/watchdog/hb/0", "dtrain/watchdog/hb/1"  # the keys of ranks 0 and 1


def beat_of(rank: int = 1, **fields: Any) -> str:
    """A rank's record as its watchdog mirrors it into the store (sealed there:
    ``sealed_store.put``); its phase began when it was last stamped alive (``alive_at``,
    default now)."""
    alive = fields.pop("alive_at", time.time())
    record = {
        "rank": rank,
        "host": "elsewhere",
        "pid": 4121,
        "attempt": 0,
        "world_size": 2,
        "step": 0,
        "phase": "start",
        "phase_since": alive,
        "progress": 0,
        "progress_at": alive,
        "alive_at": alive,
        **fields,
    }
    return json.dumps(record)


def mine(path: Path | None, rank: int = 0, pid: int | None = None) -> LivenessFile:
    host = socket.gethostname()
    pid = os.getpid() if pid is None else pid
    return LivenessFile(path, rank=rank, world_size=2, attempt=0, host=host, pid=pid)


def dead_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


AGE = r"(\d+\.\d)"  # where an age (seconds, one decimal) stands in an expected diagnosis


def assert_ages(pattern: str, text: str, *ages: tuple[float, float]) -> None:
    """``text`` matches ``pattern`` and each ``AGE`` in it lies within its ``(age the record
    had when written, time.monotonic() then)``: the age printed grows with the time the test
    took to get there (seconds under load), so it is bounded by the clock, not fixed."""
    now = time.monotonic()
    match = re.fullmatch(pattern, text)
    assert match, text
    for printed, (age, since) in zip(match.groups(), ages, strict=True):
        # one decimal: rounding moves it by at most 0.05 either way
        assert age - 0.05 <= float(printed) <= age + (now - since) + 0.05, (printed, text)


class DiagnosisClock:
    """The clock of the diagnosis (``dtrain.fault.diagnosis.time``) made up: its sleeps
    advance it and return at once, so how long a diagnosis waits -- and after how many
    readings of the store it names a rank -- is the same on any machine, however loaded."""

    def __init__(self) -> None:
        self.elapsed = 0.0  # seconds slept
        self.sleeps = 0
        self.start = time.time()

    def time(self) -> float:
        return self.start + self.elapsed

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed

    def sleep(self, seconds: float) -> None:
        self.elapsed += seconds
        self.sleeps += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> DiagnosisClock:
    made_up = DiagnosisClock()
    monkeypatch.setattr("dtrain.fault.diagnosis.time", made_up)
    return made_up


def test_the_liveness_file_reads_back_the_record_and_keeps_it_after_close(tmp_path: Path) -> None:
    path = liveness_path(tmp_path, 3)
    record = LivenessFile(path, rank=3, world_size=4, attempt=1, host="node-a", pid=os.getpid())
    first = read_liveness(path, os.getpid())
    assert first is not None and (first.step, first.phase, first.alive_at) == (0, "start", 0.0)
    assert (first.rank, first.world_size, first.attempt, first.host) == (3, 4, 1, "node-a")
    record.set_phase("data", 7, 1.5)
    record.set_phase("evaluate", 7, 2.5)
    record.mark_progress(3.0)
    record.mark_progress(3.5)
    now = read_liveness(path, os.getpid())
    assert now is not None and now.where() == "at step 7 in evaluate"
    assert (now.phase_since, now.progress, now.progress_at) == (2.5, 2, 3.5)
    record.set_phase("data", 8, 4.5)  # the other slot now holds the newest record; no progress
    record.stamp(5.0, Speed("tokens", items_per_s=800.0, step_s=0.25, memory_bytes=None))
    now = read_liveness(path, os.getpid())
    assert now is not None and now.where() == "at step 8 in data"
    assert (now.phase_since, now.progress, now.progress_at) == (4.5, 0, 4.5)
    assert (now.alive_at, now.item_name, now.items_per_s, now.step_s) == (5.0, "tokens", 800, 0.25)
    assert now.memory_bytes is None and now.steps_per_s is None and not now.interrupted
    # What the watchdog mirrors into the store is the same record, field for field.
    assert Liveness.from_dict(json.loads(json.dumps(dataclasses.asdict(record.record())))) == now
    assert read_liveness(path, os.getpid() + 1) is None  # not that process's file
    record.close()
    assert read_liveness(path, os.getpid()) == now  # the run folder keeps the last word
    record.set_phase("data", 9, 6.5)  # after close: ignored, never an error
    record.mark_progress(7.0)
    (tmp_path / "garbage").write_bytes(b"x" * 1000)
    assert read_liveness(tmp_path / "garbage") is None
    assert read_liveness(tmp_path / "missing") is None


class _KilledMidWrite:
    """Stands in for the record body's packer: the process "dies" after the record's odd
    sequence number is written and before its body is."""

    size = liveness._PHASE_BODY.size

    def pack_into(self, *args: object) -> None:
        raise KeyboardInterrupt


def test_a_torn_write_is_recognised_and_the_record_before_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = liveness_path(tmp_path, 0)
    record = mine(path)
    record.set_phase("clip_grad_norm", 5, 1.0)
    record.set_phase("optimizer", 5, 2.0)
    before = read_liveness(path, os.getpid())
    assert before is not None
    with monkeypatch.context() as patch:
        patch.setattr(liveness, "_PHASE_BODY", _KilledMidWrite())
        with pytest.raises(KeyboardInterrupt):
            record.set_phase("data", 6, 3.0)
    last = read_liveness(path, os.getpid())
    assert last == dataclasses.replace(before, interrupted=True)
    assert last is not None and last.where() == "at step 5, as it left optimizer"
    record.close()


def test_a_rank_that_starts_again_replaces_its_record_whole(tmp_path: Path) -> None:
    path, old_pid = liveness_path(tmp_path, 0), dead_pid()
    old = mine(path, pid=old_pid)
    old.set_phase("forward_backward", 26, time.time())
    old.close()  # as an attempt killed at step 26 leaves it
    new = LivenessFile(path, rank=0, world_size=2, attempt=1, host="h", pid=os.getpid())
    record = read_liveness(path)
    assert record is not None and (record.attempt, record.pid, record.step) == (1, os.getpid(), 0)
    assert read_liveness(path, old_pid) is None  # nobody takes it for the old attempt's
    assert [p.name for p in path.parent.iterdir()] == ["rank0"]  # no temporary file left
    new.close()


def test_a_record_that_cannot_be_mapped_stays_in_memory_and_reaches_the_store(
    tmp_path: Path, store: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    run_dir.write_text("a file where the run folder should be")
    watchdog = Watchdog(0, 2, heartbeat_s=30.0, timeout_s=60.0, run_dir=run_dir)
    err = capsys.readouterr().err
    assert err.startswith("dtrain: warning: rank 0: cannot map ") and "hang checks go on" in err
    assert watchdog.liveness.path is None
    watchdog.start()
    try:
        watchdog.set_phase("forward_backward", 7)
        assert watchdog.liveness.record().where() == "at step 7 in forward_backward"
        watchdog.tick()
        assert watchdog.check_hang(time.monotonic()) is None
    finally:
        watchdog.stop()
    beat = Liveness.from_dict(sealed_store.read_json(store, HB0, dict))
    assert beat is not None and beat.pid == os.getpid()  # the start-up beat went through


_KILLED_CHILD = """
import os, signal, socket, sys, time
from pathlib import Path
from dtrain.fault.liveness import LivenessFile
mine = LivenessFile(Path(sys.argv[1]), rank=1, world_size=2, attempt=0,
                    host=socket.gethostname(), pid=os.getpid())
for step in range(1, 27):
    for phase in ("data", "all_reduce(item count)", "forward_backward"):
        mine.set_phase(phase, step, time.time())
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_local_peer_is_named_with_its_exact_step(tmp_path: Path, store: Any) -> None:
    path = liveness_path(tmp_path, 1)
    child = subprocess.Popen([sys.executable, "-c", _KILLED_CHILD, str(path)], cwd=REPO)
    assert child.wait(timeout=60) == -9
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0, run_dir=tmp_path)
    # Its last beat is from start-up, as in a run whose steps take milliseconds.
    beat = beat_of(host=watchdog.host, pid=child.pid, alive_at=time.time() - 0.8)
    sealed_store.put(store, HB1, beat)
    expected = (
        f"rank 1 ({watchdog.host}, pid {child.pid}) died: its process is gone (killed or "
        "crashed) at step 26 in forward_backward"
    )
    assert watchdog.diagnose() == expected
    assert watchdog.diagnose() == expected  # and a second diagnosis says the same
    record = read_liveness(path, child.pid)  # the run folder keeps where it died
    assert record is not None and record.where() == "at step 26 in forward_backward"


def test_a_killed_local_peer_without_its_record_is_not_placed_at_its_stale_step(
    tmp_path: Path, store: Any
) -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0, run_dir=tmp_path)
    pid = dead_pid()
    # The file there is another process's (an earlier attempt's): not this rank's record.
    other = mine(liveness_path(tmp_path, 1), rank=1, pid=pid + 1)
    other.set_phase("forward_backward", 40, time.time())
    written = time.monotonic()
    sealed_store.put(store, HB1, beat_of(host=watchdog.host, pid=pid, alive_at=time.time() - 2.5))
    assert_ages(
        rf"rank 1 \({watchdog.host}, pid {pid}\) died: its process is gone \(killed or "
        rf"crashed\) at an unknown step: its last heartbeat, {AGE}s old, was at step 0 in start",
        watchdog.diagnose(),
        (2.5, written),
    )
    other.close()


def test_a_silent_remote_peer_is_reported_by_the_age_of_its_last_heartbeat(store: Any) -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    written = time.monotonic()
    beat = beat_of(pid=4121, step=3, phase="forward_backward", alive_at=time.time() - 4.1)
    sealed_store.put(store, HB1, beat)
    assert_ages(
        rf"rank 1 \(elsewhere, pid 4121\) stopped responding: its last heartbeat, {AGE}s old, "
        r"was at step 3 in forward_backward",
        watchdog.diagnose(),
        (4.1, written),
    )


def test_a_remote_peer_killed_a_moment_ago_is_named_as_killed_once_its_beats_stop(
    store: Any, clock: DiagnosisClock
) -> None:
    # A rank on another machine is kill -9'd: its socket closes at once (the collective fails
    # with "Connection reset by peer"), while its last beat is still fresh -- the diagnosis
    # said "every other rank is still beating (the failure may be in the network)".
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    beat = beat_of(pid=4121, step=7, phase="forward_backward", alive_at=clock.time() - 0.3)
    sealed_store.put(store, HB1, beat)
    words = watchdog.diagnose(closed=True)
    # The store is read every 0.5 s until the beat is stale (3 heartbeats, 3 s, old), and the
    # rank named at that reading: the 7th, 3.0 s in, its beat 3.3 s old -- before the
    # diagnosis gives up on it (3.5 s) and long before any collective timeout.
    assert words == (
        "rank 1 (elsewhere, pid 4121) died: killed or crashed (its connection closed, it "
        "posted no error, and its heartbeats stopped): its last heartbeat, 3.3s old, was "
        "at step 7 in forward_backward"
    ), words
    assert (clock.sleeps, clock.elapsed) == (6, 3.0)


def test_a_peer_seen_dead_on_its_machine_is_named_as_killed_at_once_on_the_others(
    tmp_path: Path, store: Any, clock: DiagnosisClock
) -> None:
    # Machines other than the dead rank's can only watch its beats go stale (seconds, in which
    # rank 0 may end and take the store with it: they named rank 0). Its own machine sees the
    # process gone and posts it; another machine names it from that post at its first reading.
    local = Watchdog(0, 3, heartbeat_s=1.0, timeout_s=5.0, run_dir=tmp_path)
    pid = dead_pid()
    sealed_store.put(store, "dtrain/watchdog/hb/1", beat_of(host=local.host, pid=pid, step=5))
    sealed_store.put(store, "dtrain/watchdog/hb/2", beat_of(rank=2, host="elsewhere", pid=77))
    said = local.diagnose()
    assert said.startswith(f"rank 1 ({local.host}, pid {pid}) died: its process is gone"), said
    remote = Watchdog(2, 3, heartbeat_s=1.0, timeout_s=5.0)
    remote.host = "elsewhere"  # the third machine
    sealed_store.put(store, "dtrain/watchdog/hb/0", beat_of(rank=0, host="machine-a", pid=78))
    before = clock.sleeps
    words = remote.diagnose()
    assert words == (
        f"rank 1 ({local.host}, pid {pid}) died: its process is gone (killed or crashed) at an "
        f"unknown step: {said.split('at an unknown step: ')[1]} (seen by rank 0 on its machine)"
    ), words
    assert clock.sleeps == before  # named at the first reading: no wait for its beats to go stale


def test_a_silent_local_peer_is_reported_at_the_phase_it_is_stuck_in(
    tmp_path: Path, store: Any
) -> None:
    # A stopped (SIGSTOP) or hung rank of this machine: alive, its record says where it is.
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0, run_dir=tmp_path)
    path = liveness_path(tmp_path, 1)
    stuck = mine(path, rank=1)
    written = time.monotonic()
    stuck.set_phase("forward_backward", 5, time.time() - 6.0)
    stuck.stamp(time.time() - 5.0, Speed())
    beat = beat_of(host=watchdog.host, pid=os.getpid(), alive_at=time.time() - 5.0)
    sealed_store.put(store, HB1, beat)
    assert_ages(
        rf"rank 1 \({watchdog.host}, pid {os.getpid()}\) stopped responding: no progress for "
        rf"{AGE}s, at step 5 in forward_backward \(last heartbeat {AGE}s ago\)",
        watchdog.diagnose(),
        (6.0, written),
        (5.0, written),
    )
    assert path.exists()
    stuck.close()


def test_rank0_lost_with_its_store_is_reported_by_the_age_of_its_kept_beat(store: Any) -> None:
    watchdog = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=5.0)
    written = time.monotonic()
    watchdog._rank0_beat = Liveness.from_dict(
        json.loads(
            beat_of(0, host="elsewhere", pid=812, step=9, phase="data", alive_at=time.time() - 4)
        )
    )
    # The store's address still accepts connections (the fixture's store): rank 0 is alive
    # but silent (stopped, hung).
    text, network = watchdog._store_lost("(StoreTimeout: ...)", True, False)
    assert_ages(
        rf"rank 0 \(elsewhere, pid 812\) stopped responding: its last heartbeat, {AGE}s old, "
        r"was at step 9 in data; it hosted the job's key-value store, now unreachable "
        r"\(StoreTimeout: \.\.\.\)",
        text,
        (4.0, written),
    )
    assert not network


class Ops:
    """A store client whose operations are listed by name, otherwise the client itself."""

    def __init__(self, client: Any) -> None:
        self.client, self.names = client, []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.client, name)

        def op(*args: Any) -> Any:
            self.names.append(name)
            return method(*args)

        return op


def test_rank0_s_beat_once_seen_is_read_with_one_store_operation(store: Any) -> None:
    # Every rank reads rank 0's beat every heartbeat: a check (a get of a missing key blocks
    # until its bound), then the read -- until it has seen the key, which then stays.
    watchdog = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=5.0)
    assert watchdog.store is not None
    ops = watchdog.store._client = Ops(watchdog.store.client)
    assert watchdog.read_beat(0) is None and "multi_get" not in ops.names  # none yet
    ops.names.clear()
    sealed_store.put(store, HB0, beat_of(0, step=4))
    # TCPStore answers no set: a check on the same connection returns once the store holds the
    # key, so the watchdog's own check (another connection) cannot come first under load.
    assert store.check([HB0])
    first = watchdog.read_beat(0)
    assert first is not None and first.step == 4 and ops.names == ["check", "multi_get"]
    watchdog._see_rank0(first, time.monotonic())
    ops.names.clear()
    sealed_store.put(store, HB0, beat_of(0, step=5))
    assert store.check([HB0])
    again = watchdog.read_beat(0)
    assert again is not None and again.step == 5 and ops.names == ["multi_get"]


# Rank 0 as the job's store host: the store, and rank 0's liveness file at step 9; runs until
# its stdin closes.
_STORE_HOST = """
import os, socket, sys, time
from pathlib import Path
from dtrain.dist.stores import host_store
from dtrain.fault.liveness import LivenessFile
store = host_store("127.0.0.1", 0, 30.0)
mine = LivenessFile(Path(sys.argv[1]), rank=0, world_size=2, attempt=0,
                    host=socket.gethostname(), pid=os.getpid())
mine.set_phase("forward_backward", 9, time.time())
print(store.port, flush=True)
sys.stdin.read()
"""


def test_a_stopped_store_host_is_named_at_the_first_read_once_the_beats_met_its_silence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIGSTOP of rank 0 freezes the store it hosts. The watchdog's reads of rank 0's beat
    # meet the silence while the collective waits out its timeout; the diagnosis after it
    # counts that silence and names rank 0 at its first failed read. It counted only its own
    # reads' (3 s more): the others named a stopped rank 0 after 10-15 s (chaos `sigstop`).
    # Then the watchdog's thread, blocked in a call to the frozen store, does not hold up
    # this rank's way out: stop() writes the last word of the record itself.
    host = subprocess.Popen(
        [sys.executable, "-c", _STORE_HOST, str(liveness_path(tmp_path, 0))],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert host.stdout is not None
        port = int(host.stdout.readline())
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(port))
        monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
        hangs: list[str] = []
        watchdog = Watchdog(
            1, 2, heartbeat_s=0.5, timeout_s=5.0, run_dir=tmp_path, on_hang=hangs.append
        )
        assert watchdog.store is not None
        sealed_store.put(
            watchdog.store.client, HB0, beat_of(0, host=watchdog.host, pid=host.pid, step=9)
        )
        watchdog.start()  # beats, and reads rank 0's beat
        thread = watchdog._thread
        watchdog.set_phase("forward_backward", 9)
        os.kill(host.pid, signal.SIGSTOP)
        # The read of rank 0's beat that the watchdog's thread makes every heartbeat meets
        # the silence (its call bound, 2 s; a beat itself, a set, waits for no answer).
        with pytest.raises(StoreTimeout):
            watchdog.read_beat(0)
        clock = DiagnosisClock()
        monkeypatch.setattr("dtrain.fault.diagnosis.time", clock)
        words, network = watchdog.diagnosis()
        assert re.fullmatch(
            rf"rank 0 \({watchdog.host}, pid {host.pid}\) stopped responding: no progress for "
            r"\d+\.\ds, at step 9 in forward_backward \(last heartbeat \d+\.\ds ago\); it "
            r"hosted the job's key-value store, now unreachable \(StoreTimeout: no answer to "
            r"[a-z ]+ in 1s\)",
            words,
        ), words
        assert not network and clock.sleeps == 0  # named at its first reading
        stopping = time.time()
        watchdog.stop()
        last = read_liveness(liveness_path(tmp_path, 1), os.getpid())
        assert last is not None and last.alive_at >= stopping  # stop()'s last word
        assert thread is not None
        thread.join(10)  # its call to the frozen store ends at its bound
        assert not thread.is_alive() and not hangs
        # ...and the thread wrote nothing after stop() took the record over.
        assert read_liveness(liveness_path(tmp_path, 1), os.getpid()) == last
    finally:
        host.kill()
        host.wait()


def test_the_store_s_machine_that_refuses_or_does_not_answer_is_a_death_or_the_network(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A probe of the store's address tells the three apart: accepted (above), refused (its
    # machine is up, rank 0's process is gone), no answer (the network path, or the machine).
    watchdog = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=5.0)
    written = time.monotonic()
    watchdog._rank0_beat = Liveness.from_dict(
        json.loads(
            beat_of(0, host="elsewhere", pid=812, step=9, phase="data", alive_at=time.time() - 4)
        )
    )
    watchdog.node = "host 10.0.0.2"
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    answers = iter([("refused", "Connection refused"), ("unreachable", "No route to host")])
    monkeypatch.setattr("dtrain.fault.diagnosis.probe", lambda *_: next(answers))
    text, network = watchdog._store_lost("(ConnectionError: ...)", False, False)
    assert (
        text.startswith(
            "rank 0 (elsewhere, pid 812) died: killed or crashed (its machine 10.0.0.1 refuses "
            "connections to the store: Connection refused): its last heartbeat, "
        )
        and not network
    ), text
    text, network = watchdog._store_lost("(ConnectionError: ...)", False, False)
    assert_ages(
        r"rank 0 \(elsewhere, pid 812\) is cut off: host 10\.0\.0\.2 has no network path to "
        r"10\.0\.0\.1 \(No route to host\) since \d\d:\d\d:\d\d \(\d+s ago\): its last "
        rf"heartbeat, {AGE}s old, was at step 9 in data; it hosted the job's key-value "
        r"store, now unreachable \(ConnectionError: \.\.\.\)",
        text,
        (4.0, written),
    )
    assert network


def test_a_rank_beats_soon_after_its_step_changes_and_leaves_its_record_at_stop(
    tmp_path: Path, store: Any
) -> None:
    # The regular beat is an hour away: a beat at step 7 within the test can only be the
    # prompt one (due ~0.2 s after the change), whatever the load.
    watchdog = Watchdog(0, 2, heartbeat_s=3600.0, timeout_s=3600.0, run_dir=tmp_path)
    path = liveness_path(tmp_path, 0)
    watchdog.start()
    try:
        first = Liveness.from_dict(sealed_store.read_json(store, HB0, dict))
        assert first is not None and (first.step, first.phase) == (0, "start")
        watchdog.set_phase("forward_backward", 7)
        live = read_liveness(path, os.getpid())  # in the file at once: no thread in between
        assert live is not None and live.where() == "at step 7 in forward_backward"
        changed = time.monotonic()
        while sealed_store.read_json(store, HB0, dict)["step"] != 7:
            # only a guard against waiting the hour for the regular beat
            assert time.monotonic() - changed < 120, "no prompt beat (the next is due in 1h)"
            time.sleep(0.02)
    finally:
        watchdog.stop()
    last = read_liveness(path, os.getpid())
    assert last is not None and (last.step, last.phase) == (7, "forward_backward")
    assert last.alive_at > 0
    watchdog.set_phase("done")  # after stop: no file to write, never an error
    watchdog.tick()


# ---------------------------------------------------------------------------------------------
# The backstop, keyed on progress (bug 1: a long phase was taken for a hang). check_hang is
# what the watchdog's thread calls at every wake; here it is called with a made-up clock.


def test_a_long_phase_that_ticks_is_no_hang_and_one_that_stops_is_named() -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=1.0)  # ends a rank still for 2 s
    t0 = time.monotonic()
    watchdog.set_phase("evaluate", 4)
    assert watchdog.check_hang(t0) is None
    for batch in range(1, 21):  # 30 s in one phase, a batch every 1.5 s
        watchdog.tick()
        assert watchdog.check_hang(t0 + 1.5 * batch) is None
    assert watchdog.check_hang(t0 + 30 + 1.9) is None
    assert watchdog.check_hang(t0 + 30 + 2.4) == (
        f"rank 0 ({watchdog.host}, pid {os.getpid()}) made no progress for 2s in evaluate at step 4"
    )
    watchdog.set_phase("checkpoint")  # a phase change is progress too
    assert watchdog.check_hang(t0 + 33) is None


def test_the_after_training_hook_is_left_to_its_collectives_timeouts() -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=1.0)
    t0 = time.monotonic()
    watchdog.set_phase("after_training")
    assert watchdog.check_hang(t0) is None
    assert watchdog.check_hang(t0 + 3600) is None  # the user's code cannot tick


def test_a_rank_waiting_for_rank0s_long_work_is_no_hang_while_rank0_moves() -> None:
    watchdog = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=1.0)
    t0 = time.monotonic()
    watchdog.set_phase("resume", 0)  # waits in a collective while rank 0 hashes the files
    assert watchdog.check_hang(t0) is None
    for piece in range(1, 21):  # rank 0's beats show its resume check moving on
        rank0 = beat_of(0, step=0, phase="resume", progress=piece)
        watchdog._see_rank0(Liveness.from_dict(json.loads(rank0)), t0 + 1.5 * piece)
        assert watchdog.check_hang(t0 + 1.5 * piece) is None
    hung = watchdog.check_hang(t0 + 30 + 2.4)  # rank 0 stopped too
    assert hung is not None and hung.endswith("made no progress for 32s in resume at step 0")
    # Rank 0 itself answers for its own progress only.
    rank0 = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=1.0)
    rank0.set_phase("resume", 0)
    rank0.check_hang(t0)
    rank0._see_rank0(Liveness.from_dict(json.loads(beat_of(0, progress=5))), t0 + 2)
    assert rank0.check_hang(t0 + 2.4) is not None


def test_the_watchdogs_thread_names_a_rank_whose_long_phase_stops_ticking(store: Any) -> None:
    hangs: list[str] = []
    named = threading.Event()

    def on_hang(message: str) -> None:
        hangs.append(message)
        named.set()

    watchdog = Watchdog(0, 2, heartbeat_s=0.1, timeout_s=0.5, on_hang=on_hang)
    watchdog.start()
    try:
        watchdog.set_phase("evaluate", 3)
        for _batch in range(5):
            watchdog.tick()
            time.sleep(0.05)
        assert named.wait(timeout=30), "no hang named after the ticks stopped"
    finally:
        watchdog.stop()
    assert len(hangs) == 1
    assert re.match(
        rf"rank 0 \({watchdog.host}, pid {os.getpid()}\) made no progress for \d+s in evaluate "
        r"at step 3; rank 1 never checked in$",
        hangs[0],
    ), hangs[0]


def test_a_look_runs_on_the_watchdog_s_thread_while_the_training_thread_waits() -> None:
    # In-place recovery's look at the membership (Member.look) must go on while the training
    # thread is blocked in a collective: here it waits on an event only the look sets. One rank
    # without a store or a run folder: the thread runs for the look alone.
    watchdog = Watchdog(0, 1, heartbeat_s=3600.0, timeout_s=3600.0)
    looked = threading.Event()
    threads: list[str] = []

    def look() -> None:
        threads.append(threading.current_thread().name)
        looked.set()

    watchdog.on_wake(look)
    watchdog.start()
    try:
        assert looked.wait(30)  # the training thread, blocked: the look still came
    finally:
        watchdog.stop()
    assert set(threads) == {"dtrain-watchdog"}
