"""Machines that lose each other, on namespace hosts with hostnames of their own (as separate
machines have; scripts/hosts.sh, tests.hosts): a link cut for longer than the
collective timeout is a named network failure on every host and, under --max-restarts, the
job resumes once the link is back; a rank killed on another machine is named as killed; the
loss of the machine that hosts the rendezvous is one line within seconds, and both documented
ways back work -- starting `dtrain train` again everywhere, or a rendezvous run apart from the
machines (`dtrain rendezvous`), which the job outlives a machine with.

Short timeouts (dist.timeout_s = 10 s) keep each trial near a minute; all are slow-marked.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO, tiny_config
from tests.hosts import Hosts, hosts_unavailable, launch_on_host
from tests.processes import Launch

# Namespace hosts share one subnet: these tests run one at a time under pytest-xdist.
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("namespace-hosts")]

PREFIX = f"dq{os.getpid() % 100000}"
SAMPLES = 256
STEPS = 120
TIMEOUT_S = 10.0  # dist.timeout_s
CONNECT_S = 5.0  # dist.connect_timeout_s


@pytest.fixture(autouse=True)
def _needs_hosts() -> None:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)


def write_job(tmp_path: Path, name: str) -> tuple[Path, Path]:
    run_dir = tmp_path / f"{name}-run"
    cfg = tiny_config(
        run_dir,
        train={"steps": STEPS, "log_every": 10},
        checkpoint={"every": 20},
        task={"slow_ms": 30, "samples": SAMPLES},
        fault={"audit_sample_ids": True},
        dist={"timeout_s": TIMEOUT_S, "connect_timeout_s": CONNECT_S},
    )
    config = tmp_path / f"{name}.toml"
    config.write_text(cfg.to_toml())
    return config, run_dir


def launch(hosts: Hosts, i: int, config: Path, endpoint: str, *args: str) -> Launch:
    return launch_on_host(hosts, i, config, endpoint, "partition", *args, nnodes=2)


def wait_for_step(run_dir: Path, step: int, launches: list[Launch], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert all(launch.alive() for launch in launches), [x.text()[-2000:] for x in launches]
        if metrics.exists() and f'"step": {step},' in metrics.read_text():
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} in {timeout}s")


def finish(launches: list[Launch], timeout: float = 240) -> list[int | None]:
    try:
        return [launch.wait(timeout) for launch in launches]
    finally:
        for launch in launches:
            launch.close()


def errors(launch: Launch) -> list[str]:
    return [line for _, line in launch.lines if line.startswith("dtrain: error: ")]


def assert_completed_exactly_once(run_dir: Path) -> None:
    status = (run_dir / "status.json").read_text()
    assert '"completed"' in status and f'"step": {STEPS}' in status, status
    audit = check_stream(read_trajectory(run_dir), SAMPLES)
    assert audit.exactly_once and not audit.gaps, audit


def test_a_link_down_longer_than_the_timeout_is_a_named_network_failure_then_resumes(
    tmp_path: Path,
) -> None:
    config, run_dir = write_job(tmp_path, "cut")
    with Hosts(2, prefix=PREFIX, hostnames=True) as hosts:
        endpoint = f"{hosts.address(0)}:29400"
        launches = [launch(hosts, i, config, endpoint, "--max-restarts", "2") for i in (0, 1)]
        wait_for_step(run_dir, 40, launches)
        hosts.set_link(1, up=False)
        cut = time.monotonic()
        time.sleep(TIMEOUT_S + 15)  # past the collective timeout and the diagnosis
        hosts.set_link(1, up=True)
        codes = finish(launches)
    texts = [launch.text() for launch in launches]
    assert codes == [0, 0], "\n".join(t[-3000:] for t in texts)
    # Every host names the network, whom it lost and since when; nobody calls it a preemption.
    a, b = hosts.address(0), hosts.address(1)
    lost = [
        rf"NetworkFailure: rank 0 \({PREFIX}-h0, host {a}\) .* rank 1 \({PREFIX}-h1, pid \d+\) is "
        rf"cut off: host {a} has no network path to it at {b} \(.*\) since \d\d:\d\d:\d\d",
        rf"NetworkFailure: rank 1 \({PREFIX}-h1, host {b}\) .* rank 0 \({PREFIX}-h0, pid \d+\) is "
        rf"cut off: host {b} has no network path to {a} \(.*\) since \d\d:\d\d:\d\d",
    ]
    for launch_, text, pattern in zip(launches, texts, lost, strict=True):
        said = errors(launch_)
        assert len(said) == 1 and re.search(pattern, said[0]), "\n".join(said) or text[-3000:]
        named = launch_.first("NetworkFailure")
        assert named is not None and named[0] - cut < TIMEOUT_S + 10
        assert "preempt" not in text
    # Once the link was back, the group restarted from the newest checkpoint and finished.
    assert re.search(r"resumed from step-000000[24]0", texts[0]), texts[0][-3000:]
    assert_completed_exactly_once(run_dir)


def test_a_rank_killed_on_another_machine_is_named_as_killed_and_the_restart_recorded(
    tmp_path: Path,
) -> None:
    config, run_dir = write_job(tmp_path, "kill")
    with Hosts(2, prefix=PREFIX, hostnames=True) as hosts:
        endpoint = f"{hosts.address(0)}:29400"
        launches = [launch(hosts, i, config, endpoint, "--max-restarts", "1") for i in (0, 1)]
        wait_for_step(run_dir, 20, launches)
        victim = launches[1].workers()[0]
        os.kill(victim, signal.SIGKILL)
        codes = finish(launches)
    assert codes == [0, 0], "\n".join(x.text()[-3000:] for x in launches)
    said = errors(launches[0])
    # Not "every other rank is still beating (the failure may be in the network)".
    assert len(said) == 1 and re.search(
        rf"PeerFailure: rank 0 .* rank 1 \({PREFIX}-h1, pid \d+\) died: killed or crashed", said[0]
    ), said
    # Host 0's launcher restarts its healthy worker without counting a restart (only host 1's
    # counts one): the record still says the group restarted, as on one machine.
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    starts = [json.loads(x) for x in lines if '"kind": "start"' in x]
    restarts = [json.loads(x) for x in lines if '"name": "restart"' in x]
    assert [r["attempt"] for r in starts] == [0, 1], starts
    assert [r["attempt"] for r in restarts] == [1], restarts
    assert_completed_exactly_once(run_dir)


def test_a_lost_rendezvous_host_is_one_line_within_seconds_and_a_restart_resumes(
    tmp_path: Path,
) -> None:
    config, run_dir = write_job(tmp_path, "lost")
    with Hosts(2, prefix=PREFIX, hostnames=True) as hosts:
        endpoint = f"{hosts.address(0)}:29400"
        args = ("--max-restarts", "2")
        launches = [launch(hosts, i, config, endpoint, *args) for i in (0, 1)]
        wait_for_step(run_dir, 40, launches)
        launches[0].workers()
        killed = time.monotonic()
        launches[0].kill_all()  # host 0's launcher, the rendezvous and its worker, at once
        assert launches[1].wait(CONNECT_S + 20) == 2, launches[1].text()[-3000:]
        assert launches[1].ended is not None and launches[1].ended - killed < CONNECT_S + 10
        said = errors(launches[1])
        assert said[-1] == (
            f"dtrain: error: lost the rendezvous host {endpoint}: it refuses connections "
            "(Connection refused): the `dtrain train` that hosted it has ended or was killed; "
            "start `dtrain train` again on every machine (the job resumes from its newest "
            "checkpoint), or run the rendezvous apart from the nodes (`dtrain rendezvous`, "
            "docs/multi-host.md)"
        ), said
        # The documented way back: the same command on every machine.
        again = [launch(hosts, i, config, endpoint, *args) for i in (0, 1)]
        codes = finish([*launches, *again])
    assert codes[2:] == [0, 0], again[0].text()[-3000:]
    assert re.search(r"resumed from step-000000[24]0", again[0].text())
    assert_completed_exactly_once(run_dir)


def test_a_rendezvous_apart_from_the_machines_outlives_one_and_the_job_resumes(
    tmp_path: Path,
) -> None:
    config, run_dir = write_job(tmp_path, "apart")
    with Hosts(3, prefix=PREFIX, hostnames=True) as hosts:
        rendezvous = hosts.popen(
            2, [sys.executable, "-m", "dtrain", "rendezvous", "--port", "29400"], cwd=REPO
        )
        try:
            endpoint = f"{hosts.address(2)}:29400"
            args = ("--max-restarts", "3")
            launches = [launch(hosts, i, config, endpoint, *args) for i in (0, 1)]
            wait_for_step(run_dir, 40, launches)
            launches[0].workers()
            launches[0].kill_all()
            time.sleep(3)
            # Host 1 waits (it restarts its worker and rejoins the rendezvous); host 0 comes
            # back with the same command, and the job goes on from the newest checkpoint.
            assert launches[1].alive(), launches[1].text()[-3000:]
            again = launch(hosts, 0, config, endpoint, *args)
            codes = finish([again, launches[1], launches[0]])
        finally:
            rendezvous.send_signal(signal.SIGTERM)
            rendezvous.wait(30)
    assert codes[:2] == [0, 0], again.text()[-3000:] + launches[1].text()[-3000:]
    assert re.search(r"resumed from step-000000[24]0", again.text() + launches[1].text())
    assert_completed_exactly_once(run_dir)
