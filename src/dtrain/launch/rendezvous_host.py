"""``dtrain rendezvous``: the rendezvous of a multi-machine job, run apart from the machines
that train.

Run here -- on a login node, any machine that stays up -- the rendezvous outlives any training
machine, which the hosting ``dtrain train`` of ``--node-rank 0`` does not (docs/multi-host.md,
"A rendezvous that outlives any machine"). It is torch's own key-value store, served until this
command is stopped, on one address (``--bind``), with the check of the job's secret that every
machine's launcher compares its own with (docs/security.md).
"""

from __future__ import annotations

import ipaddress
import signal

from dtrain.console import say_line
from dtrain.dist.network import default_route_interface, interface_addresses, interface_names
from dtrain.errors import UserError


def default_address() -> str:
    """The address other machines reach this one at, on most clusters: that of the default
    route's interface, else the one address of this machine's one other interface; a
    :class:`UserError` when neither says."""
    interface = default_route_interface()
    if interface and interface_addresses(interface):
        return interface_addresses(interface)[0]
    others = [
        address
        for name in interface_names()
        for address in interface_addresses(name)
        if not ipaddress.ip_address(address).is_loopback
    ]
    if len(others) == 1:
        return others[0]
    raise UserError(
        "dtrain rendezvous: cannot tell which address of this machine the training machines "
        f"reach ({', '.join(others) or 'none but loopback'}); pass --bind ADDRESS"
    )


def serve(port: int, bind: str = "") -> int:
    """Serve the rendezvous store at ``bind:port`` (default: the address of the default
    route's interface) until SIGINT or SIGTERM; returns the exit code."""
    from dtrain.dist.rendezvous import post_secret_check
    from dtrain.dist.secret import HOW_TO, process_secret
    from dtrain.dist.stores import WILDCARDS, host_store

    if not 0 < port < 65536:
        raise UserError(f"--port {port}: a TCP port, 1 to 65535")
    secret = process_secret()
    if secret is None:
        raise UserError(f"dtrain rendezvous needs the job's secret: {HOW_TO}")
    address = bind or default_address()
    if address in WILDCARDS:
        say_line(
            "dtrain: warning: --bind 0.0.0.0: the rendezvous listens on every address of "
            "this machine; keep its port behind a firewall (docs/security.md)"
        )
        address = "0.0.0.0"
    try:
        store = host_store(address, port, 60.0)
    except (RuntimeError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"cannot serve the rendezvous on {address}:{port}: {first}") from None
    post_secret_check(store, secret)
    # Blocked before the line that says it listens: a SIGTERM sent on reading it (a test, a
    # script) arrived before the block once and killed the process instead of stopping it.
    stop = (signal.SIGINT, signal.SIGTERM)
    signal.pthread_sigmask(signal.SIG_BLOCK, stop)
    say_line(
        f"dtrain: rendezvous store listening on {address}:{port}; start `dtrain train` on "
        f"every machine with --rdzv-endpoint THIS_MACHINE:{port} and the same job secret "
        "(Ctrl-C or SIGTERM stops it)"
    )
    received = signal.sigwait(stop)
    del store  # closes the server
    say_line(f"dtrain: rendezvous store stopped ({signal.Signals(received).name})")
    return 0
