"""Starting the workers through torch's elastic agent (the machinery behind ``torchrun``).

One agent per machine starts ``nproc`` workers running :mod:`dtrain.worker`, joins the other
machines through a c10d rendezvous, restarts the whole group up to ``max_restarts`` times when a
worker dies (the workers resume from the newest checkpoint by themselves), and with
``--nnodes MIN:MAX`` admits machines that join or leave.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dtrain.dist.network import (
    check_port_free,
    choose_node_network,
    interface_of_host,
    split_endpoint,
)
from dtrain.dist.reachability import (
    NODE_ADDR_ENV,
    REFUSED,
    UNREACHABLE,
    describe,
    probe,
    wait_for_endpoint,
)
from dtrain.dist.runtime import available_cores
from dtrain.dist.secret import launcher_secret
from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
from dtrain.fault.error_log import LOGS_DIR
from dtrain.fault.preempt import signals_to_forward
from dtrain.fault.status import read_status
from dtrain.launch.agent import held_port, run_agent
from dtrain.launch.rendezvous_wait import share_shape, timed_out_words, waiting_words
from dtrain.recovery.membership import MEMBER_ENV


@dataclass(frozen=True)
class LaunchOptions:
    nproc: int
    min_nodes: int = 1
    max_nodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str = ""
    max_restarts: int = 0
    run_id: str = ""
    rdzv_timeout_s: int = 900
    # The address this node advertises and the interface of its collectives (dist/network.py).
    local_addr: str | None = None
    iface: str = ""

    @property
    def max_world_size(self) -> int:
        return self.nproc * self.max_nodes

    @property
    def min_world_size(self) -> int:
        return self.nproc * self.min_nodes


def default_nproc() -> int:
    """One worker per GPU; on CPU, one per core up to 4 (more, smaller workers mostly add
    communication)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.device_count()
    except ImportError:  # pragma: no cover
        pass
    return max(1, min(available_cores(), 4))


def parse_nnodes(text: str) -> tuple[int, int]:
    try:
        if ":" in text:
            low, high = (int(p) for p in text.split(":", 1))
        else:
            low = high = int(text)
    except ValueError:
        raise UserError(f"--nnodes {text!r}: expected N or MIN:MAX, e.g. 2 or 1:4") from None
    if low < 1 or high < low:
        raise UserError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return low, high


def make_options(
    nproc: int | None,
    nnodes: str,
    node_rank: int | None,
    rdzv_endpoint: str,
    max_restarts: int,
    run_id: str,
    *,
    local_addr: str = "",
    iface: str = "",
    rdzv_timeout_s: int = 900,
) -> LaunchOptions:
    nproc = default_nproc() if nproc is None else nproc
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: the number of workers per machine must be at least 1")
    if max_restarts < 0:
        raise UserError(f"--max-restarts {max_restarts}: must be 0 or more")
    low, high = parse_nnodes(nnodes)
    if high > 1 and not rdzv_endpoint:
        raise UserError(
            "--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the rendezvous host, "
            "the same on every machine)"
        )
    if node_rank is not None and node_rank < 0:
        raise UserError(f"--node-rank {node_rank}: must be 0 or more")
    if node_rank is not None and node_rank >= high:
        raise UserError(
            f"--node-rank {node_rank}: must be below --nnodes {nnodes} (0 .. {high - 1})"
        )
    if rdzv_endpoint:
        try:
            split_endpoint(rdzv_endpoint)
        except ValueError:
            raise UserError(f"--rdzv-endpoint {rdzv_endpoint!r}: expected HOST:PORT") from None
    if rdzv_timeout_s < 1:
        raise UserError(f"--rdzv-timeout {rdzv_timeout_s}: must be at least 1 second")
    if "/" in run_id or "\\" in run_id or run_id in (".", ".."):
        # The id also names the run folder (runs/<run id>) where run.dir is not set.
        raise UserError(
            f"--run-id {run_id!r}: must be a plain name (no '/', not '.' or '..'): it also "
            "names the run folder runs/<run id>; set --run.dir=PATH for a folder elsewhere"
        )
    node_addr, iface = choose_node_network(rdzv_endpoint, local_addr, iface)
    return LaunchOptions(
        nproc=nproc,
        min_nodes=low,
        max_nodes=high,
        node_rank=node_rank,
        rdzv_endpoint=rdzv_endpoint,
        max_restarts=max_restarts,
        run_id=run_id or uuid.uuid4().hex[:12],
        rdzv_timeout_s=rdzv_timeout_s,
        local_addr=node_addr,
        iface=iface,
    )


def launch_workers(
    config_path: Path,
    opts: LaunchOptions,
    grace_s: float = 120.0,
    preempt_signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
    collective_timeout_s: float = 300.0,
) -> int:
    """Run the job; returns the exit code for the CLI. ``grace_s``: how long workers get to
    save and exit after the launcher is sent a preemption signal, before they are killed;
    ``preempt_signals``: the signals the launcher forwards to them (``fault.preempt_signals``)
    besides those torch's agent forwards anyway; ``collective_timeout_s``: the workers'
    ``dist.timeout_s`` (the launcher outlasts any outage they ride through)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.launcher.api import LaunchConfig

    standalone = not opts.rdzv_endpoint
    secret = launcher_secret(multi_machine=not standalone)
    rdzv_configs: dict[str, object] = {
        "timeout": opts.rdzv_timeout_s,
        # torch's c10d rendezvous reads its wait for the machines from join_timeout (600 s
        # when unset), not from "timeout": --rdzv-timeout did not bound it.
        "join_timeout": opts.rdzv_timeout_s,
        "read_timeout": agent_store_timeout(opts, collective_timeout_s),
    }
    if opts.node_rank is not None and not standalone:  # one machine: it hosts its own
        rdzv_configs["is_host"] = hosts_rendezvous(opts)
    config = LaunchConfig(
        min_nodes=opts.min_nodes,
        max_nodes=opts.max_nodes,
        nproc_per_node=opts.nproc,
        run_id=opts.run_id,
        rdzv_backend="c10d",
        # Port 0: the agent of a single machine opens its rendezvous store on a free port.
        rdzv_endpoint="localhost:0" if standalone else opts.rdzv_endpoint,
        rdzv_configs=rdzv_configs,
        local_addr=opts.local_addr,
        max_restarts=opts.max_restarts,
        monitor_interval=0.1,
        start_method="spawn",
        # On SIGTERM the agent forwards it to the workers, which save at the next step
        # boundary; this is how long it waits for them before SIGKILL.
        shutdown_timeout=int(grace_s),
        # torch's agent forwards only SIGTERM, SIGINT, SIGHUP and SIGQUIT unless told
        # otherwise: SIGUSR1 (Slurm's --signal=USR1@N) would kill it, and the workers with
        # it, unsaved.
        signals_to_handle=signals_to_forward(preempt_signals, os.environ),
    )
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # The workers host a fresh key-value store every rendezvous round, instead of sharing the
    # launcher's across rounds. Two reasons. (1) An elastic job must admit a machine that joins
    # later; in torch 2.13 the c10d rendezvous's shared store breaks that: the node that was
    # rank 0 before keeps its old bootstrap address and never publishes one for the new
    # round, and the joining node waits for it until the rendezvous times out. (2) A fresh
    # store per round can hold no stale keys of an earlier attempt (see dist/runtime.py).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # The workers' network: the interface of their collectives, and this node's advertised
    # address for their start-up check (dist/reachability.py).
    if opts.iface:
        os.environ["GLOO_SOCKET_IFNAME"] = os.environ["NCCL_SOCKET_IFNAME"] = opts.iface
    if opts.local_addr:
        os.environ[NODE_ADDR_ENV] = opts.local_addr
    if not standalone and not (opts.node_rank is not None and hosts_rendezvous(opts)):
        wait_for_rendezvous_host(opts)
    elif not standalone:
        check_port_free(opts.rdzv_endpoint)
    for name in _EXPECTED_LOGGERS:
        log = logging.getLogger(name)
        if not any(isinstance(f, _ExpectedAtExit) for f in log.filters):
            log.addFilter(_ExpectedAtExit())
    worker_args = ("-u", "-m", "dtrain.worker", str(config_path))
    try:
        if standalone:
            # Held from now until every attempt has ended: see dtrain.launch.agent.
            with held_port() as store_port:
                run_agent(config, worker_args, store_port, secret)
        else:
            waiting = waiting_words(
                opts.rdzv_endpoint, opts.run_id, nnodes_text(opts), opts.rdzv_timeout_s
            )
            shape = {"--run-id": opts.run_id, "--nnodes": nnodes_text(opts)}
            hosting = may_host_rendezvous(opts)
            run_agent(
                config,
                worker_args,
                store_port=None,
                secret=secret,
                waiting_words=waiting,
                before_run=lambda: share_shape(opts.rdzv_endpoint, shape, hosting, secret),
            )
    except RendezvousError as exc:
        raise UserError(rendezvous_lost(opts, exc)) from None
    except ChildFailedError as exc:
        return report_failure(exc, opts, config_path.parent)
    except SignalException as exc:
        return report_preemption(config_path.parent, int(exc.sigval))
    return 0


_EXPECTED_LOGGERS = (
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.multiprocessing.api",
    "torch.distributed.elastic.agent.server.api",
)


class _ExpectedAtExit(logging.Filter):
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


def agent_store_timeout(opts: LaunchOptions, collective_timeout_s: float) -> int:
    """How long torch's agent waits on the rendezvous store before it gives up (and with it
    the job on this machine): longer than the workers' collective timeout, so that an outage
    the workers ride through never ends the agent (torch's 60 s did, after which its workers'
    SIGTERM read as a preemption); with restarts, as long as the job waits for machines
    (``--rdzv-timeout``), so that a job cut off for longer resumes once the link is back. A
    rendezvous host that is gone (refused) is found at once whatever this is."""
    outlast = int(collective_timeout_s) + 60
    return max(outlast, opts.rdzv_timeout_s) if opts.max_restarts > 0 else outlast


def nnodes_text(opts: LaunchOptions) -> str:
    """``--nnodes`` as the user wrote it: N, or MIN:MAX."""
    if opts.min_nodes == opts.max_nodes:
        return str(opts.max_nodes)
    return f"{opts.min_nodes}:{opts.max_nodes}"


def hosts_rendezvous(opts: LaunchOptions) -> bool:
    """Whether this machine hosts the rendezvous: the one with ``--node-rank 0``, unless the
    endpoint is not one of its addresses -- a rendezvous run apart from the nodes
    (``dtrain rendezvous``), which outlives any of them."""
    host, _ = split_endpoint(opts.rdzv_endpoint)
    return opts.node_rank == 0 and interface_of_host(host) is not None


def may_host_rendezvous(opts: LaunchOptions) -> bool:
    """Whether this machine may host the rendezvous: it does where :func:`hosts_rendezvous`
    says so; without ``--node-rank`` torch decides by the machine's addresses, so any machine
    that has the endpoint's address may."""
    host, _ = split_endpoint(opts.rdzv_endpoint)
    return hosts_rendezvous(opts) or (
        opts.node_rank is None and interface_of_host(host) is not None
    )


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
        print(
            f"dtrain: waiting for the rendezvous host at {opts.rdzv_endpoint} ({reason}); "
            f"giving up after {opts.rdzv_timeout_s}s",
            file=sys.stderr,
            flush=True,
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


def report_preemption(run_dir: Path, signum: int) -> int:
    """After the launcher itself got a preemption signal: 0 when the workers saved, whether
    the signal stopped them (``preempted``) or came too late to, after their last step:
    ``completed`` is written only once the final checkpoint is committed."""
    status = read_status(run_dir)
    if status is not None and status.state == "preempted":
        print(
            f"dtrain: preempted by signal {signum}; saved at step {status.step}. Run "
            "the same command to resume.",
            file=sys.stderr,
        )
        return 0
    if status is not None and status.state == "completed":
        print(
            f"dtrain: signal {signum} arrived after the last step; the run completed and "
            f"saved its final checkpoint (step {status.step})",
            file=sys.stderr,
        )
        return 0
    print(f"dtrain: stopped by signal {signum} before the workers could save", file=sys.stderr)
    return 128 + signum


def report_failure(exc: object, opts: LaunchOptions, run_dir: Path | None = None) -> int:
    """One line per failed rank, the first failure first; exit 2 when every failure was a
    user error (the worker said so with exit code 2), else 1. The workers keep their full
    tracebacks in ``RUN_DIR/logs/`` (dtrain.fault.error_log)."""
    failures = getattr(exc, "failures", {})
    # Timestamps are whole seconds: within one, a rank that exited by itself comes before one
    # the agent ended with a signal once another had failed (it may have been on its way out
    # with the same error, which it recorded).
    ordered = sorted(
        failures.items(), key=lambda item: (item[1].timestamp, item[1].exitcode < 0, item[0])
    )
    attempts = opts.max_restarts + 1
    print(
        f"dtrain: training failed (after up to {attempts} attempt(s)); failed ranks:",
        file=sys.stderr,
    )
    # An in-place job's agent runs one worker, its local rank 0: the job knows it as a member.
    member = os.environ.get(MEMBER_ENV)
    for rank, failure in ordered:
        who = f"member {member}" if member is not None else f"rank {rank}"
        print(
            f"  {who} (pid {failure.pid}, {exit_words(failure.exitcode)}): "
            f"{failure_words(failure.message, failure.exitcode)}",
            file=sys.stderr,
        )
    logs = run_dir / LOGS_DIR if run_dir is not None else None
    if logs is not None and logs.is_dir():
        print(f"dtrain: the failed ranks' tracebacks are in {logs}/", file=sys.stderr)
    # The root cause decides: a user error (exit 2) on the first rank to fail, whatever the
    # others died of when the agent stopped them.
    user_error = bool(ordered) and ordered[0][1].exitcode == USER_ERROR_EXIT_CODE
    return USER_ERROR_EXIT_CODE if user_error else 1


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
