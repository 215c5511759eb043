"""Machines leaving and joining an elastic job (`--nnodes 1:2`): two launchers on this machine
act as two hosts. Slow (rendezvous timeouts of tens of seconds): `make test-slow`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.launch.agent import held_port
from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO
from tests.test_launcher_faults import wait_for_step, write_config

# Namespace hosts share one subnet: these tests run one at a time under pytest-xdist.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("namespace-hosts")]
SAMPLES = 256


def host(config: Path, port: int, run_id: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dtrain",
            "train",
            str(config),
            "--nproc",
            "1",
            "--nnodes",
            "1:2",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--run-id",
            run_id,
            "--max-restarts",
            "3",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def config_for(tmp_path: Path, steps: int) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    config = write_config(tmp_path / "job.toml", run_dir, samples=SAMPLES, slow_ms=100)
    config.write_text(config.read_text().replace("steps = 20", f"steps = {steps}"))
    return config, run_dir


def assert_exactly_once(run_dir: Path, steps: int) -> None:
    trajectory = read_trajectory(run_dir)
    assert sorted(trajectory) == list(range(1, steps + 1))
    audit = check_stream(trajectory, SAMPLES)
    assert audit.exactly_once and not audit.gaps, audit


def test_a_host_that_leaves_and_one_that_joins(tmp_path: Path) -> None:
    config, run_dir = config_for(tmp_path, steps=200)
    # The port is held until the first host binds it (dtrain.launch.agent): no one else can.
    with held_port() as port:
        first = host(config, port, "hosts")
        time.sleep(1)
        second = host(config, port, "hosts")
        try:
            wait_for_step(run_dir, 15, first)
            second.send_signal(signal.SIGKILL)  # a host lost: launcher and (PDEATHSIG) worker
            second.wait(timeout=30)
            wait_for_step(run_dir, 60, first, timeout=240)  # resumed on one host
            third = host(config, port, "hosts")  # a host joins: the job grows back to 2 ranks
            out, _ = first.communicate(timeout=400)
            third.communicate(timeout=60)
        finally:
            for proc in (first, second):
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
    assert first.returncode == 0, out[-3000:]
    assert "training ddp on 1 rank(s), cpu, resumed from" in out
    assert "training ddp on 2 rank(s), cpu, resumed from" in out
    assert_exactly_once(run_dir, 200)
