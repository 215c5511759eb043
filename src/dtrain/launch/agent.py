"""Running torch's elastic agent with the job's store port held from the start.

torch's agent picks the port of the workers' store (``MASTER_PORT``) by binding port 0 and
closing the socket; rank 0 binds it again seconds later, once its interpreter has started.
Any process on the machine that binds or connects in between can take it, and rank 0 then
fails with "address already in use" (two jobs started at once on one machine did, in CI).
On a single machine the launcher holds the port instead, for as long as it runs: its socket
is bound with ``SO_REUSEADDR`` and never listens, which keeps every other bind and outgoing
connection off the port (the kernel skips bound ports when it picks one) and still lets
rank 0's store, also ``SO_REUSEADDR``, listen there -- in every restart attempt.

Across machines the port is picked by whichever agent becomes rank 0, after the rendezvous;
there it stays torch's pick.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from dtrain.dist.network import local_address, split_endpoint
from dtrain.dist.stores import LOOPBACK, client_store, host_store
from dtrain.launch.rendezvous_wait import announce_waits

if TYPE_CHECKING:
    from torch.distributed.launcher.api import LaunchConfig

    from dtrain.dist.secret import JobSecret


@contextmanager
def held_port() -> Iterator[int]:
    """A free TCP port that no other process can take while the block runs, but a listener
    with ``SO_REUSEADDR`` in this machine's processes can (see the module's docstring)."""
    holder = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", 0))
        yield int(holder.getsockname()[1])
    finally:
        holder.close()


def rendezvous_store(config: LaunchConfig) -> Any:
    """The rendezvous store of ``config`` (torch's ``LaunchConfig``, c10d backend): hosted here
    on the address the other machines reach it at (one machine: loopback, a free port), or a
    client of the machine that hosts it. Where this machine may host it without being told
    (no ``--node-rank``), it hosts it unless another launcher here already does, as torch
    decides."""
    # One machine: "localhost:0" (a free port), which split_endpoint refuses.
    host, port = (
        ("localhost", 0)
        if config.rdzv_endpoint.endswith(":0")
        else split_endpoint(config.rdzv_endpoint)
    )
    read_timeout_s = float(config.rdzv_configs.get("read_timeout", 60))
    told = config.rdzv_configs.get("is_host")
    bind = LOOPBACK if port == 0 else local_address(host)
    hosting = bool(told) if told is not None else bind is not None
    if hosting and bind is not None:
        try:
            return host_store(bind, port, read_timeout_s, multi_tenant=True)
        except OSError:
            if told is not None:
                raise
    return client_store(host, port, read_timeout_s)


def _agent_class() -> Any:
    """torch's local elastic agent, but for a second signal during the workers' grace (Ctrl-C
    twice): torch's own then sends them SIGTERM and waits the whole grace again; this one
    kills them at once, together (not one by one as the launcher exits: a rank alive a
    moment longer would call the store a killed one hosted, and torch print its C++ trace).
    A class made on first use: torch is imported only once a job starts."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    class Agent(LocalElasticAgent):
        stopped_at_once = 0  # the second signal, once it cut the grace short

        def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
            try:
                super()._shutdown(death_sig, timeout)
            except SignalException as exc:
                self.stopped_at_once = int(exc.sigval)
                super()._shutdown(signal.SIGKILL, timeout=5)
                raise

    return Agent


class StoppedAtOnce(Exception):
    """A second signal came while the workers had their grace to save: they were killed."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by signal {signum}")
        self.signum = signum


def run_agent(
    config: LaunchConfig,
    args: tuple[str, ...],
    store_port: int | None,
    secret: JobSecret,
    waiting_words: str = "",
    before_run: Callable[[], None] | None = None,
) -> None:
    """Run ``python ARGS`` as the workers of ``config`` (a torch ``LaunchConfig``) under
    torch's local elastic agent, as ``torch.distributed.launcher.elastic_launch`` does, with
    the workers' store at ``store_port`` (None: the port torch's rendezvous picks).
    ``waiting_words``: said once when a rendezvous still waits for the other machines after a
    few seconds (dtrain.launch.rendezvous_wait; "": nothing). ``before_run``: called once the
    rendezvous handler (and, on the machine that hosts it, its store) exists, before any
    worker starts. ``secret`` seals the rendezvous state (:mod:`dtrain.dist.rendezvous`).
    With a ``store_port`` (one machine) the workers' store is at 127.0.0.1.

    Raises ``ChildFailedError`` when workers failed; ``RendezvousError`` and
    ``SignalException`` pass through as from ``elastic_launch``; :class:`StoppedAtOnce` when a
    second signal cut the workers' grace short."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from dtrain.dist.rendezvous import make_handler

    parameters = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    # The agent's worker processes install handlers for these and forward them (torch reads
    # the list from the environment, as elastic_launch sets it).
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle
    handler = make_handler(parameters, rendezvous_store(config), secret)
    if waiting_words:
        announce_waits(handler, waiting_words)
    if before_run is not None:
        before_run()
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=sys.executable,
        args=args,
        rdzv_handler=handler,
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_port=store_port,
        # One machine: the workers' store on loopback (rank 0 listens where it is reached).
        master_addr=LOOPBACK if store_port is not None else None,
        local_addr=config.local_addr,
        numa_options=config.numa_options,
    )
    # Set by LaunchConfig itself (its logs) and by dtrain.launch.launcher (the grace before
    # SIGKILL).
    assert config.logs_specs is not None and config.shutdown_timeout is not None
    agent = _agent_class()(
        spec=spec,
        logs_specs=config.logs_specs,
        start_method=config.start_method,
        shutdown_timeout=config.shutdown_timeout,
    )
    close_rendezvous = True
    try:
        result = agent.run()
        if result is None:  # torch's agent: the rendezvous closed before it admitted this one
            from torch.distributed.elastic.rendezvous.api import RendezvousClosedError

            raise RendezvousClosedError("the rendezvous closed before this machine joined")
        if result.is_failed():
            raise ChildFailedError(name="dtrain.worker", failures=result.failures)
    except SignalException:
        # A launcher ended by a signal leaves the rendezvous open: closing it would end the
        # job for the other machines too, which may go on without this one.
        close_rendezvous = False
        if agent.stopped_at_once:
            raise StoppedAtOnce(agent.stopped_at_once) from None
        raise
    finally:
        if close_rendezvous:
            spec.rdzv_handler.shutdown()
