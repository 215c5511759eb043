"""``fault.recovery = 'inplace'`` across machines, on namespace hosts with hostnames of their
own (scripts/hosts.sh, dtrain.testing.hosts): host 1's link down for 10 s, then up. Host 0
(which holds the membership coordinator) drops the step in flight after ``dist.timeout_s``
and trains on alone; once the link is back, host 1's worker, whose collective failed, asks to
join and is healed from host 0's memory. No checkpoint is read, every sample is seen once.

Slow (a minute): `make test-slow`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from dtrain.testing import Launch
from dtrain.testing.hosts import Hosts, hosts_unavailable
from tests.audit import check_stream, read_trajectory
from tests.conftest import REPO, tiny_config

# Namespace hosts: one set at a time under pytest-xdist (their own subnet besides).
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("namespace-hosts")]

PREFIX = f"ih{os.getpid() % 100000}"
SUBNET = "10.81.0"  # not the tests' 10.77.0, the benchmark's 10.78.0 or the Slurm one's 10.79.0
SAMPLES = 256
STEPS = 120
TIMEOUT_S = 8.0  # dist.timeout_s: host 0 goes on before it (host 1 silent for 3 s)
CUT_S = 10.0


@pytest.fixture(autouse=True)
def _needs_hosts() -> None:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)


def records(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def wait_for_step(run_dir: Path, step: int, launches: list[Launch], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert all(x.alive() for x in launches), [x.text()[-3000:] for x in launches]
        if any(r.get("kind") == "train" and r["step"] >= step for r in records(run_dir)):
            return
        time.sleep(0.1)
    raise AssertionError(f"no step {step} in {timeout}s")


def test_a_host_cut_off_for_10s_the_other_trains_on_and_it_rejoins_healed(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(
        run_dir,
        train={"steps": STEPS, "log_every": 1},
        task={"slow_ms": 60, "samples": SAMPLES},
        fault={"recovery": "inplace", "audit_sample_ids": True},
        dist={"timeout_s": TIMEOUT_S, "connect_timeout_s": 5.0},
    )
    config = tmp_path / "job.toml"
    config.write_text(cfg.to_toml())
    with Hosts(2, prefix=PREFIX, hostnames=True, subnet=SUBNET) as hosts:
        endpoint = f"{hosts.address(0)}:29400"
        launches = [
            Launch(
                config,
                1,
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--rdzv-endpoint",
                endpoint,
                "--run-id",
                "inplace-hosts",
                "--max-restarts",
                "1",
                cwd=REPO,
                exec_prefix=hosts.exec_prefix(i),
            )
            for i in (0, 1)
        ]
        try:
            wait_for_step(run_dir, 10, launches)
            cut = time.time()
            hosts.set_link(1, up=False)
            time.sleep(CUT_S)
            hosts.set_link(1, up=True)
            back = time.time()
            codes = [x.wait(240) for x in launches]
        finally:
            for x in launches:
                x.close()
    texts = "\n".join(x.text()[-4000:] for x in launches)
    assert codes == [0, 0], texts
    runs = records(run_dir)
    assert not any(r.get("name") == "resumed" for r in runs), texts  # no checkpoint read
    changes = [r for r in runs if r.get("name") == "membership"]
    left = [r for r in changes if 1 in r["left"]]
    joined = [r for r in changes if 1 in r["joined"]]
    assert left and left[0]["members"] == [0], changes
    assert joined and joined[0]["members"] == [0, 1] and joined[0]["healed_from"] == 0, changes
    # Host 0 trained on while host 1 was cut off ...
    trained = [r for r in runs if r.get("kind") == "train" and cut < r["time"] < back]
    assert trained, changes
    # ... and host 1 trained with it again after the link came back.
    assert joined[0]["time"] > back, (joined, back)
    assert joined[0]["step"] < STEPS
    audit = check_stream(read_trajectory(run_dir), SAMPLES)
    assert audit.exactly_once and not audit.gaps and audit.positions == STEPS * 8, audit
    first_alone = min(r["time"] for r in trained)
    # Not after the collective timeout: host 1's workers fell silent, so the coordinator had
    # host 0 shut down its connections to them (dtrain.fault.sever).
    assert first_alone - cut < TIMEOUT_S, (first_alone - cut, texts)
    print(
        f"link down -> host 0's next step {first_alone - cut:.2f}s "
        f"(dist.timeout_s = {TIMEOUT_S}); link up -> host 1 rejoined "
        f"{joined[0]['time'] - back:.2f}s; steps trained while cut off: {len(trained)}"
    )
