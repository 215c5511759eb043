"""A stranger on a third namespace host against a two-host job (docs/security.md): it reaches
the rendezvous port, as anyone on the network between the machines can; every value it forges
there is ignored, no code runs, and the job trains as an untouched one does.

Both recovery modes: restart (torch's rendezvous at the endpoint) and in-place (dtrain's
membership store there). Slow (two two-host jobs each, ~25 s): `make test-slow`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from dtrain.dist.rendezvous import state_key
from dtrain.dist.secret import SECRET_ENV, JobSecret
from tests.conftest import REPO, tiny_config
from tests.hosts import Hosts, hosts_unavailable, launch_on_host
from tests.processes import Launch, metrics_records

PREFIX = f"ds{os.getpid() % 100000}"
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("namespace-hosts")]

# Written from host 2 into the store at host 0's endpoint, again and again while the job runs:
# torch's own rendezvous key (base64, as torch's backend keeps it), the job's shape and
# in-place recovery's keys, each a pickle or a value that would steer the job; and, once GO
# exists, a few times the sealed rendezvous state's own key, whose name only the secret gives.
STRANGER = """
import base64, datetime, pathlib, pickle, sys, time
import torch.distributed as dist

class Planted:
    def __reduce__(self):
        return (pathlib.Path.write_text, (pathlib.Path(sys.argv[3]), "code ran"))

host, port, run_id, state_key = sys.argv[1], int(sys.argv[2]), "secured", sys.argv[4]
planted = pickle.dumps(Planted())
store = None
sealed_writes = 0
for attempt in range(600):
    try:
        if store is None:
            store = dist.TCPStore(host, port, timeout=datetime.timedelta(seconds=5))
        store.set(f"torch.rendezvous.{run_id}", base64.b64encode(planted))
        store.set("dtrain/launch/shape", planted)
        if pathlib.Path(sys.argv[5]).exists() and sealed_writes < 3:
            # The state's own key, as one who reads the job's traffic finds it, once the job
            # trains. (Overwritten while the machines meet, the state they shared is lost
            # with it and the rendezvous stalls: a denial of service such a stranger has
            # anyway, by deleting keys; docs/security.md.)
            store.set(state_key, planted)
            sealed_writes += 1
        # In-place recovery's membership store is there instead: its stop, end and generation.
        store.set("inplace/stopped", b'{"reason": "a stranger says stop"}')
        store.set("inplace/done", b"true")
        store.set("inplace/gen/latest", b"7")
        store.set("inplace/member/1/state", b'{"state": "down"}')  # the coordinator polls it
        print("forged", flush=True)
    except Exception:
        store = None  # the job has not opened it yet, or has ended
    time.sleep(0.5)
"""


def final_loss(run_dir: Path) -> float:
    return [r for r in metrics_records(run_dir) if r.get("kind") == "train"][-1]["loss"]


def two_host_job(hosts: Hosts, config: Path, *extra: str) -> list[Launch]:
    endpoint = f"{hosts.address(0)}:29400"
    # Two of the three hosts: the third is the stranger's.
    return [
        launch_on_host(hosts, i, config, endpoint, "secured", *extra, nnodes=2) for i in range(2)
    ]


@pytest.mark.parametrize("recovery", ["restart", "inplace"])
def test_a_stranger_on_the_network_cannot_steer_a_two_host_job(
    tmp_path: Path, recovery: str
) -> None:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)
    marker = tmp_path / "marker"
    key = state_key(JobSecret(os.environ[SECRET_ENV].encode()), "secured")
    go = tmp_path / "go"  # the job trains: the stranger writes the sealed state's key too
    runs = {name: tmp_path / f"{name}-run" for name in ("untouched", "attacked")}
    with Hosts(3, prefix=PREFIX) as hosts:
        losses = {}
        for name, run_dir in runs.items():
            config = tmp_path / f"{name}.toml"
            cfg = tiny_config(
                run_dir,
                train={"steps": 60, "log_every": 1},
                task={"slow_ms": 150},
                fault={"recovery": recovery},
            )
            config.write_text(cfg.to_toml())
            stranger = None
            if name == "attacked":
                stranger = hosts.popen(
                    2,
                    [
                        sys.executable,
                        "-c",
                        STRANGER,
                        hosts.address(0),
                        "29400",
                        str(marker),
                        key,
                        str(go),
                    ],
                    cwd=REPO,
                )
            launches = two_host_job(hosts, config, "--max-restarts", "1")
            try:
                if stranger is not None:
                    deadline = time.monotonic() + 120
                    while not [r for r in metrics_records(run_dir) if r.get("kind") == "train"]:
                        assert time.monotonic() < deadline, launches[0].text()[-3000:]
                        time.sleep(0.1)
                    go.touch()
                codes = [launch.wait(120) for launch in launches]
            finally:
                for launch in launches:
                    launch.close()
                if stranger is not None:
                    stranger.kill()
                    said = stranger.communicate()[0]
            text = "\n".join(launch.text() for launch in launches)
            assert codes == [0, 0], text[-4000:]
            losses[name] = final_loss(run_dir)
        assert "forged" in said, said[-2000:]  # the stranger did reach the rendezvous store
        assert not marker.exists()
        if recovery == "restart":
            assert f"ignored the value of rendezvous key '{key}'" in text
        else:  # node 0's launcher hosts the membership store and ignores what it reads there
            assert "ignored the value of store key 'inplace/" in text, text[-3000:]
        assert losses["attacked"] == losses["untouched"]
