"""Several hosts for real: `dtrain train` across network namespaces (scripts/hosts.sh), each
with its own network stack and address, where hostnames do not route (every namespace's
hostname resolves to 127.0.0.1). Training across them matches one host; a wrong address, a
wrong interface or an unreachable rendezvous host is one line naming it, within a bounded time.

Tests that need namespaces skip where they cannot be made (not root, no `ip`, no permission).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dtrain.cli import main
from dtrain.dist.network import check_port_free, choose_node_network, split_endpoint
from dtrain.dist.reachability import _accept_forever, close_listener, peers_of
from dtrain.launch.agent import held_port
from tests.conftest import REPO, tiny_config
from tests.hosts import Hosts, hosts_unavailable, launch_on_host, leftovers
from tests.processes import Launch

PREFIX = f"dt{os.getpid() % 100000}"  # the namespaces and links of this test process
CONNECT_S = 8  # dist.connect_timeout_s in the failure cases

# Namespace hosts share one subnet: these tests run one at a time under pytest-xdist.
pytestmark = pytest.mark.xdist_group("namespace-hosts")


def needs_hosts() -> None:
    reason = hosts_unavailable()
    if reason:
        pytest.skip(reason)


def write_job(tmp_path: Path, name: str = "job") -> tuple[Path, Path]:
    run_dir = tmp_path / f"{name}-run"
    config = tmp_path / f"{name}.toml"
    config.write_text(tiny_config(run_dir).to_toml())
    return config, run_dir


def on_hosts(hosts: Hosts, config: Path, per_host: list[list[str]], *common: str) -> list[Launch]:
    """`dtrain train --nnodes N --nproc 1` in every host, host 0 hosting the rendezvous."""
    endpoint = f"{hosts.address(0)}:29400"
    return [
        launch_on_host(hosts, i, config, endpoint, "multihost", *common, *args)
        for i, args in enumerate(per_host)
    ]


def finish(launches: list[Launch], timeout: float) -> list[int | None]:
    try:
        return [launch.wait(timeout) for launch in launches]
    finally:
        for launch in launches:
            launch.close()


def error_lines(launch: Launch) -> list[str]:
    return [line for _, line in launch.lines if line.startswith("dtrain: error: ")]


# -- in the parent, no namespaces needed ---------------------------------------------------


def test_each_rank_checks_rank_0_and_its_ring_neighbours() -> None:
    assert peers_of(0, 2) == [1] and peers_of(1, 2) == [0]
    assert peers_of(0, 8) == [1, 7] and peers_of(3, 8) == [0, 2, 4] and peers_of(7, 8) == [0, 6]
    for world in (2, 3, 5, 64):
        checks = [peers_of(rank, world) for rank in range(world)]
        assert max(len(c) for c in checks) <= 3  # cheap whatever the size
        assert {peer for c in checks for peer in c} == set(range(world))  # everyone is tried


def test_the_check_s_accept_thread_ends_when_its_socket_is_closed() -> None:
    # A thread blocked in accept() outlived a plain close() on Linux, and every worker's exit
    # then waited for it (2 s, the bound of join_helper_threads).
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    thread = threading.Thread(target=_accept_forever, args=(listener,), daemon=True)
    thread.start()
    time.sleep(0.05)  # in accept()
    close_listener(listener)
    thread.join(1.0)
    assert not thread.is_alive()


def test_a_node_advertises_the_address_it_reaches_the_rendezvous_host_from(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    assert choose_node_network("127.0.0.1:29400", "", "") == ("127.0.0.1", "lo")
    assert choose_node_network("", "", "") == (None, "")  # one machine: torch's defaults
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the user's own choice stands
    assert choose_node_network("127.0.0.1:29400", "", "") == ("127.0.0.1", "")
    assert split_endpoint("[::1]:29400") == ("::1", 29400)
    with pytest.raises(ValueError):
        split_endpoint("host0")


def test_an_interface_that_does_not_exist_is_one_line_in_the_parent(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    launched: list[object] = []
    monkeypatch.setattr("dtrain.launch.launcher.launch", lambda *args, **kw: launched.append(1))
    code = main(
        ["train", "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29400", "--iface", "nosuch0"]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("dtrain: error: --iface nosuch0: no such network interface")
    assert err.count("\n") == 1
    # Refused before the launch: nothing waited for the rendezvous (nobody listens there).
    assert not launched


def test_a_loopback_address_advertised_to_other_machines_is_refused(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The old bug, caught before any worker starts: the first machine would advertise its
    # hostname, 127.0.0.1 here, to machines that reach the rendezvous over a network.
    code = main(
        [
            "train",
            "--nnodes",
            "2",
            "--rdzv-endpoint",
            "10.77.0.1:29400",
            "--local-addr",
            "localhost",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2, err
    assert "is a loopback address here" in err and err.count("\n") == 1


def test_an_unreachable_rendezvous_endpoint_is_named_within_its_timeout(tmp_path: Path) -> None:
    config, _ = write_job(tmp_path)
    with held_port() as port:  # nothing listens there, and no one else can
        endpoint = f"127.0.0.1:{port}"
        command = [sys.executable, "-m", "dtrain", "train", str(config), "--nproc", "1"]
        command += ["--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", endpoint]
        result = subprocess.run(
            [*command, "--rdzv-timeout", "3"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    # Given up after the 3 s asked for (--rdzv-timeout), by dtrain's own wait for the host --
    # not after torch's rendezvous timeouts, which end in a traceback. A wait past its first
    # 5 s would have said so ("waiting for the rendezvous host ..."): this one never did.
    assert last.startswith(
        f"dtrain: error: --rdzv-endpoint {endpoint}: cannot reach the rendezvous host within 3s: "
    ), last
    assert "Traceback" not in result.stderr
    assert "waiting for the rendezvous host" not in result.stderr, result.stderr[-2000:]


# -- across namespaces ---------------------------------------------------------------------


def test_two_hosts_train_the_same_parameters_as_one_host_with_two_workers(
    tmp_path: Path,
) -> None:
    needs_hosts()
    config, one_host = write_job(tmp_path, "one")
    baseline = Launch(config, 2, cwd=REPO)
    assert finish([baseline], 300) == [0], baseline.text()[-3000:]

    config, two_hosts = write_job(tmp_path, "two")
    with Hosts(2, rate="1gbit", prefix=PREFIX) as hosts:
        # No --local-addr, no --iface: each host advertises the address it reaches host 0
        # from, and its collectives use that address's interface.
        launches = on_hosts(hosts, config, [[], []])
        codes = finish(launches, 300)
    assert codes == [0, 0], "\n".join(launch.text()[-2000:] for launch in launches)
    assert "training ddp on 2 rank(s)" in launches[0].text()

    final = "checkpoints/step-00000020/model.pt"
    expected = torch.load(one_host / final, weights_only=True)
    got = torch.load(two_hosts / final, weights_only=True)
    assert expected.keys() == got.keys()
    diff = max((expected[k] - got[k]).abs().max().item() for k in expected)
    print(f"largest parameter difference, 2 hosts x 1 vs 1 host x 2: {diff:.3g}")
    assert diff <= 1e-6


def test_an_advertised_address_nobody_has_fails_fast_naming_it(tmp_path: Path) -> None:
    needs_hosts()
    config, _ = write_job(tmp_path)
    bogus = "10.77.0.10"  # in the hosts' subnet, held by none: no route to it
    with Hosts(2, prefix=PREFIX) as hosts:
        launches = on_hosts(
            hosts,
            config,
            [["--local-addr", bogus], []],
            f"--dist.connect_timeout_s={CONNECT_S}",
        )
        codes = finish(launches, 120)
    text = "\n".join(launch.text() for launch in launches)
    assert codes == [2, 2], text[-4000:]
    # The node advertising 10.77.0.10 sorts first, so it is rank 0 and hosts the store there.
    # Both failed by the start-up checks, within dist.connect_timeout_s: not by a collective
    # or rendezvous timeout.
    (first,) = error_lines(launches[0])
    assert f"host {bogus} cannot host the job's store at {bogus}:" in first
    assert f" within {CONNECT_S}s: " in first, first
    # Node 0 fails at once (the address is none of its own), so node 1 may also see the
    # rendezvous it hosted go away; its own worker's line comes first.
    second = error_lines(launches[1])[0]
    assert f"host {hosts.address(1)} cannot reach the job's store at {bogus}:" in second
    assert f" within {CONNECT_S}s: " in second, second


def test_collectives_on_a_wrong_interface_fail_fast_naming_the_address(tmp_path: Path) -> None:
    needs_hosts()
    config, _ = write_job(tmp_path)
    with Hosts(2, prefix=PREFIX) as hosts:
        # Host 1 advertises the right address but puts its collectives on loopback.
        launches = on_hosts(
            hosts,
            config,
            [[], ["--local-addr", hosts.address(1), "--iface", "lo"]],
            f"--dist.connect_timeout_s={CONNECT_S}",
        )
        codes = finish(launches, 120)
    text = "\n".join(launch.text() for launch in launches)
    assert codes == [2, 2], text[-4000:]
    # Named by rank 0's start-up check of its peers' collective addresses (within
    # dist.connect_timeout_s), not by a collective timing out.
    (first,) = error_lines(launches[0])
    assert (
        f"host {hosts.address(0)} cannot reach rank 1 (host {hosts.address(1)}) at 127.0.0.1:"
        in first
    )
    assert f"the address its collectives use, within {CONNECT_S}s: " in first, first
    assert "pass --iface" in first
    # Host 1's own checks passed; it names the failure rank 0 found instead of a gloo error.
    (second,) = error_lines(launches[1])
    assert "the job cannot start: rank 0: host" in second


def test_an_unreachable_rendezvous_host_is_named(tmp_path: Path) -> None:
    needs_hosts()
    config, _ = write_job(tmp_path)
    endpoint = "10.77.0.50:29400"  # no host has that address
    with Hosts(2, prefix=PREFIX) as hosts:
        launch = Launch(
            config,
            1,
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--rdzv-endpoint",
            endpoint,
            "--rdzv-timeout",
            "5",
            cwd=REPO,
            exec_prefix=hosts.exec_prefix(1),
        )
        (code,) = finish([launch], 120)
    assert code == 2, launch.text()[-3000:]
    # Given up after the 5 s asked for (--rdzv-timeout), by dtrain's own wait for the host,
    # which says so when it waits longer than 5 s: it did not.
    (line,) = error_lines(launch)
    assert line.startswith(
        f"dtrain: error: --rdzv-endpoint {endpoint}: cannot reach the rendezvous host within 5s: "
    ), line
    assert "waiting for the rendezvous host" not in launch.text(), launch.text()[-3000:]


def test_plain_torchrun_without_local_addr_names_the_loopback_store(tmp_path: Path) -> None:
    # The old bug itself, under plain torchrun (dtrain train refuses it before it starts):
    # the first host advertises its hostname, which resolves to 127.0.0.1. The workers' own
    # check names the address and says what to pass, instead of hanging for the timeout.
    needs_hosts()
    config, _ = write_job(tmp_path)
    with Hosts(2, prefix=PREFIX) as hosts:
        procs = [
            hosts.popen(
                i,
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
                + ["--nproc-per-node", "1", "--rdzv-backend", "c10d"]
                + ["--rdzv-endpoint", f"{hosts.address(0)}:29400", "--rdzv-id", "plain"]
                + (["--rdzv-conf", "is_host=true"] if i == 0 else [])
                + ["-m", "dtrain.worker", str(config), f"--dist.connect_timeout_s={CONNECT_S}"],
                cwd=REPO,
                start_new_session=True,
            )
            for i in range(2)
        ]
        outputs = []
        try:
            for proc in procs:
                outputs.append(proc.communicate(timeout=120)[0])
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
                    proc.wait()
    text = "\n".join(outputs)
    assert all(proc.returncode != 0 for proc in procs), text[-4000:]
    # Named by the workers' start-up check of the store's address, within
    # dist.connect_timeout_s: not by a collective or rendezvous timeout.
    assert "cannot reach the job's store at" in text and "--local-addr ADDR" in text, text[-4000:]
    within = rf"cannot reach the job's store at \S+ .* within {CONNECT_S}s: "
    assert re.search(within, text), text[-4000:]


# -- the helper itself -----------------------------------------------------------------------


def test_hosts_reach_each_other_and_are_removed_even_when_the_body_raises() -> None:
    needs_hosts()
    with pytest.raises(RuntimeError, match="the body failed"), Hosts(2, prefix=PREFIX) as hosts:
        assert leftovers(PREFIX)  # up: namespaces, veths, bridge
        # Every host's hostname means loopback: only addresses route.
        probe = "import socket; print(socket.gethostbyname(socket.gethostname()))"
        assert hosts.run(1, [sys.executable, "-c", probe]).stdout.strip() == "127.0.0.1"
        listener = hosts.popen(
            0,
            [
                sys.executable,
                "-c",
                "import socket; s = socket.socket(); s.bind(('10.77.0.1', 5001)); s.listen();"
                "print('up', flush=True); c, a = s.accept(); print(a[0])",
            ],
        )
        assert listener.stdout is not None and listener.stdout.readline().strip() == "up"
        client = "import socket; socket.create_connection(('10.77.0.1', 5001), timeout=5)"
        assert hosts.run(1, [sys.executable, "-c", client]).returncode == 0
        assert listener.communicate(timeout=10)[0].strip() == hosts.address(1)
        raise RuntimeError("the body failed")
    assert leftovers(PREFIX) == []


def test_hosts_take_the_subnet_they_are_given() -> None:
    # A benchmark's hosts beside the tests' (benchmarks/control_plane.py --hosts: 10.78.0).
    needs_hosts()
    with Hosts(2, prefix=PREFIX, subnet="10.79.0") as hosts:
        assert hosts.addresses == ["10.79.0.1", "10.79.0.2"]
        shown = hosts.run(1, ["ip", "-o", "-4", "addr", "show", "dev", "eth0"]).stdout
        assert " 10.79.0.2/24 " in shown, shown
    assert leftovers(PREFIX) == []


def test_no_namespace_veth_or_bridge_is_left() -> None:
    needs_hosts()
    assert leftovers(PREFIX) == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert PREFIX not in names


def test_a_rendezvous_port_another_listener_holds_is_one_line_before_any_worker() -> None:
    # The machine that hosts the rendezvous found its port taken only inside torch: a
    # traceback (in-place recovery's store: EADDRINUSE) or "The connection to the C10d store
    # has failed" (restart mode).
    from dtrain.errors import UserError

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    with pytest.raises(UserError) as caught:
        check_port_free(f"127.0.0.1:{port}")
    listener.close()
    words = str(caught.value)
    assert f"cannot listen on port {port} (Address already in use" in words and "\n" not in words
    with held_port() as held:  # bound without listening, as dtrain's launcher holds a port
        check_port_free(f"127.0.0.1:{held}")  # the store binds it as this probe does
