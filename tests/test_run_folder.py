"""The run folder's faults, through the real CLI: a disk that fills during a save, a folder that
cannot be written, two jobs on one folder, a hold left by a job that died, machines started
with different configs, a console that goes away. Each is one true line, and none of them
costs a healthy run a step.

The disks are small tmpfs mounts made here (root only; skipped elsewhere) and always removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.checkpoint import hold as holds
from dtrain.checkpoint import read as ckread
from dtrain.cli import main
from dtrain.fsutil import write_atomic
from dtrain.launch.agent import held_port
from tests.conftest import REPO, tiny_config
from tests.processes import Launch


@contextlib.contextmanager
def small_disk(where: Path, size: str, read_only: bool = False) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` (skips the test where that cannot be done),
    unmounted on the way out whatever happened."""
    where.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mount.stderr.strip() or 'not root?'}")
    try:
        if read_only:
            (where / "run").mkdir()
            subprocess.run(["mount", "-o", "remount,ro", str(where)], check=True)
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(disk: Path) -> None:
    """Take every free byte of ``disk``."""
    stats = os.statvfs(disk)
    free = stats.f_bavail * stats.f_frsize
    with open(disk / "filler", "wb") as fh:
        if free:
            os.posix_fallocate(fh.fileno(), 0, free)


def write_job(path: Path, run_dir: Path, **sections: dict[str, object]) -> Path:
    defaults: dict[str, dict[str, object]] = {
        "train": {"steps": 8, "log_every": 1},
        "checkpoint": {"every": 4},
        "task": {"samples": 64, "slow_ms": 100},
    }
    for name, values in sections.items():
        defaults.setdefault(name, {}).update(values)
    path.write_text(tiny_config(run_dir, defaults).to_toml())
    return path


def wait_for(condition: object, launch: Launch, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        assert launch.alive(), launch.text()[-3000:]
        time.sleep(0.02)
    raise AssertionError(f"timed out; output:\n{launch.text()[-3000:]}")


def test_a_disk_that_fills_during_training_keeps_the_last_checkpoint_and_says_why(
    tmp_path: Path,
) -> None:
    with small_disk(tmp_path / "disk", "8m") as disk:
        run_dir = disk / "run"
        launch = Launch(write_job(tmp_path / "job.toml", run_dir), 2, cwd=REPO)
        try:
            marker = run_dir / "checkpoints/step-00000004/COMMITTED.json"
            wait_for(marker.exists, launch)
            fill(disk)  # from step 5 on: metrics.jsonl and the final save find no room
            code = launch.wait(180)
        finally:
            launch.close()
        text = launch.text()
        root = run_dir / "checkpoints"
        # The previous checkpoint is the newest valid one; nothing half-written is left.
        assert ckread.find_latest_valid(root)[0] == root / "step-00000004", text
        assert sorted(p.name for p in root.iterdir()) == ["step-00000004"], text
    assert code == 2, text
    # Every rank says the same: the disk, what its files need, what is free -- in the
    # launcher's report, once for the ranks that said it alike (a worker's own line would
    # repeat it: the launcher says it).
    said = [x for x in text.splitlines() if "no space left" in x]
    assert said and all(x.startswith("  rank") for x in said), text
    named = {int(r) for x in said for r in re.findall(r"\d+", x.split(" (pid")[0])}
    assert named == {0, 1}, said
    for line in said:
        assert "exit code 2" in line and f"no space left on the disk of {root}" in line, line
        assert "need" in line and "is free" in line, line
        assert "the newest checkpoint is still step-00000004" in line, line
    for word in ("killed", "died", "stopped responding", "Traceback"):
        assert word not in text, text
    # Training went on past the disk filling: the metrics file's loss is one warning.
    assert text.count("training goes on, and its records are lost") == 1, text
    assert "step 8/8" in text, text


def test_a_read_only_run_folder_is_one_line_before_any_worker_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with small_disk(tmp_path / "ro", "1m", read_only=True) as disk:
        config = write_job(tmp_path / "job.toml", disk / "run")
        code = main(["train", str(config), "--nproc", "2"])
    err = capsys.readouterr().err
    assert code == 2
    assert err == (
        f"dtrain: error: run.dir {disk / 'run'}: cannot write in {disk / 'run'} (Read-only "
        "file system); choose a run.dir where this user may write\n"
    )


def test_a_run_folder_that_is_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "afile").write_text("")
    config = write_job(tmp_path / "job.toml", tmp_path / "afile")
    assert main(["train", str(config), "--nproc", "2"]) == 2
    err = capsys.readouterr().err
    afile = tmp_path / "afile"
    assert err == f"dtrain: error: run.dir {afile}: {afile} is a file, not a folder; " + (
        "choose another run.dir\n"
    )


def test_a_second_job_on_a_run_folder_in_use_is_refused_naming_the_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    config = write_job(tmp_path / "job.toml", run_dir, train={"steps": 2000})
    first = Launch(config, 1, cwd=REPO)
    try:
        wait_for((run_dir / "metrics.jsonl").exists, first)
        # The second job is refused in its launcher, before any worker starts.
        code = main(["train", str(config), "--nproc", "1"])
        assert first.alive(), first.text()[-3000:]
        os.kill(first.pid, signal.SIGTERM)  # the first job saves and stops
        assert first.wait(180) == 0, first.text()[-3000:]
    finally:
        first.close()
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"dtrain: error: run.dir {run_dir} is in use by job '"), err
    assert f"(host {os.uname().nodename}, pid {first.pid}, since " in err
    assert err.count("\n") == 1, err
    # The first job trained alone: from scratch, never a second start.
    starts = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if '"kind": "start"' in line
    ]
    assert len(starts) == 1
    assert not (run_dir / holds.HOLD_FILE).exists()  # released at the end


def _hold(run_dir: Path, **fields: object) -> None:
    record = {
        "job": "old@elsewhere:1",
        "token": "old-token",
        "run_id": "old",
        "host": "gone-host",
        "boot_id": "another-machine",
        "pid": 1,
        "pid_started": 1,
        "since": time.time() - 60,
        "renewals": 3,
    } | fields
    (run_dir / holds.HOLD_FILE).write_text(json.dumps(record))


def test_a_hold_left_by_a_dead_job_on_this_machine_is_taken_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _hold(tmp_path, boot_id=holds._boot_id(), host=os.uname().nodename, pid=dead.pid)
    hold = holds.take_hold(tmp_path, "new", "")
    try:
        assert holds.read_hold(tmp_path / holds.HOLD_FILE) == hold.record
        assert "which is gone; taking it over" in capsys.readouterr().err
    finally:
        hold.release()
    assert not (tmp_path / holds.HOLD_FILE).exists()


def test_a_live_hold_on_this_machine_is_refused_even_with_a_reused_name(tmp_path: Path) -> None:
    # This very process holds it (its pid and start time): alive, whatever the job's name.
    me = os.getpid()
    _hold(tmp_path, boot_id=holds._boot_id(), pid=me, pid_started=holds._started(me))
    with pytest.raises(holds.UserError, match=r"is in use by job 'old' \(host gone-host, pid"):
        holds.take_hold(tmp_path, "old", "")
    # The same pid with another start time is another process: that hold is stale.
    _hold(tmp_path, boot_id=holds._boot_id(), pid=me, pid_started=holds._started(me) + 1)
    holds.take_hold(tmp_path, "new", "").release()


def test_a_hold_from_another_machine_is_refused_while_renewed_and_taken_once_it_stops(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _hold(tmp_path)
    path = tmp_path / holds.HOLD_FILE
    renewing = threading.Event()

    def renew() -> None:  # the other machine's launcher, alive
        count = 3
        while not renewing.wait(0.05):
            count += 1
            record = json.loads(path.read_text()) | {"renewals": count}
            write_atomic(path, json.dumps(record))  # as a launcher renews: whole or not at all

    thread = threading.Thread(target=renew)
    thread.start()
    try:
        with pytest.raises(holds.UserError, match="is in use by job 'old' \\(host gone-host"):
            holds.take_hold(tmp_path, "new", "", lease_s=1.0)
    finally:
        renewing.set()
        thread.join()
    capsys.readouterr()
    started = time.monotonic()
    hold = holds.take_hold(tmp_path, "new", "", lease_s=1.0)  # no renewals: gone
    assert time.monotonic() - started >= 1.0  # it watched a whole lease first
    # Taken over after watching one lease of the 1 s asked for (not the default 30 s, and
    # not again after the takeover).
    err = capsys.readouterr().err
    assert err.count("waiting up to 1s to see whether that job still renews it") == 1, err
    assert err.count("which is gone; taking it over") == 1, err
    assert hold.record.run_id == "new"
    hold.release()


def test_the_hold_and_its_token_are_the_user_s_alone_to_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hold.json holds the job's token: mode 0600 under a umask that makes files 0644, when
    taken, taken over from a gone job, and renewed (each is a new file, created so)."""
    monkeypatch.setattr(holds, "RENEW_S", 0.02)
    path = tmp_path / holds.HOLD_FILE
    old = os.umask(0o022)
    try:
        for _ in range(2):  # taken, then (a hold of another machine that is gone) taken over
            hold = holds.take_hold(tmp_path, "job", "", lease_s=0.1)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            deadline = time.monotonic() + 10
            while (holds.read_hold(path) or hold.record).renewals < 2:
                assert time.monotonic() < deadline, "the hold was not renewed"
                time.sleep(0.01)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600  # renewed: a new file
            hold.release()
            _hold(tmp_path)
    finally:
        os.umask(old)
    assert not [p.name for p in tmp_path.iterdir() if p.name != holds.HOLD_FILE]


def test_machines_of_one_job_share_its_hold(tmp_path: Path) -> None:
    first = holds.take_hold(tmp_path, "job", "10.0.0.1:29400")
    second = holds.take_hold(tmp_path, "job", "10.0.0.1:29400")  # another machine of it
    assert second.joined and second.token == first.token
    assert second.record.pid_started == holds._started(os.getpid())
    with pytest.raises(holds.UserError, match="in use"):
        holds.take_hold(tmp_path, "job", "10.0.0.9:29400")  # another job of the same name
    second.release()
    first.release()


def test_two_machines_started_with_different_configs_are_refused_naming_the_keys(
    tmp_path: Path,
) -> None:
    # Two launchers on this machine stand in for two machines of one job (the same --run-id
    # and rendezvous): the check is the workers', which see one job of two nodes either way.
    config = write_job(tmp_path / "job.toml", tmp_path / "run", task={"slow_ms": 0})
    # The port is held until the rendezvous host binds it (dtrain.launch.agent): no one else can.
    with held_port() as port:
        common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--run-id", "same"]
        launches = [
            Launch(config, 1, *common, "--node-rank", "0", cwd=REPO),
            Launch(config, 1, *common, "--node-rank", "1", "--optim.lr=0.25", cwd=REPO),
        ]
        try:
            codes = [launch.wait(180) for launch in launches]
        finally:
            for launch in launches:
                launch.close()
    texts = [launch.text() for launch in launches]
    assert codes == [2, 2], texts
    # Which machine's worker is rank 0 is the rendezvous's choice.
    either = ("optim.lr = 0.25 there, 0.5 on rank 0", "optim.lr = 0.5 there, 0.25 on rank 0")
    for text in texts:
        assert "the ranks of this job were started with different configs: rank 1" in text
        assert any(words in text for words in either), text
        assert "Traceback" not in text
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


def test_a_closed_output_pipe_costs_the_output_not_the_run(tmp_path: Path) -> None:
    # `dtrain train ... 2>&1 | head -2`: the pipe closes after two lines, and every later
    # write to it fails. The run must finish as if nobody had been reading.
    run_dir = tmp_path / "run"
    config = write_job(tmp_path / "job.toml", run_dir, task={"slow_ms": 20})
    proc = subprocess.Popen(
        [sys.executable, "-m", "dtrain", "train", str(config), "--nproc", "1"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    for _ in range(2):
        proc.stdout.readline()
    proc.stdout.close()
    assert proc.wait(timeout=180) == 0
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"
    assert ckread.find_latest_valid(run_dir / "checkpoints")[0] == (
        run_dir / "checkpoints/step-00000008"
    )
