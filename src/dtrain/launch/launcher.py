"""The launcher: starts the workers (``python -m dtrain.worker``) and reports how they ended.
``fault.recovery`` chooses how they are supervised:

- ``"restart"``: one agent on each machine runs its ``nproc`` workers, joins the other machines
  through a c10d rendezvous, restarts the whole group up to ``max_restarts`` times when a
  worker dies (the workers resume from the newest checkpoint by themselves), and with
  ``--nnodes MIN:MAX`` admits machines that join or leave (:func:`run_group`).
- ``"inplace"``: the launcher starts and supervises each worker itself, restarting one that
  failed alone while the others go on; beside them the membership service (:func:`run_members`).

Across machines in place, node 0's launcher hosts the membership store and the
:class:`~dtrain.recovery.coordinator.Coordinator` at ``--rdzv-endpoint``; every other launcher
posts its workers' states from /proc (:class:`~dtrain.recovery.coordinator.NodeWatcher`) and
rides out an outage of the network up to ``--rdzv-timeout`` (docs/fault-tolerance.md, "Recovery
in place").
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from dtrain.console import say_line
from dtrain.dist.network import check_port_free, local_address, split_endpoint
from dtrain.dist.reachability import NODE_ADDR_ENV
from dtrain.dist.secret import launcher_secret
from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import LOOPBACK, host_store
from dtrain.errors import LAUNCHER_SAYS_ENV, UserError
from dtrain.fault.preempt import signals_to_forward
from dtrain.fault.status import read_status
from dtrain.launch.agent import StoppedAtOnce, held_port, run_agent
from dtrain.launch.options import (
    JobSettings,
    LaunchOptions,
    hosts_rendezvous,
    may_host_rendezvous,
    nnodes_text,
)
from dtrain.launch.rendezvous_wait import share_shape, waiting_words
from dtrain.launch.reports import (
    join_timed_out,
    members_outcome,
    quiet_expected_logs,
    record_failure,
    rendezvous_lost,
    report_failure,
    report_preemption,
    wait_for_rendezvous_host,
    waiting_notice,
)
from dtrain.recovery.coordinator import Coordinator, NodeWatcher
from dtrain.recovery.halt import Halt
from dtrain.recovery.membership import (
    COORDINATOR_ENV,
    LOCAL_ENV,
    MEMBER_ENV,
    MEMBERS_ENV,
    NODES,
    PATIENCE_ENV,
    STALE_S,
    read_json,
    store_call_s,
    write_value,
)
from dtrain.recovery.node_claim import claim_node


def launch(config_path: Path, opts: LaunchOptions, job: JobSettings) -> int:
    """Run the job (the config at ``config_path``, in its run folder) in the layout of
    ``job.recovery``; the exit code for the CLI."""
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    # The workers' C++ store client logs every call to a store whose host has gone at WARNING,
    # with a C++ stack trace of some 20 frames: each of a rank's threads that reads the job's
    # store (rank 0's) after rank 0 was killed (a kill -9, a second Ctrl-C on its machine)
    # printed one or two. The rank says what failed itself, in a line (the watchdog's
    # diagnosis names the peer); torch's errors still show. A level the user set stands.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    if job.recovery == "inplace":
        return run_members(config_path, opts, job)
    return run_group(config_path, opts, job)


def set_worker_network(opts: LaunchOptions, env: dict[str, str] | os._Environ[str]) -> None:
    """The workers' network in ``env``: the interface of their collectives, and this node's
    advertised address for their start-up check (dist/reachability.py) and, in place, for
    the others to cut their links to it if it falls silent."""
    if opts.iface:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = opts.iface
    if opts.local_addr:
        env[NODE_ADDR_ENV] = opts.local_addr


def run_group(config_path: Path, opts: LaunchOptions, job: JobSettings) -> int:
    """This machine's ``opts.nproc`` workers under one torch elastic agent, in this process;
    the exit code."""
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
        "read_timeout": agent_store_timeout(opts, job.collective_timeout_s),
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
        shutdown_timeout=int(job.grace_s),
        # torch's agent forwards only SIGTERM, SIGINT, SIGHUP and SIGQUIT unless told
        # otherwise: SIGUSR1 (Slurm's --signal=USR1@N) would kill it, and the workers with
        # it, unsaved.
        signals_to_handle=signals_to_forward(job.preempt_signals, os.environ),
    )
    # The workers host a fresh key-value store every rendezvous round, instead of sharing the
    # launcher's across rounds. Two reasons. (1) An elastic job must admit a machine that joins
    # later; in torch 2.13 the c10d rendezvous's shared store breaks that: the node that was
    # rank 0 before keeps its old bootstrap address and never publishes one for the new
    # round, and the joining node waits for it until the rendezvous times out. (2) A fresh
    # store per round can hold no stale keys of an earlier attempt (see dist/runtime.py).
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    set_worker_network(opts, os.environ)
    if not standalone and not (opts.node_rank is not None and hosts_rendezvous(opts)):
        wait_for_rendezvous_host(opts)
    elif not standalone:
        check_port_free(opts.rdzv_endpoint)
    quiet_expected_logs()
    if standalone:
        # One machine: every way out of the agent below reports its workers' failures, user
        # errors once for the ranks that failed alike (launch/reports.report_failure), so the
        # workers do not say them too. Across machines a worker says its own: its launcher may
        # end on the lost rendezvous first, and the line would be lost.
        os.environ[LAUNCHER_SAYS_ENV] = "1"
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
        record_failure(config_path.parent)
        return report_failure(exc.failures, opts.max_restarts, config_path.parent)
    except SignalException as exc:
        return report_preemption(config_path.parent, int(exc.sigval))
    except StoppedAtOnce as exc:
        return report_preemption(config_path.parent, exc.signum, at_once=True)
    return 0


def agent_store_timeout(opts: LaunchOptions, collective_timeout_s: float) -> int:
    """How long torch's agent waits on the rendezvous store before it gives up (and with it
    the job on this machine): longer than the workers' collective timeout, so that an outage
    the workers ride through never ends the agent (torch's 60 s did, after which its workers'
    SIGTERM read as a preemption); with restarts, as long as the job waits for machines
    (``--rdzv-timeout``), so that a job cut off for longer resumes once the link is back. A
    rendezvous host that is gone (refused) is found at once whatever this is."""
    outlast = int(collective_timeout_s) + 60
    return max(outlast, opts.rdzv_timeout_s) if opts.max_restarts > 0 else outlast


def run_members(config_path: Path, opts: LaunchOptions, job: JobSettings) -> int:
    """In place: the membership service (node 0's coordinator, or another machine's watcher of
    its workers), then this machine's workers, supervised (:func:`supervise_members`); the exit
    code: 0 once the run completed (or saved on a preemption signal); 1 when a failure left
    fewer than ``job.min_replicas`` workers (they saved and stopped); else the first failing
    member's."""
    nodes, node = opts.max_nodes, opts.node_rank or 0
    mine = range(node * opts.nproc, (node + 1) * opts.nproc)  # this machine's member ids
    membership, address = membership_service(opts, job, mine)
    env = dict(os.environ)
    env[COORDINATOR_ENV] = address
    env[MEMBERS_ENV] = str(opts.nproc * nodes)
    env[PATIENCE_ENV] = str(opts.rdzv_timeout_s)
    # What torch's agent tells a worker, as a job of one: the worker reads its run id (it
    # dies with its launcher), and its rank only to name itself before it joins.
    env.update({"TORCHELASTIC_RUN_ID": opts.run_id, "RANK": "0", "WORLD_SIZE": "1"})
    if nodes > 1:
        set_worker_network(opts, env)
    envs = {
        m: {**env, MEMBER_ENV: str(m), LOCAL_ENV: f"{i}/{opts.nproc}"} for i, m in enumerate(mine)
    }
    try:
        halt = Halt(membership, node, nodes)
        codes, signalled = supervise_members(config_path, envs, opts.max_restarts, job, halt)
    finally:
        membership.stop()
    if isinstance(membership, Coordinator) and membership.gave_up:
        raise UserError(join_timed_out(opts, membership.gave_up))
    # Why the job stopped: the coordinator's machine knows; the others read it in the store.
    return members_outcome(read_status(config_path.parent), membership.stopped, codes, signalled)


def supervise_members(
    config_path: Path,
    envs: dict[int, dict[str, str]],
    max_restarts: int,
    job: JobSettings,
    halt: Halt,
) -> tuple[list[int], list[int]]:
    """Run one worker per member (``envs``: member -> its environment) and supervise them, as
    torch's agent supervises its one worker in restart mode: a worker that fails is started
    again alone, up to ``max_restarts`` times per member, while the others go on; a signal the
    launcher gets is passed to every worker, which then has ``job.grace_s`` to save and end
    before SIGKILL (a second signal: SIGKILL at once; on node 0, after the other machines
    killed theirs, :mod:`dtrain.recovery.halt`; elsewhere, node 0's halt is a second signal
    here). The members' exit codes (a failure said in one line, as restart mode says it; a
    signal's outcome once, :func:`report_preemption`) and the signals received."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    run_dir, attempts = config_path.parent, dict.fromkeys(envs, 0)
    running: dict[int, subprocess.Popen[bytes]] = {}
    codes: dict[int, int] = {}
    signalled: list[int] = []
    errors = tempfile.TemporaryDirectory(prefix="dtrain-members-")

    def error_file(member: int) -> str:
        return f"{errors.name}/member{member}-attempt{attempts[member]}.json"

    def start(member: int) -> None:
        env = {**envs[member], "TORCHELASTIC_RESTART_COUNT": str(attempts[member])}
        env["TORCHELASTIC_ERROR_FILE"] = error_file(member)
        # A session of its own, as torch's agent starts its workers: Ctrl-C on the terminal
        # reaches the launcher, which passes it on once.
        command = [sys.executable, "-u", "-m", "dtrain.worker", str(config_path)]
        running[member] = subprocess.Popen(command, env=env, start_new_session=True)

    def send(sent: int) -> None:
        for proc in running.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.killpg(proc.pid, sent)

    def forward(signum: int, frame: FrameType | None) -> None:
        # The first signal is passed on (the workers save at the next step); a second one
        # (Ctrl-C twice) kills them at once, all together -- frozen first while the other
        # machines kill theirs, so that no worker anywhere sees a peer die mid-save.
        second = bool(signalled)
        signalled.append(signum)
        if second:
            send(signal.SIGSTOP)
            try:
                halt.tell_others()
            except Exception as exc:  # its workers die all the same; the others see them go
                say_line(f"dtrain: warning: could not tell the other machines to stop: {exc}")
        send(signal.SIGKILL if second else signum)

    names = set(job.preempt_signals) | {"SIGINT", "SIGTERM"}
    previous = {name: signal.signal(getattr(signal, name), forward) for name in names}
    try:
        for member in envs:
            start(member)
        while running and not signalled:
            if halt.heard():  # node 0's second signal: as one here, then node 0 is told
                signalled += [signal.SIGINT, signal.SIGINT]
                send(signal.SIGKILL)
                halt.acknowledge()
                break
            for member, proc in list(running.items()):
                code = proc.poll()
                if code is None or signalled:
                    continue
                if code != 0 and attempts[member] < max_restarts:
                    attempts[member] += 1
                    start(member)
                    continue
                del running[member]
                if code:
                    failure = {0: ProcessFailure(0, proc.pid, code, error_file(member))}
                    code = report_failure(failure, max_restarts, run_dir, f"member {member}")
                codes[member] = code
            time.sleep(0.05)
        if running:  # a signal: every worker still running saves, or is killed after the grace
            deadline = time.monotonic() + job.grace_s
            for proc in running.values():
                try:
                    proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            at_once = len(signalled) > 1
            code = report_preemption(run_dir, signalled[0], at_once, halted=halt.heard())
            codes.update(dict.fromkeys(running, code))
    finally:
        for name, handler in previous.items():
            signal.signal(getattr(signal, name), handler)
        for proc in running.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        errors.cleanup()
    return [codes[member] for member in envs], signalled


def membership_service(
    opts: LaunchOptions, job: JobSettings, mine: range
) -> tuple[Coordinator | NodeWatcher, str]:
    """Started: node 0's coordinator on the membership store it hosts, or another machine's
    watcher of its workers, with the store's address for the workers."""
    nodes, node = opts.max_nodes, opts.node_rank or 0
    if node != 0:
        wait_for_rendezvous_host(opts)  # one line when node 0 cannot be reached
        host, port = split_endpoint(opts.rdzv_endpoint)
        link = StoreLink(
            host, port, store_call_s(job.collective_timeout_s), float(opts.rdzv_timeout_s)
        )
        check_shape(link, opts)
        claim_node(link, node, nodes)  # one line where another machine runs this rank
        watcher = NodeWatcher(link, mine, node)
        watcher.start()
        return watcher, opts.rdzv_endpoint
    if nodes > 1:
        check_port_free(opts.rdzv_endpoint)
    # Listening where the members reach it: loopback on one machine, else the address of
    # --rdzv-endpoint here (config.job.validate_job made sure it is this machine's).
    host, port = split_endpoint(opts.rdzv_endpoint) if nodes > 1 else (LOOPBACK, 0)
    store = host_store(local_address(host) or LOOPBACK, port, job.collective_timeout_s)
    write_value(store, "nodes", {"nnodes": nodes, "nproc": opts.nproc})
    # A member that has not asked for the next generation within the collective timeout
    # (and a little) of the first one that did is stuck: it is left out, and rejoins.
    coordinator = Coordinator(
        store,
        opts.nproc * nodes,
        stale_s=STALE_S,
        hang_s=job.collective_timeout_s + 5.0,
        min_members=job.min_replicas,
        local=mine,
        per_node=opts.nproc,
        join_timeout_s=float(opts.rdzv_timeout_s) if nodes > 1 else 0.0,
        on_wait=lambda missing, gave_up: None if gave_up else waiting_notice(opts, missing),
    )
    coordinator.start()
    return coordinator, opts.rdzv_endpoint if nodes > 1 else f"{LOOPBACK}:{store.port}"


def check_shape(link: StoreLink, opts: LaunchOptions) -> None:
    """On a machine other than node 0: the job's shape as node 0 posted it must be this
    launcher's (members are numbered machine by machine, ``--nproc`` each). A shape that
    fails its seal counts as none posted yet (one warning names its key)."""

    def read(store: object) -> dict[str, int] | None:
        return read_json(store, "nodes", NODES)

    deadline = time.monotonic() + opts.rdzv_timeout_s
    while (shape := link.call(read, "reading the job's shape")) is None:
        if time.monotonic() > deadline:
            raise UserError(
                f"--rdzv-endpoint {opts.rdzv_endpoint}: no membership coordinator answered "
                f"there within {opts.rdzv_timeout_s}s (is `dtrain train --node-rank 0` with "
                "fault.recovery = 'inplace' running there?)"
            )
        time.sleep(0.1)
    if (shape["nnodes"], shape["nproc"]) != (opts.max_nodes, opts.nproc):
        raise UserError(
            f"--nnodes {opts.max_nodes} --nproc {opts.nproc} here, but the machine with "
            f"--node-rank 0 runs --nnodes {shape['nnodes']} --nproc {shape['nproc']}: "
            "fault.recovery = 'inplace' needs the same on every machine"
        )
