"""A user's mistakes in starting a job across machines: each one line, within a bounded time.

docs/multi-host.md's table "What is checked, and how fast it fails" lists them; the ones
caught by the config or a launcher's own checks are in test_cli.py, test_multi_host.py and
test_inplace_machines.py."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dtrain.dist.stores import host_store
from dtrain.launch.agent import held_port
from dtrain.launch.options import make_options
from dtrain.launch.rendezvous_wait import announce_waits
from dtrain.launch.reports import rendezvous_lost
from dtrain.recovery.coordinator import NOTICE_S, Coordinator
from dtrain.recovery.membership import PREFIX, read_text, write_value
from tests.conftest import REPO, tiny_config


class SlowHandler:
    """A rendezvous handler whose rendezvous completes when told to."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def next_rendezvous(self) -> str:
        self.done.wait(30)
        return "info"


def test_a_rendezvous_still_waiting_says_so_once_and_a_quick_one_says_nothing() -> None:
    said: list[str] = []
    handler = SlowHandler()
    announce_waits(handler, "waiting", after_s=0.05, say=said.append)
    finished = threading.Event()
    threading.Thread(target=lambda: (handler.next_rendezvous(), finished.set())).start()
    while not said:
        time.sleep(0.01)
    handler.done.set()
    finished.wait(30)
    assert said == ["waiting"]
    handler.next_rendezvous()  # done already: returns before the notice is due
    time.sleep(0.1)
    assert said == ["waiting"]


def test_a_rendezvous_that_timed_out_names_what_every_machine_must_share() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    opts = make_options(1, "2", 1, "127.0.0.1:29400", 0, "myjob", rdzv_timeout_s=30)
    assert rendezvous_lost(opts, RendezvousTimeoutError()) == (
        "--rdzv-endpoint 127.0.0.1:29400: the machines of job 'myjob' (--nnodes 2) did not all "
        "join within 30s (--rdzv-timeout): start `dtrain train` on every machine with the same "
        "--nnodes, --run-id, --rdzv-endpoint and job secret (a machine that refused to start says "
        "why on its own console)"
    )


def register_and_ask(store: Any, member: int) -> None:
    nonce = f"n{member}"
    info = {"pid": os.getpid(), "host": "here", "nonce": nonce}
    write_value(store, f"member/{member}/info", info)
    store.add(f"{PREFIX}member/{member}/beat", 1)
    write_value(store, f"member/{member}/want", {"after": -1, "nonce": nonce, "step": -1})


def test_inplace_names_the_machine_it_waits_for_and_gives_up_after_the_timeout() -> None:
    store = host_store("127.0.0.1", 0, 30.0)
    told: list[tuple[list[int], bool]] = []
    coordinator = Coordinator(
        store,
        6,
        stale_s=3.0,
        hang_s=30.0,
        local=[0, 1],
        per_node=2,
        join_timeout_s=60.0,
        on_wait=lambda nodes, gave_up: told.append((nodes, gave_up)),
    )
    for member in (0, 1, 2, 3):  # machines 0 and 1; machine 2's workers never ask
        register_and_ask(store, member)
    coordinator.poll()
    assert told == []  # the workers of machines started together may still be on their way
    coordinator._born -= NOTICE_S  # as if NOTICE_S had passed
    coordinator.poll()
    coordinator.poll()
    assert told == [([2], False)]  # once
    assert not store.check([f"{PREFIX}stopped"])
    coordinator._born -= 60.0
    coordinator.poll()
    assert told[-1] == ([2], True)
    words = "the workers of the machine(s) with --node-rank 2 did not join within 60s"
    assert coordinator.gave_up == coordinator.stopped == words
    # The workers waiting for the first generation read it, and end.
    assert read_text(store, "stopped") == words
    assert not store.check([f"{PREFIX}gen/latest"])


@pytest.mark.parametrize("recovery", ["restart", "inplace"])
def test_a_machine_whose_peers_never_join_says_so_and_gives_up_at_the_timeout(
    tmp_path: Path, recovery: str
) -> None:
    run_dir = tmp_path / "run"
    config = tmp_path / "job.toml"
    config.write_text(tiny_config(run_dir).to_toml())
    with held_port() as port:  # this launcher hosts the rendezvous there
        command = [sys.executable, "-m", "dtrain", "train", str(config), "--nproc", "1"]
        command += ["--nnodes", "2", "--node-rank", "0", "--rdzv-endpoint", f"127.0.0.1:{port}"]
        command += ["--run-id", "alone", "--rdzv-timeout", "12", f"--fault.recovery={recovery}"]
        result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    err = result.stderr
    assert result.returncode == 2, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    if recovery == "restart":  # torch's rendezvous waited 600 s whatever --rdzv-timeout said
        assert "dtrain: waiting for the other machines of job 'alone'" in err, err[-3000:]
        assert last.startswith(
            f"dtrain: error: --rdzv-endpoint 127.0.0.1:{port}: the machines of job 'alone' "
            "(--nnodes 2) did not all join within 12s (--rdzv-timeout)"
        ), last
    else:  # the first generation waited for ever
        assert (
            "dtrain: waiting for the workers of the machine(s) with --node-rank 1 to join" in err
        ), err[-3000:]
        assert last.startswith(
            f"dtrain: error: --rdzv-endpoint 127.0.0.1:{port}: the workers of the machine(s) "
            "with --node-rank 1 did not join within 12s (--rdzv-timeout)"
        ), last


def test_a_rank_interrupted_on_its_machine_is_named_so_to_the_others() -> None:
    from dtrain.fault.watchdog import failure_text

    # Was "KeyboardInterrupt: " after "rank 1 (host, pid) failed at step 130 in ...: ".
    assert failure_text(KeyboardInterrupt()) == (
        "interrupted by SIGINT (Ctrl-C on its machine), without saving"
    )
    assert failure_text(ValueError("bad")) == "ValueError: bad"


def test_a_member_waiting_for_the_first_generation_gives_up_when_told() -> None:
    from dtrain.recovery.membership import Member

    store = host_store("127.0.0.1", 0, 30.0)
    member = Member(f"127.0.0.1:{store.port}", 0, 2, 30.0)  # member 1 never comes
    try:
        member.ask(-1, -1)
        # A preemption signal before the first generation: nothing to save, the wait ends
        # (it waited for ever, until the agent's SIGKILL after fault.preempt_grace_s).
        assert member.wait(-1, give_up=lambda: True) is None
    finally:
        member.close()


def test_an_in_place_worker_s_failure_names_its_member_not_rank_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from types import SimpleNamespace

    from dtrain.launch.reports import report_failure

    # In-place recovery supervises each worker alone, as a job of one (its rank 0 on every
    # machine): the second machine's said "rank 0" for member 1.
    failure = SimpleNamespace(timestamp=0, exitcode=2, pid=4027, message="member 1: configs differ")
    code = report_failure({0: failure}, 0, tmp_path, "member 1")
    assert code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[1] == "  member 1 (pid 4027, exit code 2): member 1: configs differ"


def test_a_machine_started_with_another_nnodes_or_run_id_is_refused_by_the_host_s_shape() -> None:
    from dtrain.dist.secret import JobSecret
    from dtrain.errors import UserError
    from dtrain.launch.rendezvous_wait import share_shape

    store = host_store("127.0.0.1", 0, 30.0)  # as torch's rendezvous host's
    endpoint = f"127.0.0.1:{store.port}"
    secret = JobSecret(b"the job's secret")
    shape = {"--run-id": "myjob", "--nnodes": "2"}
    share_shape(endpoint, shape, hosting=False, secret=secret)  # none posted
    share_shape(endpoint, shape, hosting=True, secret=secret)
    share_shape(endpoint, shape, hosting=False, secret=secret)  # the same
    # Both sides waited in torch's rendezvous, each for machines of its own job.
    with pytest.raises(UserError) as refused:
        share_shape(endpoint, {"--run-id": "other", "--nnodes": "3"}, hosting=False, secret=secret)
    assert str(refused.value) == (
        f"--run-id other --nnodes 3 here, but the machine that hosts the rendezvous at "
        f"{endpoint} runs --run-id myjob --nnodes 2: start every machine of the job with the "
        "same --run-id and --nnodes"
    )


@pytest.mark.parametrize(
    ("message", "kept"),
    [
        ("failed (exitcode: 2) local_rank: 0 (pid: 4027) of binary: /usr/bin/python", False),
        ("Received 2 death signal, shutting down workers", False),
        ("Sending process 3368 closing signal SIGINT", False),
        ("Unable to shutdown process 10609 via 15, forcefully exiting via 9", True),
    ],
)
def test_torch_s_lines_of_what_the_launcher_reports_itself_are_dropped(
    message: str, kept: bool
) -> None:
    import logging

    from dtrain.launch.reports import ExpectedAtExit

    record = logging.LogRecord("torch", logging.WARNING, "api.py", 1, message, None, None)
    assert ExpectedAtExit().filter(record) is kept


def test_a_machine_the_job_never_admitted_is_told_so_when_it_ends() -> None:
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

    # A third launcher of a 2-machine job (two given --node-rank 1) waited in torch's wait
    # list; when the job ended, torch's agent returned no result: an AttributeError traceback.
    opts = make_options(1, "2", 1, "127.0.0.1:29400", 0, "myjob")
    assert rendezvous_lost(opts, RendezvousClosedError()) == (
        "--rdzv-endpoint 127.0.0.1:29400: job 'myjob' there closed its rendezvous without "
        "admitting this machine: it had its --nnodes 2 machines already (another machine "
        "started with the same --node-rank, or more machines than --nnodes?); nothing ran here"
    )


def test_an_agent_that_returns_no_result_is_a_closed_rendezvous(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.rendezvous.api import RendezvousClosedError
    from torch.distributed.launcher.api import LaunchConfig

    from dtrain.dist.secret import JobSecret
    from dtrain.launch.agent import run_agent

    monkeypatch.setattr(LocalElasticAgent, "run", lambda self: None)  # as on a graceful exit
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=1,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        run_id="t",
        shutdown_timeout=1,
    )
    with pytest.raises(RendezvousClosedError):
        run_agent(config, ("-c", "pass"), store_port=None, secret=JobSecret(b"a secret"))
