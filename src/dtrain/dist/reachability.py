"""At start, every rank checks that it can reach what the job needs: an address that does not
route is one line naming the host and the address, within seconds, not a hang in
``init_process_group`` until the collective timeout (the classic case: rank 0's hostname
resolves to 127.0.0.1 there, and the other machines try ``localhost``).

Checked in :func:`dtrain.dist.runtime.init_runtime`, before ``init_process_group``, each bounded
by ``dist.connect_timeout_s``: (1) the job's store, ``MASTER_ADDR:MASTER_PORT`` (a name that does
not resolve, or a loopback address while this node advertises a real one, fails at once;
"connection refused" is retried while rank 0 starts); (2) the peers' collective addresses: each
rank listens on gloo's address, publishes it, and connects to rank 0 and its two ring
neighbours -- a cheap sample of gloo's mesh (docs/multi-host.md, the check before
``init_process_group``). The listening socket stays open for the worker's life: no rank passes
``init_process_group`` before every rank has finished its connections, and afterwards it
answers :func:`probe`, which tells a peer gone (refused) from one cut off (no answer) from one
alive but silent (accepted). What the check publishes is sealed with the job's secret
(:mod:`dtrain.dist.sealed_store`), so a stranger cannot redirect a rank or stop the start.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import ipaddress
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dtrain.dist import sealed_store
from dtrain.dist.network import interface_addresses, is_loopback, local_address, resolve
from dtrain.dist.sealed_store import Shape
from dtrain.dist.stores import client_store, host_store
from dtrain.errors import UserError

# Set by ``dtrain train`` for its workers: the address this node advertises to the others.
NODE_ADDR_ENV = "DTRAIN_NODE_ADDR"

_ATTEMPT_S = 2.0  # one connection attempt: an unreachable host answers in well under that
_RETRY_S = 0.25


class Unreachable(UserError):
    """An address this rank must reach does not answer (or cannot be one that would)."""


def node_label() -> str:
    """How this rank's machine is named in messages: its advertised address where known
    (machines, containers and namespaces often share a hostname), else its hostname."""
    return f"host {os.environ.get(NODE_ADDR_ENV) or socket.gethostname()}"


def connect_error(host: str, port: int, timeout_s: float) -> OSError | None:
    """Try a TCP connection to ``host:port`` until one succeeds or ``timeout_s`` has passed;
    None on success, else the last error (refused, no route, timed out)."""
    deadline = time.monotonic() + timeout_s
    last: OSError = TimeoutError(errno.ETIMEDOUT, "timed out")
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return last
        try:
            with socket.create_connection((host, port), timeout=min(_ATTEMPT_S, left)):
                return None
        except socket.gaierror:
            raise
        except OSError as exc:
            # A timeout says less than what an earlier attempt said ("No route to host").
            if not isinstance(exc, TimeoutError) or isinstance(last, TimeoutError):
                last = exc
        time.sleep(min(_RETRY_S, max(0.0, deadline - time.monotonic())))


def describe(error: OSError) -> str:
    return error.strerror or str(error) or type(error).__name__


def wait_for_endpoint(
    host: str, port: int, timeout_s: float, on_wait: Callable[[str], None] | None = None
) -> OSError | None:
    """Wait up to ``timeout_s`` for ``host:port`` to accept a TCP connection; None once it does,
    else the last error. ``on_wait(reason)`` is called once, after a few seconds of waiting."""
    first = connect_error(host, port, min(timeout_s, 5.0))
    if first is None or timeout_s <= 5.0:
        return first
    if on_wait is not None:
        on_wait(describe(first))
    return connect_error(host, port, timeout_s - 5.0)


def _hint_loopback(host: str) -> str:
    return (
        f"{host} is a loopback address here: rank 0's machine advertised its hostname, which "
        "resolves to 127.0.0.1 there; pass each machine's --local-addr ADDR (an address the "
        "others reach it at) to `dtrain train` or `torchrun`"
    )


def master_endpoint() -> tuple[str, int]:
    """The job's store, as torch's launcher tells its workers (MASTER_ADDR:MASTER_PORT)."""
    return os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))


def check_store(nodes: int, timeout_s: float) -> None:
    """Raise :class:`Unreachable` unless the job's store answers at MASTER_ADDR:MASTER_PORT."""
    host, port = master_endpoint()
    where = f"the job's store at {host}:{port} (MASTER_ADDR:MASTER_PORT, from rank 0's machine)"
    try:
        resolve(host)
    except OSError as exc:
        raise Unreachable(
            f"{node_label()} cannot resolve {where}: {exc}; pass --local-addr ADDR (an address, "
            "not a name) on every machine"
        ) from None
    loopback = is_loopback(host)
    own = os.environ.get(NODE_ADDR_ENV)
    if nodes > 1 and loopback and own and not is_loopback(own):
        # This node talks to the others over a network; rank 0's advertised loopback.
        raise Unreachable(f"{node_label()} cannot use {where}: {_hint_loopback(host)}")
    if (error := connect_error(host, port, timeout_s)) is not None:
        hint = f"; {_hint_loopback(host)}" if nodes > 1 and loopback else ""
        raise Unreachable(
            f"{node_label()} cannot reach {where} within {timeout_s:.0f}s: {describe(error)}{hint}"
        )


def open_store(*, is_master: bool, timeout: datetime.timedelta, connect_timeout_s: float) -> Any:
    """The job's store (MASTER_ADDR:MASTER_PORT), opened within ``connect_timeout_s``; its later
    calls wait up to ``timeout``."""
    host, port = master_endpoint()
    try:
        if is_master:  # listening where the ranks reach it (MASTER_ADDR), not everywhere
            address = local_address(host)
            if address is None:
                raise OSError(errno.EADDRNOTAVAIL, f"{host} is not an address of this machine")
            store = host_store(address, port, connect_timeout_s)
        else:
            store = client_store(host, port, connect_timeout_s)
    except (RuntimeError, OSError) as exc:
        role = "host" if is_master else "reach"
        # torch's message is long and mangles addresses; a plain connection says why in a word.
        probe = None if is_master else connect_error(host, port, _ATTEMPT_S)
        first = describe(probe) if probe else (str(exc).strip().splitlines() or [""])[0]
        extra = (
            " (the address this machine advertises, --local-addr, must be one of its own or "
            "lead to it)"
            if is_master
            else ""
        )
        raise Unreachable(
            f"{node_label()} cannot {role} the job's store at {host}:{port}{extra} within "
            f"{connect_timeout_s:.0f}s: {first}"
        ) from None
    store.set_timeout(timeout)
    return store


def collective_address(backend: str) -> str:
    """The address this rank's collectives listen on, as gloo chooses it: the interface in
    ``GLOO_SOCKET_IFNAME`` (``NCCL_SOCKET_IFNAME`` for nccl), else this machine's hostname."""
    variable = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    interface = os.environ.get(variable, "").split(",")[0]
    if interface and not interface.startswith(("^", "=")):
        addresses = interface_addresses(interface)
        if not addresses:
            raise Unreachable(
                f"{node_label()}: {variable}={interface}: no such network interface here, or "
                "it has no address (--iface names an interface of every machine)"
            )
        return addresses[0]
    try:
        candidates = resolve(socket.gethostname())
    except OSError:
        candidates = []
    for address in candidates:  # gloo takes the first it can bind to
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address, 0))
            except OSError:
                continue
        return address
    return "127.0.0.1"  # gloo's own fallback


def peers_of(rank: int, world_size: int) -> list[int]:
    """Whom ``rank`` checks: rank 0 and its ring neighbours."""
    return sorted({0, (rank - 1) % world_size, (rank + 1) % world_size} - {rank})


def _accept_forever(listener: socket.socket) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return  # closed: the check is over
        conn.close()


# The listening socket of this worker's start-up check, kept open until the process group is
# shut down (close_probe_listener): peers probe it when a collective with this rank fails.
_LISTENER: list[socket.socket] = []

# What a probe of a peer's address found.
OPEN, REFUSED, UNREACHABLE = "open", "refused", "unreachable"


def probe(host: str, port: int, timeout_s: float = 2.0) -> tuple[str, str]:
    """One TCP connection attempt to ``host:port``, quietly (no torch, no log): ``open`` (a
    process listens there), ``refused`` (the machine answers; nothing listens: the process is
    gone), or ``unreachable`` (no answer in ``timeout_s``, no route: the network, or the
    machine itself); with the system's words for it."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return OPEN, "connected"
    except ConnectionRefusedError as exc:
        return REFUSED, describe(exc)
    except TimeoutError:
        return UNREACHABLE, f"no answer in {timeout_s:.0f}s"
    except OSError as exc:  # no route to host, network unreachable, name lookup
        return UNREACHABLE, describe(exc)


REACH = "reach/"  # the start-up check's prefix store, under the job's namespace
ADDRESS: Shape = {"addr": str, "port": int, "host": str}  # a rank's published record


def reach_key(rank: int) -> str:
    """Where, in the job's store, a rank's start-up check published its address (under
    :func:`dtrain.dist.runtime.store_namespace`, as ``peers_checked``'s prefix store wrote it)."""
    return _in_store("", str(rank))


def _in_store(namespace: str, key: str) -> str:
    """The key ``key`` of the check's prefix store as the job's store holds it (a
    ``PrefixStore`` joins its prefix and a key with "/"): the name its value is sealed under."""
    return f"{namespace}{REACH}/{key}"


def close_probe_listener() -> None:
    """Close the socket peers probe (at the end of the worker's process group)."""
    while _LISTENER:
        close_listener(_LISTENER.pop())


@contextlib.contextmanager
def peers_checked(
    store: Any,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    hosts_store: bool,
    namespace: str = "",
) -> Iterator[None]:
    """Publish this rank's collective address under ``store`` (a prefix of its own,
    ``namespace + REACH`` of the job's store), connect to :func:`peers_of`, raise
    :class:`Unreachable` naming the first that does not answer; the listening socket stays
    open for the body (``init_process_group``) and, when the body succeeds, until
    :func:`close_probe_listener`."""
    address = collective_address(backend)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        try:
            listener.bind((address, 0))
        except OSError as exc:
            raise Unreachable(
                f"{node_label()}: rank {rank}'s collectives would use {address}, which is not an "
                f"address of this machine ({describe(exc)}); pass --iface NAME"
            ) from None
        listener.listen(128)
        threading.Thread(
            target=_accept_forever, args=(listener,), name="dtrain-reach", daemon=True
        ).start()
        record = {"addr": address, "port": listener.getsockname()[1], "host": node_label()}
        sealed = sealed_store.seal(_in_store(namespace, str(rank)), json.dumps(record).encode())
        store.set(str(rank), sealed)
        try:
            for peer in peers_of(rank, world_size):
                _check_peer(store, namespace, peer, timeout_s)
        except Unreachable as exc:
            _post_failure(store, namespace, f"rank {rank}: {exc}", linger=hosts_store)
            raise
        _wait_for_all(store, namespace, world_size, timeout_s)
        yield
    except BaseException:
        close_listener(listener)
        raise
    close_probe_listener()
    _LISTENER.append(listener)


def close_listener(listener: socket.socket) -> None:
    """Close the check's listening socket and so end its accept thread. Closing alone does not
    wake a thread blocked in ``accept`` on Linux: it stayed blocked for the whole run, and the
    worker's exit waited 2 s for it (``dtrain.worker.join_helper_threads``) after every run."""
    with contextlib.suppress(OSError):  # never listening, or already shut
        listener.shutdown(socket.SHUT_RDWR)  # wakes accept() (EINVAL)
    listener.close()


def _post_failure(store: Any, namespace: str, message: str, linger: bool) -> None:
    """Tell the other ranks why the job cannot start (they wait in :func:`_wait_for_all`); a
    rank that hosts the store gives them a moment to read it before its exit takes the store
    down."""
    try:
        store.set("failed", sealed_store.seal(_in_store(namespace, "failed"), message.encode()))
        store.set("all", "1")
    except RuntimeError:
        return
    if linger:
        time.sleep(1.0)


def _wait_for_all(store: Any, namespace: str, world_size: int, timeout_s: float) -> None:
    """Every rank's check done, or the first failure named: so that a rank whose own checks
    passed does not go on to fail obscurely in ``init_process_group`` (one store key each).
    The count and "all" cannot be sealed (a counter; a key waited for): a stranger who sets
    them only ends this wait early, and ``init_process_group`` waits for every rank anyway;
    a failure that fails its seal is none."""
    if int(store.add("checked", 1)) == world_size:
        store.set("all", "1")
    try:
        store.wait(["all"], datetime.timedelta(seconds=2 * timeout_s))
        raw = store.get("failed") if store.check(["failed"]) else None
        failed = sealed_store.text(_in_store(namespace, "failed"), raw) or ""
    except RuntimeError:
        raise Unreachable(
            f"{node_label()}: not every rank finished its start-up check within "
            f"{2 * timeout_s:.0f}s (the job's store went away, or a rank is stuck: see their "
            "errors)"
        ) from None
    if failed:
        raise Unreachable(f"{node_label()}: the job cannot start: {failed}")


def _published(store: Any, namespace: str, peer: int, timeout_s: float) -> dict[str, Any]:
    """The address ``peer`` published, waited for up to ``timeout_s``. One that fails its
    seal (a stranger's: warned once) counts as none yet: the peer's own replaces it."""
    name = _in_store(namespace, str(peer))
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            store.wait([str(peer)], datetime.timedelta(seconds=left))
        except RuntimeError as exc:
            if "timeout" not in str(exc).lower():
                raise
            break
        if (found := sealed_store.parse(name, store.get(str(peer)), ADDRESS)) is not None:
            return dict(found)
        time.sleep(min(_RETRY_S, left))
    raise Unreachable(
        f"{node_label()}: rank {peer} did not publish its address within {timeout_s:.0f}s "
        "(it failed before, see its own error, or has not started)"
    )


def _check_peer(store: Any, namespace: str, peer: int, timeout_s: float) -> None:
    found = _published(store, namespace, peer, timeout_s)
    address, port = found["addr"], int(found["port"])
    if (error := connect_error(address, port, timeout_s)) is not None:
        hint = ""
        if ipaddress.ip_address(address).is_loopback:
            hint = (
                f"; rank {peer}'s collectives are on loopback (its hostname's address, or "
                "--iface lo): pass --iface NAME on its machine, the interface that reaches the "
                "other machines"
            )
        raise Unreachable(
            f"{node_label()} cannot reach rank {peer} ({found['host']}) at {address}:{port}, the "
            f"address its collectives use, within {timeout_s:.0f}s: {describe(error)}{hint}"
        )
