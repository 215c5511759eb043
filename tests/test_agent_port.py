"""The port of the job's store on one machine: held by the launcher from the moment torch's
agent could have lost it until the job ends (dtrain.launch.agent)."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from dtrain.launch.agent import held_port
from tests.conftest import REPO

# A worker of one rank: before it hosts the store, another process tries the port it was
# given (a plain bind, as the kernel hands a free port to anyone); then it hosts the store.
WORKER = """
import datetime, os, socket, sys
import torch.distributed as dist
port = int(os.environ["MASTER_PORT"])
thief = socket.socket()
try:
    thief.bind(("127.0.0.1", port))
    taken = "taken"
except OSError:
    taken = "refused"
thief.close()
store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=10))
open(sys.argv[1], "w").write(f"{taken} {store.port == port}")
"""

# Runs WORKER as the one worker of a standalone job, the store port held or torch's pick.
LAUNCHER = """
import os, sys, uuid
os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"  # as dtrain.launch.launcher: rank 0 hosts it
from torch.distributed.launcher.api import LaunchConfig
from dtrain.launch.agent import held_port, run_agent
from dtrain.dist.secret import JobSecret
secret = JobSecret(b"a test's job secret")
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1, run_id=uuid.uuid4().hex,
                      rdzv_backend="c10d", rdzv_endpoint="localhost:0", monitor_interval=0.1,
                      start_method="spawn")
args = ("-c", sys.argv[1], sys.argv[2])
if sys.argv[3] == "held":
    with held_port() as port:
        run_agent(config, args, port, secret)
else:
    run_agent(config, args, None, secret)
"""


def worker_saw(tmp_path: Path, mode: str) -> str:
    out = tmp_path / f"{mode}.txt"
    proc = subprocess.run(
        [sys.executable, "-c", LAUNCHER, WORKER, str(out), mode],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out.read_text()


def test_the_store_port_of_a_standalone_job_cannot_be_taken_before_rank_0_hosts_it(
    tmp_path: Path,
) -> None:
    # torch's pick is free for anyone until rank 0 binds it (the race CI lost once) ...
    assert worker_saw(tmp_path, "torch") == "taken True"
    # ... the held port is refused to others and rank 0 still hosts the store on it.
    assert worker_saw(tmp_path, "held") == "refused True"


def test_a_held_port_is_skipped_by_the_kernel_and_open_to_the_store() -> None:
    with held_port() as port:
        picked = set()
        for _ in range(2000):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                picked.add(probe.getsockname()[1])
        assert port not in picked
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        # Hosted, closed and hosted again (a restart attempt), clients on loopback each time.
        for attempt in range(2):
            server = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=10),
            )
            client = dist.TCPStore(  # type: ignore[attr-defined]
                "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10)
            )
            client.set("attempt", str(attempt))
            assert server.get("attempt") == str(attempt).encode()
            del client, server
