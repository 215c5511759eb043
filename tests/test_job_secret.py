"""The job's secret and what it guards: sealed values, torch's rendezvous state sealed, the
stores a job hosts listening on loopback only, and a stranger who writes into a running job's
rendezvous store (docs/security.md)."""

from __future__ import annotations

import base64
import hmac
import os
import pickle
import re
import subprocess
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from dtrain.dist.rendezvous import (
    SealedRendezvousBackend,
    check_secret,
    make_handler,
    post_secret_check,
    state_key,
)
from dtrain.dist.secret import (
    SECRET_ENV,
    SECRET_FILE_ENV,
    JobSecret,
    configured_secret,
    launcher_secret,
)
from dtrain.dist.stores import host_store
from dtrain.errors import UserError
from tests.conftest import REPO, tiny_config
from tests.processes import Launch, children_of, metrics_records

SECRET = JobSecret(b"the job's secret, for the tests")
JOB_SECRET = JobSecret(os.environ[SECRET_ENV].encode())  # the jobs' the tests start (conftest)


class Planted:
    """A pickle that, unpickled, writes a file: what a stranger hides in a value that torch
    would unpickle."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.write_text, (self.marker, "code ran"))


# -- sealed values ----------------------------------------------------------------------------


def test_a_sealed_value_opens_only_under_its_secret_and_its_key() -> None:
    sealed = SECRET.seal("k", b"value")
    assert SECRET.unseal("k", sealed) == b"value"
    assert SECRET.unseal("other", sealed) is None  # moved to another key
    assert JobSecret(b"another secret").unseal("k", sealed) is None
    assert SECRET.unseal("k", sealed[:-1] + b"w") is None  # altered
    assert SECRET.unseal("k", b"value") is None  # never sealed
    assert SECRET.unseal("k", b"") is None


def test_a_seal_is_hmac_sha256_of_the_key_s_name_and_the_value() -> None:
    # The format machines of one job share, whatever computes it: a launcher of another
    # version must open what this one seals (the digest is hmac.digest's one-shot now).
    name, value = "inplace/member/3/want", b'{"after": 0}'
    mac = hmac.new(b"the job's secret, for the tests", name.encode() + b"\0" + value, "sha256")
    assert SECRET.seal(name, value) == b"dtrain-hmac1:" + mac.hexdigest().encode() + b":" + value


def test_the_secret_comes_from_the_variable_or_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert configured_secret() is None
    with pytest.raises(UserError, match=f"needs the job's secret: .*{SECRET_FILE_ENV}"):
        launcher_secret(multi_machine=True)
    made = launcher_secret(multi_machine=False)  # one machine: made for the job
    assert len(os.environ[SECRET_ENV]) == 64
    assert made.unseal("k", JobSecret(os.environ[SECRET_ENV].encode()).seal("k", b"v")) == b"v"

    monkeypatch.delenv(SECRET_ENV)
    path = tmp_path / "secret"
    path.write_text("0123456789abcdef0123\n")
    path.chmod(0o644)
    monkeypatch.setenv(SECRET_FILE_ENV, str(path))
    with pytest.raises(UserError, match=r"readable by other users .*chmod 600"):
        configured_secret()
    path.chmod(0o600)
    assert configured_secret() == "0123456789abcdef0123"
    launcher_secret(multi_machine=True)
    assert os.environ[SECRET_ENV] == "0123456789abcdef0123"  # what the workers read
    assert SECRET_FILE_ENV not in os.environ

    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(UserError, match="5 characters; use at least 16"):
        configured_secret()


def test_a_machine_with_another_secret_is_refused_by_the_rendezvous_check() -> None:
    store = host_store("127.0.0.1", 0, 10.0)
    client = dist.TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=10))
    check_secret(client, SECRET, "here:1")  # nothing posted yet
    post_secret_check(store, SECRET)
    check_secret(client, SECRET, "here:1")
    with pytest.raises(UserError, match="started with another job secret than this machine"):
        check_secret(client, JobSecret(b"another secret"), "here:1")


# -- torch's rendezvous state, sealed ---------------------------------------------------------


def test_a_forged_rendezvous_state_is_never_unpickled_and_the_next_write_replaces_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = host_store("127.0.0.1", 0, 10.0, multi_tenant=True)
    ours, theirs = (SealedRendezvousBackend(store, "job", SECRET) for _ in range(2))
    first = pickle.dumps({"state": 1})
    state, token, written = ours.set_state(first, None)  # type: ignore[misc]
    assert (state, written) == (first, True)
    assert theirs.get_state()[0] == first  # type: ignore[index]
    older = bytes(store.get(ours.key))
    second = pickle.dumps({"state": 2})
    assert ours.set_state(second, token)[2]  # type: ignore[index]
    assert theirs.get_state()[0] == second  # type: ignore[index]

    marker = tmp_path / "marker"
    forged = {
        "a pickle that writes a file": pickle.dumps(Planted(marker)),
        "a seal of another secret": JobSecret(b"guess").seal(ours.key, b"\0" * 8 + b"x"),
        "an older state replayed": older,
        "malformed bytes": b"dtrain-hmac1:zz",
    }
    for what, value in forged.items():
        store.set(ours.key, value)
        got = theirs.get_state()
        assert got is not None, what
        assert got[0] == second, what  # the last state that opened, not the stranger's
        assert pickle.loads(got[0]) == {"state": 2}
        assert not marker.exists(), what
    assert capsys.readouterr().err.count("ignored the value of rendezvous key 'dtrain/rendez") == 4

    # The job's next write (its token: the raw value read) replaces the forged one.
    state, token, written = theirs.set_state(pickle.dumps({"state": 3}), got[1])  # type: ignore[misc]
    assert written and pickle.loads(ours.get_state()[0]) == {"state": 3}  # type: ignore[index]


def test_torch_s_rendezvous_handler_rides_over_a_forged_state(tmp_path: Path) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    store = host_store("127.0.0.1", 0, 10.0, multi_tenant=True)
    params = RendezvousParameters(
        backend="c10d", endpoint=f"127.0.0.1:{store.port}", run_id="job", min_nodes=1, max_nodes=1
    )
    handler = make_handler(params, store, SECRET)
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    marker = tmp_path / "marker"
    key = state_key(SECRET, "job")
    assert key.startswith("dtrain/rendezvous/") and "job" not in key  # no name to guess
    store.set(key, pickle.dumps(Planted(marker)))
    # A sync reads the state (as each keep-alive does): the forged value is ignored.
    assert handler.num_nodes_waiting() == 0
    assert not marker.exists()
    handler.shutdown()  # closes the rendezvous: a sealed write over the forged value
    assert SECRET.unseal(key, bytes(store.get(key)))


# -- a real job, and a stranger on its machine --------------------------------------------------


def listening(pids: set[int]) -> list[str]:
    """The local addresses (ADDRESS:PORT) that processes ``pids`` listen on."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        owners = {int(pid) for pid in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[3])
    return found


def final_loss(run_dir: Path) -> float:
    return [r for r in metrics_records(run_dir) if r.get("kind") == "train"][-1]["loss"]


@pytest.mark.parametrize("recovery", ["restart", "inplace"])
def test_a_stranger_cannot_steer_a_single_machine_job(tmp_path: Path, recovery: str) -> None:
    """The job's sockets are all on loopback; a stranger on the machine who writes into the
    store its launcher hosts (torch's rendezvous; in place, the membership store) runs no code
    and steers nothing, and the job trains as an untouched one does."""
    runs = {name: tmp_path / f"{name}-run" for name in ("untouched", "attacked")}
    launches = {}
    for name, run_dir in runs.items():
        config = tmp_path / f"{name}.toml"
        cfg = tiny_config(run_dir, train={"steps": 40}, fault={"recovery": recovery})
        config.write_text(cfg.to_toml())
        launches[name] = Launch(config, 2, "--run-id", name, cwd=REPO)
    attacked = launches["attacked"]
    marker = tmp_path / "marker"
    deadline = time.monotonic() + 60
    while not listening({attacked.pid}):  # the store the launcher hosts, once it is up
        assert attacked.alive() and time.monotonic() < deadline, attacked.text()[-3000:]
        time.sleep(0.05)
    for address in listening({attacked.pid}):
        host, port = address.rsplit(":", 1)
        stranger = dist.TCPStore(host, int(port), timeout=timedelta(seconds=10))
        planted = pickle.dumps(Planted(marker))
        stranger.set("torch.rendezvous.attacked", base64.b64encode(planted))  # torch's own form
        # The state's own key, as only one who reads the job's traffic (or has the secret) finds.
        stranger.set(state_key(JOB_SECRET, "attacked"), planted)
        # In-place recovery's: a stop, the end of the job, a member gone.
        stranger.set("inplace/stopped", b'{"reason": "a stranger says stop"}')
        stranger.set("inplace/done", b"true")
        stranger.set("inplace/member/1/state", b'{"state": "down"}')
    sockets: set[str] = set()
    while attacked.alive():  # every socket the job listens on, as they come and go
        sockets.update(listening({attacked.pid, *children_of(attacked.pid)}))
        time.sleep(0.05)
    codes = {name: launch.proc.wait(timeout=180) for name, launch in launches.items()}
    assert codes == {"untouched": 0, "attacked": 0}, attacked.text()[-3000:]
    assert not marker.exists()
    if recovery == "restart":
        warned = f"ignored the value of rendezvous key '{state_key(JOB_SECRET, 'attacked')}'"
    else:  # the members read the stop as they start (the one a tester's stranger had used)
        warned = "ignored the value of store key 'inplace/stopped'"
    assert warned in attacked.text(), attacked.text()[-3000:]
    assert final_loss(runs["attacked"]) == final_loss(runs["untouched"])
    # The launcher's rendezvous store, rank 0's job store, gloo, the start-up probe: loopback.
    assert len(sockets) >= 4 and all(s.startswith("127.0.0.1:") for s in sockets), sockets


def test_dtrain_rendezvous_needs_the_secret_and_listens_on_the_address_it_is_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import signal
    import socket
    import sys

    from dtrain.launch.rendezvous_host import serve

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(UserError, match="dtrain rendezvous needs the job's secret"):
        serve(29400, "127.0.0.1")
    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, SECRET_ENV: "the job's secret, for the tests"}
    command = [sys.executable, "-m", "dtrain", "rendezvous", "--port", str(port), "--bind"]
    server = subprocess.Popen(
        [*command, "127.0.0.1"], env=env, stderr=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        assert server.stderr is not None
        said = server.stderr.readline()
        assert f"listening on 127.0.0.1:{port}" in said, said
        assert listening({server.pid}) == [f"127.0.0.1:{port}"]
        client = dist.TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
        check_secret(client, SECRET, f"127.0.0.1:{port}")  # the check it posted opens
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0


def test_a_job_s_environment_is_the_launcher_s_only_while_the_job_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dtrain.dist.job_env import job_environment

    for name in (SECRET_ENV, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    with job_environment(multi_machine=False):
        assert len(os.environ[SECRET_ENV]) == 64
        assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    # A multi-machine job started next in this process must not inherit either.
    assert not {SECRET_ENV, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"} & set(os.environ)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    with job_environment(multi_machine=False):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
