"""This machine's network interfaces and addresses, for a job that spans several machines.

The launcher uses them to choose the address a node advertises to the others (``--local-addr``)
and the interface its collectives use (``--iface``); the workers' start-up check
(:mod:`dtrain.dist.reachability`) to know the address their collectives will listen on. Nothing
here sends a packet: routes are looked up with an unconnected UDP socket's ``connect``, which
only consults the routing table. Linux is read through ``ioctl`` and ``/proc``; elsewhere the
functions answer "unknown" (an empty list, None) and the callers fall back to torch's defaults.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct

from dtrain.console import say_line
from dtrain.errors import UserError

_SIOCGIFADDR = 0x8915  # Linux: an interface's (first) IPv4 address
IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")  # the collectives' interface


def interface_names() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - no interface table
        return []


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
            )
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def _ipv6_by_interface() -> dict[str, list[str]]:
    """Global and loopback IPv6 addresses by interface (link-local ones need a scope id that no
    peer on another machine can use, so they are left out)."""
    found: dict[str, list[str]] = {}
    try:
        with open("/proc/net/if_inet6") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return found
    for line in lines:
        fields = line.split()
        if len(fields) < 6:
            continue
        address = ipaddress.IPv6Address(bytes.fromhex(fields[0]))
        if not address.is_link_local:
            found.setdefault(fields[5], []).append(str(address))
    return found


def interface_addresses(name: str) -> list[str]:
    """The addresses of interface ``name``, IPv4 first."""
    ipv4 = _ipv4_of(name)
    return ([ipv4] if ipv4 else []) + _ipv6_by_interface().get(name, [])


def interface_of(address: str) -> str | None:
    """The interface of this machine that holds ``address`` (an IP address), or None."""
    try:
        wanted = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name in interface_names():
        if any(ipaddress.ip_address(a) == wanted for a in interface_addresses(name)):
            return name
    return None


def resolve(host: str) -> list[str]:
    """The IP addresses ``host`` resolves to here (IPv4 first); raises OSError when it does not."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return sorted(dict.fromkeys(str(info[4][0]) for info in infos), key=lambda a: ":" in a)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) means this machine's loopback here."""
    try:
        return any(ipaddress.ip_address(a).is_loopback for a in resolve(host))
    except OSError:
        return False


def is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` as (host, port); raises ValueError on anything else."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(endpoint)
    return host.strip("[]"), int(port)


def check_port_free(endpoint: str) -> None:
    """Before this machine hosts a store at ``endpoint``'s port (the rendezvous, or in-place
    recovery's membership store): a port another listener holds is one line here, instead of
    torch's traceback (EADDRINUSE) or its "connection to the C10d store has failed". The probe
    binds as torch's store does (``SO_REUSEADDR``, every address), so what passes here, the
    store can bind too."""
    port = split_endpoint(endpoint)[1]
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(("0.0.0.0", port))
    except OSError as exc:
        raise UserError(
            f"--rdzv-endpoint {endpoint}: this machine hosts the rendezvous there but cannot "
            f"listen on port {port} ({exc.strerror}: another job's rendezvous, a `dtrain "
            "rendezvous`, or a job still ending holds it): choose another port, or stop what "
            "holds it"
        ) from None
    finally:
        probe.close()


def route_source(host: str, port: int = 9) -> str | None:
    """The source address this machine would use to reach ``host``: no packet is sent, the
    kernel only looks up the route. None when ``host`` does not resolve or has no route."""
    try:
        address = resolve(host)[0]
    except (OSError, IndexError):
        return None
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((address, port))
        except OSError:
            return None
        return str(sock.getsockname()[0])


def default_route_interface() -> str | None:
    """The interface of the IPv4 default route (from /proc/net/route), or None."""
    try:
        with open("/proc/net/route") as fh:
            rows = [line.split() for line in fh.read().splitlines()[1:]]
    except OSError:
        return None
    for row in rows:
        if len(row) > 7 and row[1] == "00000000" and row[7] == "00000000":
            return row[0]
    return None


def advertised_address(rdzv_host: str) -> str | None:
    """The address a node advertises when ``--local-addr`` is not given: the one it would use
    to reach the rendezvous host -- the others reach it the same way. When that is a loopback
    address although the host was given by name (a hostname mapped to 127.0.x.1 in this
    machine's /etc/hosts, as Debian does), the address of the default route's interface
    instead: no other machine can reach a loopback address. None when nothing is known."""
    source = route_source(rdzv_host)
    if source is None:
        return None
    if ipaddress.ip_address(source).is_loopback and not is_ip_literal(rdzv_host):
        interface = default_route_interface()
        addresses = interface_addresses(interface) if interface else []
        if addresses:
            return addresses[0]
    return source


def choose_node_network(rdzv_endpoint: str, local_addr: str, iface: str) -> tuple[str | None, str]:
    """The address this node advertises and the interface its collectives use, from
    ``--local-addr`` and ``--iface`` (either may be empty); raises :class:`UserError` for an
    interface that does not exist or an address that does not resolve.

    Defaults, for a job with a rendezvous endpoint (a single machine keeps torch's): the address
    is the first of ``--iface``'s, else :func:`advertised_address`; the interface is the one that
    holds that address, unless GLOO_SOCKET_IFNAME or NCCL_SOCKET_IFNAME is set already (the
    user's choice stands) or the address is not one of this machine's (behind NAT: gloo's own
    choice, by hostname, then stands).
    """
    if iface and iface not in interface_names():
        raise UserError(
            f"--iface {iface}: no such network interface on this machine "
            f"(it has: {', '.join(interface_names()) or 'none'})"
        )
    if iface and not interface_addresses(iface):
        raise UserError(f"--iface {iface}: the interface has no IP address")
    if local_addr:
        try:
            resolve(local_addr)
        except OSError as exc:
            raise UserError(f"--local-addr {local_addr}: does not resolve ({exc})") from None
    if not rdzv_endpoint:
        return (local_addr or None), iface
    rdzv_host = split_endpoint(rdzv_endpoint)[0]
    if local_addr and is_ip_literal(local_addr) and interface_of(local_addr) is None:
        say_line(
            f"dtrain: warning: --local-addr {local_addr} is not an address of this machine "
            "(right only behind NAT or a forwarding proxy)"
        )
    address = local_addr or (interface_addresses(iface)[0] if iface else None)
    if address and is_loopback(address) and not is_loopback(rdzv_host):
        given = f"--local-addr {local_addr}" if local_addr else f"--iface {iface} ({address})"
        raise UserError(
            f"{given} is a loopback address here, but the rendezvous host {rdzv_host} is "
            "reached over a network: the other machines cannot reach this one at a loopback "
            "address; pass an address of this machine they can reach"
        )
    if not address:
        address = advertised_address(rdzv_host)
    if not iface and address and not socket_ifname_set():
        try:
            iface = interface_of(resolve(address)[0]) or ""
        except OSError:  # pragma: no cover - resolved above
            iface = ""
    return address, iface


def socket_ifname_set() -> bool:
    """Whether the user chose the collectives' interface (``GLOO_SOCKET_IFNAME``/``NCCL_...``)."""
    return any(os.environ.get(name) for name in IFNAME_VARIABLES)


def local_address(host: str) -> str | None:
    """The address of this machine that ``host`` (a name or an address) resolves to -- what a
    store reached as ``host`` listens on -- or None when ``host`` is not this machine."""
    try:
        addresses = resolve(host)
    except OSError:
        return None
    for address in addresses:
        if interface_of(address) is not None or ipaddress.ip_address(address).is_loopback:
            return address
    return None
