"""Which preemption signals torch's launcher forwards to the workers: ``dtrain train`` makes it
forward every ``fault.preempt_signals``; under plain ``torchrun`` a worker says which it would
not, and how to start torchrun so that it does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dtrain.fault.preempt import signals_to_forward, unforwarded, unforwarded_warning
from tests.conftest import REPO
from tests.test_launcher_faults import wait_for_step, write_config

AGENT = {"TORCHELASTIC_RUN_ID": "job"}


def test_the_launcher_is_told_to_forward_every_preemption_signal() -> None:
    assert signals_to_forward(["SIGTERM", "SIGUSR1"], {}) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
    # A list the user gave torch already stands; ours are added to it.
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR2"}
    assert signals_to_forward(["SIGUSR1"], env) == "SIGTERM,SIGUSR2,SIGUSR1"


def test_a_worker_under_plain_torchrun_knows_which_signals_would_kill_its_launcher() -> None:
    assert unforwarded(["SIGTERM", "SIGUSR1"], AGENT) == ["SIGUSR1"]
    forwarded = AGENT | {"TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGUSR1"}
    assert unforwarded(["SIGTERM", "SIGUSR1"], forwarded) == []
    assert unforwarded(["SIGUSR1"], {}) == []  # no launcher: one plain process
    words = unforwarded_warning(["SIGUSR1"])
    assert "--signals-to-handle=" in words and "SIGUSR1" in words


@pytest.mark.slow
def test_sigusr1_under_plain_torchrun_saves_where_torchrun_is_told_to_forward_it(
    tmp_path: Path,
) -> None:
    # torch 2.13's torchrun forwards what --signals-to-handle names; without SIGUSR1 in it the
    # signal kills torchrun, and a worker warned at start.
    for forward in (False, True):
        run_dir = tmp_path / f"forward-{forward}"
        config = write_config(tmp_path / f"forward-{forward}.toml", run_dir)
        flags = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"] if forward else []
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        worker = ["-m", "dtrain.worker", str(config), "--train.steps=300"]
        proc = subprocess.Popen(
            [*torchrun, "--nproc-per-node=2", *flags, *worker],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        wait_for_step(run_dir, 3, proc)
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGUSR1)
        _out, err = proc.communicate(timeout=60)
        state = (run_dir / "status.json").read_text()
        if forward:
            assert '"preempted"' in state and "SIGUSR1" in state, err[-3000:]
            assert "warning: fault.preempt_signals" not in err
        else:
            assert proc.returncode == -signal.SIGUSR1  # killed; nothing saved at the signal
            assert '"running"' in state
            assert "start torchrun with --signals-to-handle=" in err


_EARLY = """
import os, signal, sys
from dtrain.fault.preempt import PreemptionFlag, catch_early, settle_early
catch_early()                       # a worker's first moment: the default signals
os.kill(os.getpid(), signal.SIGUSR1)  # start-up: Slurm's --signal=USR1@N came early
settle_early(sys.argv[1:])          # the config is read: its signals
flag = PreemptionFlag(sys.argv[1:])  # the trainer's flag
print(flag.signal_name)
"""


def test_a_preemption_signal_during_start_up_is_remembered_not_fatal() -> None:
    def run(*names: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-c", _EARLY, *names], capture_output=True, text=True, timeout=60
        )

    remembered = run("SIGTERM", "SIGUSR1")
    assert remembered.returncode == 0 and remembered.stdout.strip() == "SIGUSR1"
    # A config that does not name it: the signal's default action, as before.
    assert run("SIGTERM").returncode == -signal.SIGUSR1


_CTRL_C_EARLY = """
import os, signal
from dtrain.fault.preempt import catch_early, settle_early
catch_early()  # SIGINT among them
settle_early(["SIGTERM"])  # a config without it: Ctrl-C is Python's KeyboardInterrupt again
try:
    os.kill(os.getpid(), signal.SIGINT)
except KeyboardInterrupt:
    print("KeyboardInterrupt")
"""


def test_ctrl_c_left_out_of_the_config_is_a_keyboard_interrupt_again() -> None:
    # Not the default action (the worker killed outright, none of its own clean-up run).
    run = subprocess.run(
        [sys.executable, "-c", _CTRL_C_EARLY], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0 and run.stdout.strip() == "KeyboardInterrupt", run.stderr


_TWICE = """
import os, signal
from dtrain.fault.preempt import PreemptionFlag, catch_early

def twice(signum, make):
    make()
    os.kill(os.getpid(), signum)  # saves at the next step
    first = "saves"
    try:
        os.kill(os.getpid(), signum)
        second = "saves"
    except KeyboardInterrupt:
        second = "stops at once"
    return f"{signal.Signals(signum).name}: {first}, then {second}"

flags = []
print(twice(signal.SIGINT, lambda: flags.append(PreemptionFlag(["SIGTERM", "SIGINT"]))))
print(flags[-1].signal_name)
print(twice(signal.SIGTERM, lambda: flags.append(PreemptionFlag(["SIGTERM", "SIGINT"]))))
print(twice(signal.SIGINT, catch_early))  # still starting: the default signals
"""


def test_the_first_ctrl_c_saves_and_a_second_one_stops_at_once() -> None:
    run = subprocess.run([sys.executable, "-c", _TWICE], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        "SIGINT: saves, then stops at once",
        "SIGINT",
        "SIGTERM: saves, then saves",  # a scheduler's repeated SIGTERM still saves
        "SIGINT: saves, then stops at once",
    ]
