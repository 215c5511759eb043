"""Ctrl-C on node 0 of an in-place job of two machines (two launchers on loopback, one worker
each): the job ends with a save on both, not node 0 alone unsaved while node 1 trains on to the
last step and reports ``completed``. The flag of node 0's workers reaches node 1's in the step's
agreement, which every step sums over all members (docs/fault-tolerance.md, Preemption). A
second Ctrl-C kills node 0's workers at once, and no machine prints torch's C++ trace.

Slow (two launchers per test, ~15-30 s each on a loaded 2-core machine):
`make test-slow`. The same across namespace hosts, with a link cut: tests/test_inplace_hosts.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dtrain.fault.status import read_status
from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO, tiny_config
from tests.processes import Launch, metrics_records
from tests.ranks import free_port
from tests.test_inplace_hosts import wait_for, wait_for_step

pytestmark = pytest.mark.slow

SAMPLES = 64


def two_machines(tmp_path: Path, *args: str) -> tuple[Path, list[Launch]]:
    """An in-place job of two machines on loopback, one worker each, started; its run folder
    and launchers (node 0 first)."""
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        run_dir,
        train={"steps": 500, "log_every": 1},
        task={"slow_ms": 40, "samples": SAMPLES},
        fault={"recovery": "inplace", "audit_sample_ids": True, "preempt_grace_s": 30},
        dist={"timeout_s": 20},
    )
    config = tmp_path / "job.toml"
    config.write_text(cfg.to_toml())
    machine = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--run-id", "cc"]
    nodes = [["--node-rank", str(i), *args] for i in (0, 1)]
    return run_dir, [Launch(config, 1, *machine, *node, cwd=REPO) for node in nodes]


def test_ctrl_c_on_node_0_saves_every_machine_of_an_in_place_job(tmp_path: Path) -> None:
    run_dir, launches = two_machines(tmp_path)
    try:
        wait_for_step(run_dir, 5, launches)
        os.killpg(launches[0].pid, signal.SIGINT)  # the terminal of node 0's operator
        codes = [x.wait(120) for x in launches]
    finally:
        for x in launches:
            x.close()
    texts = [x.text() for x in launches]
    assert codes == [0, 0], texts
    status = read_status(run_dir)
    assert status is not None and status.state == "preempted" and status.signal == "SIGINT"
    assert 5 <= status.step < 500, status
    assert (run_dir / "checkpoints" / f"step-{status.step:08d}" / "COMMITTED.json").exists()
    assert f"preempted by signal 2; saved at step {status.step}" in texts[0], texts[0]
    elsewhere = "stopped by SIGINT sent elsewhere (another machine's Ctrl-C, say); saved at step"
    assert f"{elsewhere} {status.step}" in texts[1], texts[1]
    for text in texts:
        for noise in ("Broken pipe", "frame #", "Traceback", "KeyboardInterrupt"):
            assert noise not in text, text[-3000:]
    # Both members trained every step up to the save, each sample once.
    audit = check_stream(read_trajectory(run_dir), SAMPLES)
    assert audit.exactly_once and not audit.gaps and audit.positions == status.step * 8, audit


def test_a_second_ctrl_c_on_node_0_stops_every_machine_at_once_without_cpp_frames(
    tmp_path: Path,
) -> None:
    # The second Ctrl-C comes while the workers save (each file write slowed to 3 s). Node 0's
    # worker, which hosts the job's store, is killed; node 1's threads then called that store,
    # and torch printed its C++ trace ("recvValue failed", "Broken pipe": frames #0-#23) for
    # each call.
    slow = ["--run.task=tests.tasks:chaos_gpt", "--task.save_slow_ms=3000"]
    run_dir, launches = two_machines(tmp_path, *slow)
    try:
        wait_for_step(run_dir, 5, launches)
        os.killpg(launches[0].pid, signal.SIGINT)
        stopping = lambda: any(r.get("name") == "preempted" for r in metrics_records(run_dir))  # noqa: E731
        wait_for("the ranks to agree to stop", stopping, launches, timeout=60)
        os.killpg(launches[0].pid, signal.SIGINT)
        codes = [x.wait(120) for x in launches]
    finally:
        for x in launches:
            x.close()
    texts = [x.text() for x in launches]
    assert codes[0] == 128 + signal.SIGINT, texts
    assert "stopped at once by a second signal 2: the workers were killed unsaved" in texts[0]
    assert codes[1] not in (0, None), texts  # its peer gone mid-save: it says so, and ends
    # Node 1 stops at once too, told by node 0's launcher before node 0's workers were killed:
    # one line naming node 0's operator, not its own save's failure (it was "checkpoint
    # step-N was not committed: ... Connection closed by peer", twice, exit 2).
    assert codes[1] == 128 + signal.SIGINT, texts[1]
    said = "dtrain: stopped at once: node 0's operator stopped the job (a second Ctrl-C there)"
    assert texts[1].count(said) == 1, texts[1]
    for alarm in ("not committed", "error", "failed"):
        assert alarm not in texts[1], texts[1][-3000:]
    for text in texts:
        for noise in ("Broken pipe", "frame #", "Traceback", "KeyboardInterrupt"):
            assert noise not in text, text[-3000:]
