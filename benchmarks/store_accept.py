"""The store's accept stall (issue 44): W clients connect at once to a store hosted as dtrain
hosts it (:func:`dtrain.dist.stores.host_store`), and a client already connected times an
``add`` every 50 ms meanwhile.

    PYTHONPATH=src python benchmarks/store_accept.py --world 256 --address 192.0.2.2

What it found (docs/fault-tolerance.md, "The store's accept stall"): torch's store server
formats each accepted peer's address with ``getnameinfo`` without ``NI_NUMERICHOST`` -- a
reverse DNS lookup, made on the one thread that also accepts and answers every call -- and
each client does one for its own socket. Where the resolver drops a query, the store stops for
the resolver's timeout (glibc: 5 s, ``options timeout:`` in ``/etc/resolv.conf``, tried
``attempts:`` times), its accept queue fills, and nothing uses its CPU. The script counts the
lookups that stalled and prints the resolver's own time for the reverse lookup of the address.
"""

from __future__ import annotations

import argparse
import datetime
import socket
import statistics
import subprocess
import threading
import time
from typing import Any

STALL_S = 4.0  # a connection or call this slow waited out the resolver, not the store's work


def reverse_lookups(address: str, count: int) -> list[float]:
    """Seconds each of ``count`` reverse lookups of ``address`` took (as torch's store makes
    them: ``getnameinfo`` of the peer, numeric service only)."""
    took = []
    for _ in range(count):
        started = time.perf_counter()
        try:
            socket.getnameinfo((address, 1), socket.NI_NUMERICSERV)
        except OSError:
            pass
        took.append(time.perf_counter() - started)
    return took


def listen_queue(port: int) -> str:
    """``ss``'s line for the listening socket: Recv-Q (connections waiting for accept) and
    Send-Q (the backlog)."""
    try:
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "ss: unavailable"
    return " ".join(out.split()[:3]) if out.strip() else "ss: no line"


def storm(address: str, world: int, timeout_s: float) -> dict[str, Any]:
    import torch.distributed as dist

    from dtrain.dist.stores import client_store, host_store

    server = host_store(address, 0, timeout_s)
    port = int(server.port)
    prober = client_store(address, port, timeout_s)
    connect_s: list[float] = []
    errors: list[str] = []
    clients: list[Any] = []
    lock = threading.Lock()
    go = threading.Event()

    def join() -> None:
        go.wait()
        started = time.perf_counter()
        try:
            client = dist.TCPStore(  # type: ignore[attr-defined]
                address,
                port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
            client.add("joined", 1)
        except Exception as exc:  # reported, counted
            with lock:
                errors.append(str(exc).splitlines()[0][:120])
            return
        with lock:
            connect_s.append(time.perf_counter() - started)
            clients.append(client)

    threads = [threading.Thread(target=join, daemon=True) for _ in range(world)]
    for thread in threads:
        thread.start()
    probe_s: list[float] = []
    queues: list[str] = []
    started = time.perf_counter()
    go.set()
    while any(t.is_alive() for t in threads) and time.perf_counter() - started < timeout_s:
        t0 = time.perf_counter()
        prober.add("probe", 1)
        probe_s.append(time.perf_counter() - t0)
        if len(queues) < 400:
            queues.append(listen_queue(port))
        time.sleep(0.05)
    wall = time.perf_counter() - started
    busiest = max(queues, key=lambda line: int(line.split()[1]) if line[:1].isalpha() else 0)
    return {
        "world": world,
        "connected": len(connect_s),
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "wall_s": round(wall, 2),
        "connect_p50_s": round(statistics.median(connect_s), 3) if connect_s else None,
        "connect_max_s": round(max(connect_s), 2) if connect_s else None,
        "connects_stalled": sum(s >= STALL_S for s in connect_s),
        "probe_max_s": round(max(probe_s), 2) if probe_s else None,
        "probes_stalled": sum(s >= STALL_S for s in probe_s),
        "fullest_listen_queue": busiest,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[64])
    parser.add_argument("--address", default="127.0.0.1", help="where the store listens")
    parser.add_argument("--lookups", type=int, default=50, help="reverse lookups timed first")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()
    took = reverse_lookups(args.address, args.lookups)
    print(
        f"reverse lookup of {args.address}: {len(took)} tries, median "
        f"{statistics.median(took) * 1000:.1f} ms, max {max(took):.2f} s, "
        f"{sum(t >= STALL_S for t in took)} at the resolver's timeout",
        flush=True,
    )
    for world in args.world:
        print(storm(args.address, world, args.timeout), flush=True)


if __name__ == "__main__":
    main()
