"""What the launcher says: a failed rendezvous, the failed ranks, a preemption, a job stopped
below ``fault.min_replicas``, each in a line or a few, with the exit code it stands for; and
torch's log lines of the same events, dropped."""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dtrain.console import say_error, say_line
from dtrain.dist.network import split_endpoint
from dtrain.dist.reachability import REFUSED, UNREACHABLE, describe, probe, wait_for_endpoint
from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
from dtrain.fault.error_log import LOGS_DIR
from dtrain.fault.status import RunStatus, read_status, write_status
from dtrain.launch.options import LaunchOptions, may_host_rendezvous, nnodes_text
from dtrain.launch.rendezvous_wait import timed_out_words

EXPECTED_LOGGERS = (
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class ExpectedAtExit(logging.Filter):
    """Drops torch's log lines of what the launcher reports itself, in its own line: that the
    rendezvous could not be closed (at the end of a job the machine that hosts it may exit
    first: a successful run printed it on 4 of 14 two-node Slurm jobs); that a worker failed
    (``failed (exitcode: 1) local_rank: 0 ...``: the failed ranks' report says so, with the
    error); that the agent got a signal and passes it on to its workers (``Received 2 death
    signal``, ``Sending process N closing signal SIGINT``: the preemption report says what
    the signal left). Its warning that a worker did not end and is killed stays."""

    PHRASES = (
        "failed to shutdown the rendezvous",
        "failed (exitcode:",
        "death signal, shutting down workers",
        "closing signal",
    )

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(phrase in message for phrase in self.PHRASES)


def quiet_expected_logs() -> None:
    """Torch's loggers of what the launcher reports itself: filtered (once)."""
    for name in EXPECTED_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, ExpectedAtExit) for f in log.filters):
            log.addFilter(ExpectedAtExit())


def rendezvous_lost(opts: LaunchOptions, exc: BaseException) -> str:
    """One line for a rendezvous that failed: what the endpoint says to a plain connection
    now (refused: the launcher that hosted it is gone; no answer: the network or the
    machine), and what to do."""
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousClosedError,
        RendezvousTimeoutError,
    )

    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    if not opts.rdzv_endpoint:
        return f"the rendezvous failed: {first}"
    if isinstance(exc, RendezvousClosedError):  # the job ran, and ended, without this one
        return (
            f"--rdzv-endpoint {opts.rdzv_endpoint}: job {opts.run_id!r} there closed its "
            f"rendezvous without admitting this machine: it had its --nnodes "
            f"{nnodes_text(opts)} machines already (another machine started with the same "
            "--node-rank, or more machines than --nnodes?); nothing ran here"
        )
    if isinstance(exc, RendezvousTimeoutError):  # the machines never all joined
        return timed_out_words(
            opts.rdzv_endpoint, opts.run_id, nnodes_text(opts), opts.rdzv_timeout_s
        )
    host, port = split_endpoint(opts.rdzv_endpoint)
    state, said = probe(host, port, 2.0)
    restart = (
        "start `dtrain train` again on every machine (the job resumes from its newest "
        "checkpoint), or run the rendezvous apart from the nodes (`dtrain rendezvous`, "
        "docs/multi-host.md)"
    )
    if state == REFUSED:
        return (
            f"lost the rendezvous host {opts.rdzv_endpoint}: it refuses connections ({said}): "
            f"the `dtrain train` that hosted it has ended or was killed; {restart}"
        )
    if state == UNREACHABLE:
        return (
            f"lost the rendezvous host {opts.rdzv_endpoint}: no network path to it ({said}): "
            f"the network or the machine is down; {restart}"
        )
    return f"rendezvous at {opts.rdzv_endpoint} failed: {first}"


def wait_for_rendezvous_host(opts: LaunchOptions) -> None:
    """Before joining: wait (up to the rendezvous timeout) for the rendezvous host to accept a
    connection, and name it when it does not -- torch's own attempt ends in a traceback after
    its read timeout, or retries in silence. Not on the node that hosts the rendezvous."""
    if opts.node_rank is None and may_host_rendezvous(opts):
        return  # this machine may be the host (torch decides by its addresses)
    host, port = split_endpoint(opts.rdzv_endpoint)

    def notice(reason: str) -> None:
        say_line(
            f"dtrain: waiting for the rendezvous host at {opts.rdzv_endpoint} ({reason}); "
            f"giving up after {opts.rdzv_timeout_s}s"
        )

    try:
        error = wait_for_endpoint(host, port, opts.rdzv_timeout_s, notice)
    except OSError as exc:  # the name does not resolve
        raise UserError(
            f"--rdzv-endpoint {opts.rdzv_endpoint}: {host} does not resolve ({exc})"
        ) from None
    if error is not None:
        raise UserError(
            f"--rdzv-endpoint {opts.rdzv_endpoint}: cannot reach the rendezvous host within "
            f"{opts.rdzv_timeout_s}s: {describe(error)} (is `dtrain train --node-rank 0` running "
            "there, and is the address right?)"
        )


def report_preemption(run_dir: Path, signum: int, at_once: bool = False, halted: str = "") -> int:
    """After the launcher itself got a preemption signal: 0 when the workers saved, whether
    the signal stopped them (``preempted``) or came too late to, after their last step:
    ``completed`` is written only once the final checkpoint is committed. ``at_once``: a
    second signal cut their grace short and they were killed (Ctrl-C twice); ``halted``:
    why, where that second signal came to another machine (:mod:`dtrain.recovery.halt`)."""
    status = read_status(run_dir)
    if status is not None and status.state == "preempted":
        say_line(
            f"dtrain: preempted by signal {signum}; saved at step {status.step}. Run "
            "the same command to resume."
        )
        return 0
    if status is not None and status.state == "completed":
        say_line(
            f"dtrain: signal {signum} arrived after the last step; the run completed and "
            f"saved its final checkpoint (step {status.step})"
        )
        return 0
    if halted:
        say_line(
            f"dtrain: stopped at once: {halted}; this machine's workers were killed unsaved. "
            "Run the same command on every machine to resume from the newest checkpoint."
        )
    elif at_once:
        say_line(
            f"dtrain: stopped at once by a second signal {signum}: the workers were killed "
            "unsaved; run the same command to resume from the newest checkpoint"
        )
    else:
        say_line(f"dtrain: stopped by signal {signum} before the workers could save")
    return 128 + signum


def record_failure(run_dir: Path) -> None:
    """The job failed for good: ``status.json`` says so, at the furthest step a rank's
    liveness record was in -- where the job failed (it said ``running`` at the step the last
    attempt started, and kept saying it after the job had ended)."""
    from dtrain.fault.liveness import read_run_liveness

    status = read_status(run_dir)
    if status is None or status.state != "running":
        return  # none written yet (nothing started), or it ended otherwise already
    steps = [status.step, *(beat.step for beat in read_run_liveness(run_dir).values())]
    write_status(run_dir, RunStatus("failed", max(steps)))


def report_failure(
    failures: Mapping[int, Any], max_restarts: int, run_dir: Path, who: str = ""
) -> int:
    """One line per failed rank (torch's ``ProcessFailure`` by rank; ``who``: how the job
    knows a lone one, an in-place member), the first failure first; exit 2 when every failure
    was a user error (the worker said so with exit code 2), else 1. The workers keep their
    full tracebacks in ``RUN_DIR/logs/`` (dtrain.fault.error_log)."""
    # Timestamps are whole seconds: within one, a rank that exited by itself comes before one
    # the agent ended with a signal once another had failed (it may have been on its way out
    # with the same error, which it recorded).
    ordered = sorted(
        failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode < 0, item[0])
    )
    say_line(f"dtrain: training failed (after up to {max_restarts + 1} attempt(s)); failed ranks:")
    # Ranks that failed alike (every rank's loss-contract error, the ranks the agent ended)
    # share one line: it listed the same 400 characters once per rank.
    groups: dict[tuple[str, str], list[tuple[int, Any]]] = {}
    for rank, failure in ordered:
        words = failure_words(failure.message, failure.exitcode)
        key = (exit_words(failure.exitcode), RANK_PREFIX.sub("", words))
        groups.setdefault(key, []).append((rank, failure))
    for (how, words), members in groups.items():
        if len(members) == 1:
            rank, failure = members[0]
            said = failure_words(failure.message, failure.exitcode)
            say_line(f"  {who or f'rank {rank}'} (pid {failure.pid}, {how}): {said}")
            continue
        ranks = ", ".join(str(rank) for rank, _ in members)
        pids = ", ".join(str(failure.pid) for _, failure in members)
        say_line(f"  ranks {ranks} (pids {pids}, {how}): {words}")
    if (run_dir / LOGS_DIR).is_dir():
        say_line(f"dtrain: the failed ranks' tracebacks are in {run_dir / LOGS_DIR}/")
    # The root cause decides: a user error (exit 2) on the first rank to fail, whatever the
    # others died of when the agent stopped them.
    user_error = bool(ordered) and ordered[0][1].exitcode == USER_ERROR_EXIT_CODE
    return USER_ERROR_EXIT_CODE if user_error else 1


# How a worker names itself at the head of its error ("rank 1: ...", "member 1: ...").
RANK_PREFIX = re.compile(r"^(rank|member) \d+: ")


def exit_words(exitcode: int) -> str:
    if exitcode == -signal.SIGKILL:
        return "killed by SIGKILL"
    if exitcode < 0:  # most often the agent's SIGTERM to the ranks left after one failed
        try:
            return f"ended by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"ended by signal {-exitcode}"
    return f"exit code {exitcode}"


def failure_words(message: object, exitcode: int) -> str:
    """The first line of a rank's error; for a rank killed by a signal (which leaves no error
    of its own), what may have sent it."""
    if exitcode == -signal.SIGKILL:
        return (
            "no error of its own: killed outright (kill -9, or the kernel's OOM killer when the "
            "machine ran out of memory: see `dmesg`)"
        )
    if exitcode < 0:
        return (
            "no error of its own: ended by the signal (torch's agent ends a job's other ranks "
            "so when one fails)"
        )
    if isinstance(message, dict):  # torch's error-file format: the message and a callstack
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    return lines[0] if lines else ""


def waiting_notice(opts: LaunchOptions, nodes: list[int]) -> None:
    """Node 0, before the first generation: the machines whose workers have not asked to join."""
    say_line(
        f"dtrain: waiting for the workers of the machine(s) with --node-rank "
        f"{', '.join(map(str, nodes))} to join at {opts.rdzv_endpoint} (still starting, not "
        "started, or refused: that machine's console says why); giving up after "
        f"{opts.rdzv_timeout_s}s"
    )


def join_timed_out(opts: LaunchOptions, why: str) -> str:
    return (
        f"--rdzv-endpoint {opts.rdzv_endpoint}: {why} (--rdzv-timeout): start `dtrain train` on "
        "every machine with the same config, --nnodes, --nproc and --rdzv-endpoint, each with "
        "its own --node-rank (a machine that refused to start says why on its own console)"
    )


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


def members_outcome(
    status: RunStatus | None, stopped: str, codes: list[int], signalled: list[int]
) -> int:
    """In place, once every member has ended (``codes``): 1 when the job stopped below
    fault.min_replicas (``stopped``: why; said here), 0 when the run completed or saved on a
    preemption; else the first failing member's code, or the signal's when the launcher got
    one and no member failed."""
    if stopped:
        say_error(stopped_words(stopped, status))
        return 1
    if status is not None and status.state in ("completed", "preempted"):
        if status.state == "preempted" and not signalled:
            # The signal went elsewhere (node 0's Ctrl-C, a worker's SIGTERM): this
            # launcher's workers learnt it in a step's agreement and saved with the others.
            say_line(
                f"dtrain: the job was stopped by {status.signal or 'a signal'} sent elsewhere "
                f"(another machine's Ctrl-C, say); saved at step {status.step}. Run the same "
                "command on every machine to resume."
            )
        return 0
    failed = [code for code in codes if code != 0]
    if signalled and not failed:
        return 128 + signalled[0]
    return failed[0] if failed else 0
