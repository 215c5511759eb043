"""`dtrain status RUN_DIR`: a finished run, a running one (a run folder as a job leaves it
while it trains), the tail of a large metrics file, the liveness records the ranks write, and
bad input."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dtrain.cli import main
from dtrain.fault.liveness import LivenessFile, Speed, liveness_path, read_liveness
from dtrain.fault.status import RunStatus, write_status
from dtrain.fault.watchdog import Watchdog
from dtrain.report.read import read_tail
from dtrain.report.status import run_status


def test_status_of_a_finished_run(observed_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", str(observed_run)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{observed_run}: completed, step 12/12 (100.0%)"
    assert out[1].startswith("  last loss ") and " at step 12 (" in out[1]
    assert "tokens/s" in out[1] and "ms/step" in out[1]
    assert out[2].startswith("  val loss ") and out[2].endswith(" at step 12")
    header, *ranks = out[3:]
    assert header.split()[:4] == ["rank", "host", "pid", "last"]
    assert len(ranks) == 2
    for rank, line in enumerate(ranks):
        cells = line.split()
        assert cells[0] == str(rank) and " 12 " in line and " done " in line
        assert "tokens/s" in line and " MB" in line  # its own speed and memory


def fake_running_run(run_dir: Path, now: float) -> None:
    """A run folder as a 2-rank job leaves it mid-run: started at step 0 of 100, logging
    every 10 steps at 0.5 s a step, rank 1's beat gone stale."""
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("[train]\nsteps = 100\nlog_every = 10\n")
    write_status(run_dir, RunStatus("running", 0))
    records = [{"kind": "start", "step": 0, "steps": 100, "item_name": "tokens", "time": now - 30}]
    for step in (10, 20, 30, 40):
        records.append(
            {
                "kind": "train",
                "step": step,
                "loss": 3.0 - step / 100,
                "tokens_per_s": 2048.0,
                "step_time_s": 0.5,
                "time": now - 25 + step / 2,
            }
        )
    records.append({"kind": "eval", "step": 40, "val_loss": 2.75, "time": now - 4})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    for rank, (age, step, phase) in enumerate([(0.4, 42, "forward_backward"), (31.0, 38, "data")]):
        host, pid = f"host-{rank}", 100 + rank
        path = liveness_path(run_dir, rank)
        record = LivenessFile(path, rank=rank, world_size=2, attempt=0, host=host, pid=pid)
        record.set_phase(phase, step, now - age - 1.0)
        speed = Speed("tokens", items_per_s=4096.0 / (rank + 1), step_s=0.5, memory_bytes=250e6)
        record.stamp(now - age, speed)  # its last beat
        record.close()


def test_status_of_a_running_run(tmp_path: Path) -> None:
    now = time.time()
    run = tmp_path / "run"
    fake_running_run(run, now)
    lines = run_status(run, now).splitlines()
    # The step is the furthest any rank is (its beat), the ETA the remaining steps at the
    # newest record's time per step: 58 x 0.5 s.
    assert lines[0] == f"{run}: running, step 42/100 (42.0%), ETA 0m29s"
    assert lines[1] == "  last loss 2.6000 at step 40 (5.0s ago), 2.0k tokens/s, 500 ms/step"
    assert lines[2] == "  val loss 2.7500 at step 40"
    table = lines[3:]
    assert table[0].split() == [
        "rank", "host", "pid", "last", "beat", "step", "phase", "own", "speed", "step", "memory",
    ]  # fmt: skip
    assert table[1].split() == [
        "0", "host-0", "100", "0.4s", "ago", "42", "forward_backward", "4.1k", "tokens/s",
        "500", "ms", "250.0", "MB",
    ]  # fmt: skip
    assert "31.0s ago (stale)" in table[2] and "host-1" in table[2] and " data " in table[2]


def test_status_says_when_every_beat_is_stale(tmp_path: Path) -> None:
    now = time.time()
    run = tmp_path / "run"
    fake_running_run(run, now)
    text = run_status(run, now + 60)
    assert "no heartbeat for 1m00s: the job may have stopped" in text


def test_status_reads_only_the_tail_of_a_large_metrics_file(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    filler = {"kind": "train", "step": 0, "loss": 1.0, "pad": "x" * 900, "time": 0.0}
    with path.open("w") as fh:
        for step in range(1, 3001):  # ~2.8 MB
            fh.write(json.dumps({**filler, "step": step}) + "\n")
        fh.write('{"kind": "train", "st')  # being written right now
    tail = read_tail(path, max_bytes=1 << 20)
    steps = [r["step"] for r in tail]
    assert steps[-1] == 3000 and 900 < len(steps) < 1200
    assert steps == list(range(steps[0], 3001))  # whole records only, none cut


def test_status_and_report_pass_over_a_hand_edited_record(tmp_path: Path) -> None:
    # A line whose step is text (edited by hand) was a traceback in dtrain status.
    from dtrain.report.read import read_metrics

    now = time.time()
    run = tmp_path / "run"
    fake_running_run(run, now)
    good = (run / "metrics.jsonl").read_text()
    edited = {"kind": "train", "step": "x", "loss": 1.0, "time": now}
    (run / "metrics.jsonl").write_text(good + json.dumps(edited) + "\n")
    assert run_status(run, now).splitlines()[1].startswith("  last loss 2.6000 at step 40")
    records, skipped = read_metrics(run / "metrics.jsonl")
    assert all(r.get("step") != "x" for r in records)
    line = len(good.splitlines()) + 1
    assert skipped == [
        f"{run / 'metrics.jsonl'}: line {line} has step = 'x', not a number; skipped it"
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: None, "run folder {run} does not exist"),
        (lambda d: d.write_text("{}"), "{run} is not a folder; give a run folder (run.dir)"),
        (lambda d: d.mkdir(), "{run} has no status.json, metrics.jsonl or heartbeats"),
    ],
)
def test_status_of_a_folder_that_is_no_run_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: object, message: str
) -> None:
    run = tmp_path / "run"
    make(run)  # type: ignore[operator]
    assert main(["status", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtrain: error: ") and err.count("\n") == 1
    assert message.format(run=run) in err


def test_the_watchdog_keeps_this_ranks_record_without_peers(tmp_path: Path) -> None:
    # A job of one rank has no store, but `dtrain status` still gets its record.
    watchdog = Watchdog(
        0,
        1,
        heartbeat_s=0.2,
        timeout_s=60,
        run_dir=tmp_path,
        stats=lambda: Speed("samples", items_per_s=800.0, step_s=0.01),
    )
    path = liveness_path(tmp_path, 0)
    watchdog.start()
    try:
        first = read_liveness(path)
        assert first is not None and (first.rank, first.step, first.phase) == (0, 0, "start")
        assert first.alive_at > 0  # stamped alive at start
        watchdog.set_phase("forward_backward", 7)
        # Its speed comes at the thread's next measurement (every second); the deadline only
        # guards against one that never comes, so it is far beyond what load can delay it by.
        deadline = time.time() + 120
        beat = read_liveness(path)
        while beat is None or not (beat.steps_per_s or 0) > 0:
            assert time.time() < deadline, "no speed in the record after the step changed"
            time.sleep(0.05)
            beat = read_liveness(path)
        assert (beat.step, beat.phase) == (7, "forward_backward")
        assert (beat.item_name, beat.items_per_s) == ("samples", 800.0)
        watchdog.set_phase("done", 9)
    finally:
        watchdog.stop()
    last = read_liveness(path)
    assert last is not None and (last.step, last.phase) == (9, "done")  # kept as it stopped


def test_status_shows_the_last_membership_change(tmp_path: Path) -> None:
    now = time.time()
    run = tmp_path / "run"
    fake_running_run(run, now)
    event = {
        "kind": "event",
        "name": "membership",
        "step": 41,
        "generation": 2,
        "world_size": 2,
        "members": [0, 1],
        "left": [],
        "joined": [1],
        "healed_from": 0,
        "seconds": 0.25,
        "time": now - 3,
    }
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write(json.dumps(event) + "\n")
    lines = run_status(run, now).splitlines()
    assert lines[3] == (
        "  in place: generation 2, 2 worker(s) (members [0, 1]); at step 41 (3.0s ago): "
        "left [], joined [1], took 0.25 s"
    )
