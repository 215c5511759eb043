"""Starting the workers for ``fault.recovery = 'inplace'``: one torch elastic agent per worker.

With one agent per worker, an agent that sees its worker die restarts that worker alone
(``--max-restarts`` times); the others go on. The launcher hosts the job's membership store
and its :class:`~dtrain.fault.membership.Coordinator`, which the workers reach at
``$DTRAIN_INPLACE_COORDINATOR``. Each agent is restart mode's launch for one worker
(:func:`run_agent`: torch's elastic agent with its own rendezvous on a free port), so restarts,
signal forwarding and failure reports are those of restart mode. One machine for now:
``--nnodes`` above 1 is refused before any worker starts.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from dtrain.fault.membership import (
    COORDINATOR_ENV,
    MEMBER_ENV,
    MEMBERS_ENV,
    Coordinator,
    open_store,
)
from dtrain.fault.status import RunStatus, read_status
from dtrain.launch import LaunchOptions

# How long the beats of a member may stop before it counts as gone (a stopped or hung
# process on this machine is seen at once through /proc; this is the backstop).
STALE_S = 3.0


def _die_with_launcher() -> None:
    """In each agent, before it starts: end with the launcher (Linux), as its workers end with
    it, so that a launcher killed outright leaves nothing behind."""
    import ctypes

    try:
        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def agent_command(
    config_path: Path, max_restarts: int, grace_s: float, timeout_s: float, signals: Sequence[str]
) -> list[str]:
    """One worker's agent: :func:`run_agent` in a process of its own."""
    return [
        sys.executable,
        "-m",
        "dtrain.launch_inplace",
        str(config_path),
        str(max_restarts),
        str(grace_s),
        str(timeout_s),
        ",".join(signals),
    ]


def run_agent(argv: Sequence[str]) -> int:
    """``python -m dtrain.launch_inplace CONFIG MAX_RESTARTS GRACE_S TIMEOUT_S SIGNALS``: the
    elastic launch of restart mode (:func:`dtrain.launch.launch_workers`) for one worker, with
    its own rendezvous: its restarts, signal forwarding and failure report are restart mode's."""
    from dtrain.console import say_error
    from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
    from dtrain.launch import launch_workers

    config_path, restarts, grace_s, timeout_s, signals = argv
    opts = LaunchOptions(nproc=1, max_restarts=int(restarts), run_id=uuid.uuid4().hex[:12])
    try:
        return launch_workers(
            Path(config_path),
            opts,
            grace_s=float(grace_s),
            preempt_signals=[name for name in signals.split(",") if name],
            collective_timeout_s=float(timeout_s),
        )
    except UserError as exc:
        say_error(str(exc))
        return USER_ERROR_EXIT_CODE


def launch_in_place(
    config_path: Path,
    opts: LaunchOptions,
    grace_s: float = 120.0,
    preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
    collective_timeout_s: float = 300.0,
    min_replicas: int = 1,
) -> int:
    """Run the job; the exit code for the CLI: 0 once the run completed (or saved on a
    preemption signal); 1 when a failure left fewer than ``min_replicas`` workers (they saved
    and stopped); else the first failing agent's."""
    store = open_store("0.0.0.0", 0, collective_timeout_s, is_master=True)
    # A member that has not asked for the next generation within the collective timeout
    # (and a little) of the first one that did is stuck: it is left out, and rejoins.
    coordinator = Coordinator(
        store,
        opts.nproc,
        stale_s=STALE_S,
        hang_s=collective_timeout_s + 5.0,
        min_members=min_replicas,
    )
    coordinator.start()
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[COORDINATOR_ENV] = f"127.0.0.1:{store.port}"
    env[MEMBERS_ENV] = str(opts.nproc)
    command = agent_command(
        config_path, opts.max_restarts, grace_s, collective_timeout_s, preempt_signals
    )
    agents = [
        subprocess.Popen(command, env={**env, MEMBER_ENV: str(m)}, preexec_fn=_die_with_launcher)
        for m in range(opts.nproc)
    ]
    signalled: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        signalled.append(signum)
        for agent in agents:
            if agent.poll() is None:
                agent.send_signal(signum)

    names = set(preempt_signals) | {"SIGINT", "SIGTERM"}
    previous = {name: signal.signal(getattr(signal, name), forward) for name in names}
    try:
        codes = [_wait(agent) for agent in agents]
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        coordinator.stop()
    status = read_status(config_path.parent)
    if coordinator.stopped:
        from dtrain.console import say_error

        say_error(stopped_words(coordinator.stopped, status))
        return 1
    if status is not None and status.state in ("completed", "preempted"):
        return 0
    failed = [code for code in codes if code != 0]
    if signalled and not failed:
        return 128 + signalled[0]
    return failed[0] if failed else 0


def stopped_words(reason: str, status: RunStatus | None) -> str:
    """The job stopped below fault.min_replicas: why, and what was saved."""
    from dtrain.checkpoint.layout import step_dir_name

    if status is not None and status.state == "stopped":
        saved = f"the survivors saved checkpoints/{step_dir_name(status.step)}"
        then = "run the same command again to resume from it"
    else:
        saved = "the survivors' checkpoint was not written (see above)"
        then = "run the same command again to resume from the newest checkpoint"
    return f"the job stopped: {reason}; {saved}; {then}"


def _wait(agent: subprocess.Popen[bytes]) -> int:
    while True:
        try:
            return agent.wait()
        except InterruptedError:  # pragma: no cover - a signal handler ran
            time.sleep(0.01)


if __name__ == "__main__":
    sys.exit(run_agent(sys.argv[1:]))
