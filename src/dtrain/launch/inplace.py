"""Starting the workers for ``fault.recovery = 'inplace'``: one torch elastic agent per worker.

With one agent per worker, an agent that sees its worker die restarts that worker alone
(``--max-restarts`` times); the others go on. The launcher hosts the job's membership store
and its :class:`~dtrain.recovery.coordinator.Coordinator`, which the workers reach at
``$DTRAIN_INPLACE_COORDINATOR``. Each agent is restart mode's launch for one worker
(:func:`run_agent`: torch's elastic agent with its own rendezvous on a free port), so restarts,
signal forwarding and failure reports are those of restart mode.

Across machines (``--nnodes N --node-rank K``), the launcher of node 0 hosts the store at
``--rdzv-endpoint`` (one of its addresses); every machine's workers reach it there. Members
are numbered machine by machine (node K's are ``K*nproc .. K*nproc+nproc-1``). The launcher of
every other machine watches its own workers in /proc and posts their states to the store
(:class:`~dtrain.recovery.coordinator.NodeWatcher`), so the coordinator sees a worker killed or
stopped on another machine at once; a machine cut off, by its launcher's counter going still. Every
store call on those machines waits out an outage of the network (up to ``--rdzv-timeout``).
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

from dtrain.dist.network import check_port_free, split_endpoint
from dtrain.dist.reachability import NODE_ADDR_ENV
from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import LOOPBACK, host_store, local_address
from dtrain.errors import UserError
from dtrain.fault.status import RunStatus, read_status
from dtrain.launch.elastic import LaunchOptions, wait_for_rendezvous_host
from dtrain.recovery.coordinator import Coordinator, NodeWatcher
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
        "dtrain.launch.inplace",
        str(config_path),
        str(max_restarts),
        str(grace_s),
        str(timeout_s),
        ",".join(signals),
    ]


def run_agent(argv: Sequence[str]) -> int:
    """``python -m dtrain.launch.inplace CONFIG MAX_RESTARTS GRACE_S TIMEOUT_S SIGNALS``: the
    elastic launch of restart mode (:func:`dtrain.launch.elastic.launch_workers`) for one
    worker, with its own rendezvous: its restarts, signal forwarding and failure report are
    restart mode's."""
    from dtrain.console import say_error
    from dtrain.errors import USER_ERROR_EXIT_CODE, UserError
    from dtrain.launch.elastic import launch_workers

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
    nodes, node = opts.max_nodes, opts.node_rank or 0
    members = opts.nproc * nodes
    mine = range(node * opts.nproc, (node + 1) * opts.nproc)  # this machine's member ids
    coordinator: Coordinator | None = None
    watcher: NodeWatcher | None = None
    if node == 0:
        if nodes > 1:
            check_port_free(opts.rdzv_endpoint)
        port = split_endpoint(opts.rdzv_endpoint)[1] if nodes > 1 else 0
        # Listening where the members reach it: loopback on one machine, else the address
        # of --rdzv-endpoint here.
        # (check_machines made sure the endpoint is one of this machine's addresses.)
        host = split_endpoint(opts.rdzv_endpoint)[0] if nodes > 1 else LOOPBACK
        bind = local_address(host) or LOOPBACK
        store = host_store(bind, port, collective_timeout_s)
        write_value(store, "nodes", {"nnodes": nodes, "nproc": opts.nproc})
        # A member that has not asked for the next generation within the collective timeout
        # (and a little) of the first one that did is stuck: it is left out, and rejoins.
        coordinator = Coordinator(
            store,
            members,
            stale_s=STALE_S,
            hang_s=collective_timeout_s + 5.0,
            min_members=min_replicas,
            local=mine,
            per_node=opts.nproc,
            join_timeout_s=float(opts.rdzv_timeout_s) if nodes > 1 else 0.0,
            on_wait=lambda missing, gave_up: None if gave_up else waiting_notice(opts, missing),
        )
        coordinator.start()
        address = opts.rdzv_endpoint if nodes > 1 else f"{LOOPBACK}:{store.port}"
    else:
        wait_for_rendezvous_host(opts)  # one line when node 0 cannot be reached
        host, port = split_endpoint(opts.rdzv_endpoint)
        link = StoreLink(host, port, store_call_s(collective_timeout_s), float(opts.rdzv_timeout_s))
        check_shape(link, opts)
        claim_node(link, node, nodes)  # one line where another machine runs this rank
        watcher = NodeWatcher(link, mine, node)
        watcher.start()
        address = opts.rdzv_endpoint
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env[COORDINATOR_ENV] = address
    env[MEMBERS_ENV] = str(members)
    env[PATIENCE_ENV] = str(opts.rdzv_timeout_s)
    # The interface of the collectives across machines (docs/multi-host.md): each agent is a
    # single-machine launch, which leaves these as it finds them.
    if opts.iface and nodes > 1:
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = opts.iface
    if opts.local_addr and nodes > 1:
        env[NODE_ADDR_ENV] = opts.local_addr  # the others cut their links to it if it falls silent
    command = agent_command(
        config_path, opts.max_restarts, grace_s, collective_timeout_s, preempt_signals
    )
    agents = [
        subprocess.Popen(
            command,
            env={**env, MEMBER_ENV: str(m), LOCAL_ENV: f"{i}/{opts.nproc}"},
            preexec_fn=_die_with_launcher,
        )
        for i, m in enumerate(mine)
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
        if coordinator is not None:
            coordinator.stop()
        if watcher is not None:
            watcher.stop()
    if coordinator is not None and coordinator.gave_up:
        raise UserError(join_timed_out(opts, coordinator.gave_up))
    status = read_status(config_path.parent)
    # Why the job stopped: the coordinator's machine knows; the others read it in the store.
    stopped = coordinator.stopped if coordinator is not None else ""
    if watcher is not None:
        stopped = watcher.stopped
    if stopped:
        from dtrain.console import say_error

        say_error(stopped_words(stopped, status))
        return 1
    if status is not None and status.state in ("completed", "preempted"):
        return 0
    failed = [code for code in codes if code != 0]
    if signalled and not failed:
        return 128 + signalled[0]
    return failed[0] if failed else 0


def waiting_notice(opts: LaunchOptions, nodes: list[int]) -> None:
    """Node 0, before the first generation: the machines whose workers have not asked to join."""
    print(
        f"dtrain: waiting for the workers of the machine(s) with --node-rank "
        f"{', '.join(map(str, nodes))} to join at {opts.rdzv_endpoint} (still starting, not "
        "started, or refused: that machine's console says why); giving up after "
        f"{opts.rdzv_timeout_s}s",
        file=sys.stderr,
        flush=True,
    )


def join_timed_out(opts: LaunchOptions, why: str) -> str:
    return (
        f"--rdzv-endpoint {opts.rdzv_endpoint}: {why} (--rdzv-timeout): start `dtrain train` on "
        "every machine with the same config, --nnodes, --nproc and --rdzv-endpoint, each with "
        "its own --node-rank (a machine that refused to start says why on its own console)"
    )


def check_machines(opts: LaunchOptions, nnodes: str) -> None:
    """Before any worker starts, across machines: what in-place recovery cannot do there is
    one line each."""
    from dtrain.launch.elastic import hosts_rendezvous

    if opts.min_nodes != opts.max_nodes:
        raise UserError(
            f"--nnodes {nnodes}: fault.recovery = 'inplace' needs a fixed number of machines "
            "(a lost worker rejoins in place); use --nnodes N, or fault.recovery = 'restart' "
            "for an elastic range"
        )
    if opts.node_rank is None:
        raise UserError(
            "fault.recovery = 'inplace' across machines needs --node-rank K on each (0 hosts "
            "the membership coordinator at --rdzv-endpoint; the others number their workers "
            "after it)"
        )
    if opts.node_rank >= opts.max_nodes:
        raise UserError(
            f"--node-rank {opts.node_rank}: must be below --nnodes {opts.max_nodes} (0 .. "
            f"{opts.max_nodes - 1})"
        )
    if opts.node_rank == 0 and not hosts_rendezvous(opts):
        raise UserError(
            f"--rdzv-endpoint {opts.rdzv_endpoint} is not an address of this machine: with "
            "fault.recovery = 'inplace' the machine with --node-rank 0 hosts the membership "
            "coordinator there (a rendezvous apart from the machines, `dtrain rendezvous`, is "
            "for fault.recovery = 'restart')"
        )


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
