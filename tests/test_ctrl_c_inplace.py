"""Ctrl-C on node 0 of an in-place job of two machines (two launchers on loopback, one worker
each): the job ends with a save on both, not node 0 alone unsaved while node 1 trains on to the
last step and reports ``completed``. The flag of node 0's workers reaches node 1's in the step's
agreement, which every step sums over all members (docs/fault-tolerance.md, Preemption).

Slow (two launches of the membership service; ~30 s on a loaded 2-core machine):
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
from tests.processes import Launch
from tests.ranks import free_port
from tests.test_inplace_hosts import wait_for_step

pytestmark = pytest.mark.slow

SAMPLES = 64


def test_ctrl_c_on_node_0_saves_every_machine_of_an_in_place_job(tmp_path: Path) -> None:
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
    launches = [Launch(config, 1, *machine, "--node-rank", str(i), cwd=REPO) for i in (0, 1)]
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
