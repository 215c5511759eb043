"""Faults through the real launcher (torch's elastic agent): kill -9 with restarts, a worker that
always fails, SIGTERM to the launcher, Ctrl-C (once: a save; twice: at once). Each kind runs
once here; tests/system/chaos.py runs many trials of each."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dtrain.fault.liveness import read_run_liveness
from dtrain.process_exit import process_alive
from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO
from tests.processes import children_of, worker_pids

SAMPLES = 64


def write_config(
    path: Path, run_dir: Path, task: str = "tests.tasks:tiny_gpt", **task_options: object
) -> Path:
    options = {"samples": SAMPLES, "slow_ms": 40} | task_options
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        f'task = "{task}"',
        "[data]",
        "global_batch_size = 8",
        "[train]",
        "steps = 20",
        "log_every = 1",
        "[eval]",
        "every = 0",
        "[checkpoint]",
        "every = 4",
        "[optim]",
        'name = "adamw"',
        "lr = 0.003",
        "[fault]",
        "audit_sample_ids = true",
        "preempt_grace_s = 30",
        "[dist]",
        "timeout_s = 20",
        "[task]",
        *(f"{k} = {json.dumps(v)}" for k, v in options.items()),
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def start(config: Path, *args: str, terminal: bool = False) -> subprocess.Popen[str]:
    """``dtrain train CONFIG --nproc 2 ARGS``; ``terminal``: in a process group of its own, as
    a terminal's foreground job, which Ctrl-C signals as a whole (``os.killpg``)."""
    return subprocess.Popen(
        [sys.executable, "-m", "dtrain", "train", str(config), "--nproc", "2", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=terminal,
    )


def wait_for_step(
    run_dir: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120
) -> None:
    def reached() -> bool:
        steps = [record.get("step", 0) for record in records(run_dir)]
        return bool(steps) and max(steps) >= step

    wait_until(reached, proc, f"the run did not reach step {step}", timeout)


def records(run_dir: Path) -> list[dict[str, object]]:
    """The lines of the run's ``metrics.jsonl`` so far."""
    metrics = run_dir / "metrics.jsonl"
    text = metrics.read_text() if metrics.exists() else ""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def wait_until(
    done: Callable[[], bool], proc: subprocess.Popen[str], what: str, timeout: float = 120
) -> None:
    """Poll ``done()`` while ``proc`` runs; ``what`` (it did not happen) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if done():
            return
        time.sleep(0.02)
    raise AssertionError(f"{what} in {timeout}s")


def final_params(run_dir: Path, step: int = 20) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / "checkpoints" / f"step-{step:08d}" / "model.pt", weights_only=True)


def reference(tmp_path: Path) -> Path:
    run_dir = tmp_path / "ref"
    proc = start(write_config(tmp_path / "ref.toml", run_dir))
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    return run_dir


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run of :func:`write_config`, never interrupted: what every interrupted and resumed
    run of this module must equal bit for bit (trained once per module)."""
    return reference(tmp_path_factory.mktemp("uninterrupted"))


def assert_same_run(a: Path, b: Path) -> None:
    pa, pb = final_params(a), final_params(b)
    assert pa.keys() == pb.keys()
    for key in pa:
        assert torch.equal(pa[key], pb[key]), key  # bit-identical
    ta, tb = read_trajectory(a), read_trajectory(b)
    assert {s: r.ids for s, r in ta.items()} == {s: r.ids for s, r in tb.items()}
    audit = check_stream(tb, SAMPLES)
    assert audit.exactly_once and not audit.gaps, audit


def test_kill9_of_a_worker_restarts_and_ends_bit_identical(
    tmp_path: Path, uninterrupted: Path
) -> None:
    ref = uninterrupted
    run_dir = tmp_path / "chaos"
    proc = start(write_config(tmp_path / "chaos.toml", run_dir), "--max-restarts", "3")
    wait_for_step(run_dir, random.Random(os.getpid()).randint(3, 14), proc)
    victim = random.choice(worker_pids(proc.pid))
    os.kill(victim, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    # The group was restarted: from the newest committed checkpoint, or from scratch if the
    # kill came before the first one committed.
    assert (err + out).count("dtrain: training ddp on 2 rank(s)") == 2
    assert_same_run(ref, run_dir)


def test_a_worker_that_always_fails_stops_after_max_restarts(tmp_path: Path) -> None:
    run_dir = tmp_path / "fail"
    config = write_config(
        tmp_path / "fail.toml",
        run_dir,
        task="tests.tasks:failing_gpt",
        fail_rank=1,
        fail_at_step=3,
        slow_ms=0,
    )
    proc = start(config, "--max-restarts", "2")
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode not in (0, None)
    attempts = (run_dir / "attempts.log").read_text().split()
    assert attempts[0::2].count("1") == 3  # rank 1 started exactly 3 times
    assert "rank 1" in err and "injected failure at step 3" in err
    # Each attempt: one line per failed rank; the tracebacks (about 50 lines a rank and
    # attempt before) are in the run folder's log, one block per attempt.
    assert "Traceback" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("dtrain: error: rank 1: ")]
    assert len(said) == 3 and all("RuntimeError: injected failure at step 3" in s for s in said)
    log = (run_dir / "logs" / "rank1.log").read_text()
    assert log.count("Traceback (most recent call last)") == 3
    assert [f"attempt {i}," in log for i in range(3)] == [True] * 3
    # status.json said "running" at step 0 for good after the job had failed.
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {"state": "failed", "step": 3, "signal": ""}  # the step it failed in
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _processes_of(run_dir):
        time.sleep(0.2)
    assert not _processes_of(run_dir)


def test_rank0_failing_names_it_although_the_store_it_hosted_is_gone(tmp_path: Path) -> None:
    # Under `dtrain train` rank 0 hosts the job's store: when it dies, the store goes with it and
    # rank 1 can only name it by what it read earlier (its host, pid and step).
    run_dir = tmp_path / "fail0"
    config = write_config(
        tmp_path / "fail0.toml",
        run_dir,
        task="tests.tasks:failing_gpt",
        fail_rank=0,
        fail_at_step=6,
        slow_ms=0,
    )
    proc = start(config)
    _out, err = proc.communicate(timeout=240)
    assert proc.returncode not in (0, None)
    assert "injected failure at step 6" in err
    assert re.search(r"PeerFailure: rank 1 \(.*rank 0 \([^)]*pid \d+", err), err[-3000:]


def test_a_stopped_rank0_that_hosts_the_store_is_named_and_nothing_hangs(tmp_path: Path) -> None:
    # SIGSTOP freezes rank 0 and the store it hosts: store calls then block for good, so every
    # one the watchdog makes must be bounded, or the other ranks hang after their collective
    # has timed out (the chaos trials caught it).
    run_dir = tmp_path / "stop0"
    config = write_config(tmp_path / "stop0.toml", run_dir)
    # Heartbeats of 0.2 s: rank 1's diagnosis gives a failing peer min(1 s, heartbeat) to post
    # its error, so it names rank 0 sooner after its collective timed out (5 s), further
    # ahead of its hang backstop (10 s).
    proc = start(
        config,
        "--dist.timeout_s=5",
        "--train.steps=1000",
        "--fault.preempt_grace_s=2",
        "--fault.heartbeat_s=0.2",
    )
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), line) for line in proc.stderr or ()),
        daemon=True,
    )
    reader.start()
    rank0 = -1
    try:
        wait_for_step(run_dir, 3, proc)
        rank0 = next(p for p in worker_pids(proc.pid) if _rank_of(p) == 0)
        os.kill(rank0, signal.SIGSTOP)
        # Not stuck: rank 1 fails and the launcher ends the group. Its SIGTERM reaches the
        # stopped rank 0 only once it runs again; torch's agent would SIGKILL it after its own
        # 30 s grace, which is torch's to test, not ours: once the agent has sent it (pending
        # on rank 0; the launcher no longer prints torch's "closing signal SIGTERM" line, so
        # the test waited out the grace), let rank 0 go on (and end at the SIGTERM).
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if _pending(rank0, signal.SIGTERM):
                os.kill(rank0, signal.SIGCONT)
                break
            time.sleep(0.2)
        proc.wait(timeout=120)
        reader.join(10)
    finally:
        if rank0 > 0 and Path(f"/proc/{rank0}").exists():
            os.kill(rank0, signal.SIGKILL)
        proc.kill()
    named = [
        line
        for _, line in lines
        if re.search(r"PeerFailure: rank 1 \(.*rank 0 \([^)]*\) stopped responding", line)
    ]
    assert named, "".join(line for _, line in lines)[-3000:]
    # Named by rank 1's failed collective (its 5 s timeout, then a diagnosis whose store calls
    # are all bounded), not by its hang backstop ("made no progress for 10s ...", which names
    # rank 0 in the same words once rank 1 has been still for twice the timeout).
    assert any(
        re.search(r"a collective failed: .*\(collective error: Timed out waiting 5000ms", line)
        for line in named
    ), named
    assert proc.returncode != 0


def _pending(pid: int, signum: int) -> bool:
    """Whether ``signum`` waits to be delivered to process ``pid`` (a stopped one)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    bit = 1 << (signum - 1)
    masks = [
        line.split()[1] for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))
    ]
    return any(int(mask, 16) & bit for mask in masks)


def _rank_of(pid: int) -> int:
    with open(f"/proc/{pid}/environ", "rb") as fh:
        for item in fh.read().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    return -1


def _processes_of(run_dir: Path) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    if str(run_dir).encode() in fh.read():
                        found.append(int(entry))
            except OSError:
                pass
    return found


def test_sigterm_then_ctrl_c_save_exit_0_and_resume_bit_identical(
    tmp_path: Path, uninterrupted: Path
) -> None:
    ref = uninterrupted
    run_dir = tmp_path / "preempt"
    config = write_config(tmp_path / "pre.toml", run_dir)
    proc = start(config)
    wait_for_step(run_dir, 6, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    # The workers saved and exited by themselves, within the grace (fault.preempt_grace_s =
    # 30 s): torch's agent never had to kill them (it says so when it does).
    assert "forcefully exiting via" not in err, err[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "preempted"
    assert not children_of(proc.pid)
    # Resumed, then Ctrl-C. It was the one stop that lost work: the workers took SIGINT as
    # KeyboardInterrupt and died unsaved (`stopped by signal 2 before the workers could
    # save`, exit 130), each at its own moment -- a rank alive a moment longer called the
    # store that rank 0, gone, had hosted, and torch printed its C++ "Broken pipe" trace
    # (frames #0-#17). SIGINT is a preemption signal by default now: the ranks agree on a
    # step, save, and exit together.
    again = start(config, terminal=True)
    wait_for_step(run_dir, status["step"] + 3, again)
    os.killpg(again.pid, signal.SIGINT)  # what the terminal sends its foreground job
    out, err = again.communicate(timeout=60)
    assert again.returncode == 0, err[-3000:]
    assert f"resumed from step-{status['step']:08d}" in err + out
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "preempted" and status["signal"] == "SIGINT", status
    assert status["step"] < 20, status
    assert (run_dir / "checkpoints" / f"step-{status['step']:08d}" / "COMMITTED.json").exists()
    assert f"preempted by signal {int(signal.SIGINT)}; saved at step {status['step']}" in err
    for noise in ("Broken pipe", "frame #", "Traceback", "KeyboardInterrupt"):
        assert noise not in out + err, (out + err)[-3000:]
    assert not children_of(again.pid)
    last = start(config)
    out, err = last.communicate(timeout=240)
    assert last.returncode == 0, err[-3000:]
    assert f"resumed from step-{status['step']:08d}" in err + out
    assert_same_run(ref, run_dir)


def test_a_signal_after_the_last_step_is_a_completed_run_not_a_failure(tmp_path: Path) -> None:
    # SIGTERM reaches the launcher after the ranks trained their last step and committed the
    # final checkpoint, while rank 0 runs the task's after-training hook: the workers finish,
    # and the launcher must say that the run completed and saved, with exit code 0.
    run_dir = tmp_path / "late"
    config = write_config(tmp_path / "late.toml", run_dir, task="tests.tasks:slow_finish_gpt")
    proc = start(config, "--train.steps=6")
    marker = run_dir / "after-training-started"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never reached its after-training hook"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "the run completed and saved its final checkpoint (step 6)" in err, err[-3000:]
    assert "before the workers could save" not in err
    status = json.loads((run_dir / "status.json").read_text())
    assert status == {"state": "completed", "step": 6, "signal": ""}
    assert (run_dir / "checkpoints" / "step-00000006" / "COMMITTED.json").exists()
    assert not children_of(proc.pid)


def test_a_rank_killed_mid_run_is_named_with_the_step_and_phase_it_reached(
    tmp_path: Path,
) -> None:
    # Steps of a few milliseconds: by step 26 the killed rank's last heartbeat in the store
    # (one a second) is far behind; the survivor must still say where it really died.
    run_dir = tmp_path / "kill"
    config = write_config(
        tmp_path / "kill.toml",
        run_dir,
        task="tests.tasks:failing_gpt",
        fail_rank=1,
        kill_at_step=26,
        slow_ms=0,
    )
    proc = start(config, "--train.steps=200", "--train.log_every=1000", "--checkpoint.every=0")
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode not in (0, None)
    died = re.search(
        r"PeerFailure: rank 0 \(.*?rank 1 \([^)]*pid \d+\) died: (.*?)(?:; | \(collective error)",
        err,
    )
    assert died, err[-3000:]
    # Where it was, not where its last heartbeat (step 0 at start-up, or some steps behind) was.
    assert re.fullmatch(
        r"its process is gone \(killed or crashed\) at step 26 in forward_backward", died.group(1)
    ), died.group(1)
    # The run folder keeps rank 1's record as it died; nothing of the ranks is left in
    # shared memory to sweep.
    killed = read_run_liveness(run_dir)[1]
    assert killed.where() == "at step 26 in forward_backward" and not process_alive(killed.pid)
    pids = {int(pid) for pid in re.findall(r"pid (\d+)", err)}
    assert killed.pid in pids
    left = [f for pid in pids for f in Path("/dev/shm").glob(f"dtrain-*{pid}*")]
    assert not left, left


def test_sigusr1_to_the_launcher_saves_and_exits_0(tmp_path: Path) -> None:
    # Slurm's `--signal=USR1@N` and `scancel --signal=USR1`: torch's agent forwards only
    # SIGTERM, SIGINT, SIGHUP and SIGQUIT by default, and SIGUSR1 killed it (exit 138) and the
    # workers with it, unsaved. `dtrain train` has it forward every fault.preempt_signals.
    run_dir = tmp_path / "usr1"
    proc = start(write_config(tmp_path / "usr1.toml", run_dir), "--train.steps=200")
    wait_for_step(run_dir, 3, proc)
    proc.send_signal(signal.SIGUSR1)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    status = json.loads((run_dir / "status.json").read_text())
    assert status["state"] == "preempted" and status["signal"] == "SIGUSR1", status
    assert 3 <= status["step"] < 200
    saved = run_dir / "checkpoints" / f"step-{status['step']:08d}" / "COMMITTED.json"
    assert saved.exists()
    assert f"preempted by signal {int(signal.SIGUSR1)}; saved at step {status['step']}" in err
    assert "warning: fault.preempt_signals" not in err  # the launcher forwards it: no warning
    assert not children_of(proc.pid)


def test_ranks_that_failed_alike_share_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every rank's loss-contract error (400 characters) was listed once per rank, below each
    # worker's own line of it.
    from types import SimpleNamespace

    from dtrain.launch.reports import report_failure

    said = "Task.loss_fn returned 1 value(s) for 64 counted item(s): use reduction='none'"
    failures = {
        rank: SimpleNamespace(
            timestamp=0, exitcode=2, pid=100 + rank, message=f"rank {rank}: {said}"
        )
        for rank in (0, 1, 2)
    }
    failures[3] = SimpleNamespace(timestamp=1, exitcode=-signal.SIGTERM, pid=103, message="")
    assert report_failure(failures, 0, tmp_path) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1:] == [
        f"  ranks 0, 1, 2 (pids 100, 101, 102, exit code 2): {said}",
        "  rank 3 (pid 103, ended by SIGTERM): no error of its own: ended by the signal (torch's "
        "agent ends a job's other ranks so when one fails)",
    ]


@pytest.mark.skipif(
    Path("/proc/sys/vm/overcommit_memory").exists()
    and Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "1",
    reason="vm.overcommit_memory = 1 grants any allocation (the kernel kills later instead)",
)
def test_out_of_memory_is_one_line_per_rank_with_the_traceback_in_the_run_folder(
    tmp_path: Path,
) -> None:
    # Rank 1 asks the allocator for 4 TiB in step 3's forward: it fails at once, as a batch
    # too big for the machine's memory does (100-300 lines of allocator traceback before).
    run_dir = tmp_path / "oom"
    config = write_config(
        tmp_path / "oom.toml", run_dir, task="tests.tasks:failing_gpt", oom_at_step=3, slow_ms=0
    )
    proc = start(config)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 1, err[-3000:]
    assert "Traceback" not in err and "alloc_cpu" not in err, err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("dtrain: error: rank")]
    assert len(said) == 2, err[-3000:]  # one line per rank
    oom = next(line for line in said if line.startswith("dtrain: error: rank 1: "))
    assert re.search(
        r"OutOfMemory: rank 1 \(.*\) ran out of memory at step 3 in forward_backward: an "
        r"allocation asked for 4\.0 TiB \(4398046511104 bytes\) of CPU memory; try a smaller "
        r"micro-batch .*activation checkpointing.*'fsdp'",
        oom,
    ), oom
    log = run_dir / "logs" / "rank1.log"
    assert oom.endswith(f"(traceback: {log})")
    assert "DefaultCPUAllocator: can't allocate memory" in log.read_text()
    peer = next(line for line in said if line.startswith("dtrain: error: rank 0: "))
    assert "rank 1 (" in peer and "failed at step 3 in forward_backward: OutOfMemory" in peer


@pytest.mark.slow  # a launch of its own (~12 s on 2 cores)
def test_a_second_ctrl_c_stops_at_once_without_a_traceback_from_every_rank(
    tmp_path: Path,
) -> None:
    # The first Ctrl-C asks for a save at the next step; the second, while the workers save
    # (each file write slowed to 3 s here), kills them at once, together. Before, each worker
    # printed the KeyboardInterrupt traceback of where its step was (~40 lines a rank) below
    # the launcher's one line.
    run_dir = tmp_path / "ctrl-c"
    config = write_config(tmp_path / "c.toml", run_dir, task="tests.tasks:chaos_gpt")
    slow_save = ["--task.save_slow_ms=3000", "--checkpoint.every=0", "--train.steps=200"]
    proc = start(config, *slow_save, terminal=True)
    try:
        wait_for_step(run_dir, 2, proc)
        os.killpg(proc.pid, signal.SIGINT)
        # The ranks agreed to stop and log it before their (slow) final save.
        stopping = lambda: any(r.get("name") == "preempted" for r in records(run_dir))  # noqa: E731
        wait_until(stopping, proc, "the ranks did not agree to stop", 60)
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 128 + signal.SIGINT, err[-3000:]
    assert "stopped at once by a second signal 2: the workers were killed unsaved" in err, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "Broken pipe" not in err and "frame #" not in err, err[-3000:]
    assert not list((run_dir / "checkpoints").glob("step-*/COMMITTED.json"))  # nothing saved
    assert not children_of(proc.pid)
