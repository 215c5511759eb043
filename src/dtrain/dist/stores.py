"""The stores a job hosts, each listening on the address the job uses, never on every address.

torch's ``TCPStore`` server listens on every address of the machine (``[::]``/``0.0.0.0``)
whatever host it is given, so a single-machine job's stores were open to the network. Here
the listening socket is made first, bound to one address, and handed to the store
(``master_listen_fd``): loopback for a job on one machine, the address the other machines
reach across machines (docs/security.md lists the ports and addresses of a job).
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

from dtrain.dist.network import IFNAME_VARIABLES, interface_of, socket_ifname_set

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")
_BACKLOG = 2048  # torch's own store listens with a backlog this deep: every rank connects at once


def listener(address: str, port: int) -> socket.socket:
    """A listening TCP socket on ``address:port`` (port 0: a free one), ``SO_REUSEADDR`` as
    torch's own store binds (a port held by :func:`dtrain.launch.agent.held_port` stays usable)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6 and address in WILDCARDS:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind((address, port))
        sock.listen(_BACKLOG)
    except OSError:
        sock.close()
        raise
    return sock


def host_store(
    address: str,
    port: int,
    timeout_s: float,
    *,
    multi_tenant: bool = False,
) -> Any:
    """A ``TCPStore`` server of this process listening on ``address:port`` only (port 0: a free
    one, read back from the store's ``port``). Raises ``OSError`` when it cannot listen."""
    import torch.distributed as dist

    sock = listener(address, port)
    bound_port = int(sock.getsockname()[1])
    fd = sock.detach()  # the store owns the socket from here on, and closes it
    return dist.TCPStore(  # type: ignore[attr-defined]
        address,
        bound_port,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
        multi_tenant=multi_tenant,
        master_listen_fd=fd,
    )


def client_store(host: str, port: int, timeout_s: float) -> Any:
    """A plain client of the store at ``host:port``: it tries to connect, and each of its calls
    waits, up to ``timeout_s``."""
    import torch.distributed as dist

    return dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def keep_collectives_on_loopback() -> None:
    """A job on one machine: its collectives listen on loopback (gloo and NCCL otherwise take
    the address of the machine's hostname, open to the network), unless the user chose an
    interface (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``); the workers inherit this."""
    loopback = interface_of(LOOPBACK)  # "lo" on Linux; None where interfaces are unknown
    if loopback and not socket_ifname_set():
        for name in IFNAME_VARIABLES:
            os.environ[name] = loopback
