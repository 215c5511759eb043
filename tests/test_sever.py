"""dtrain.recovery.sever: a rank that leaves a failed generation shuts down its connections to the
other workers, so that a rank blocked on it fails at once instead of at its collective timeout.

Four ranks in gloo's ring all-reduce, rank 2 killed outright: ranks 1 and 3 (its neighbours)
read end-of-file from its sockets; rank 0 waits on 1 and 3, which are alive, and without the
severing would wait out the timeout (60 s here, longer than the test runs)."""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
import sys

import torch
import torch.distributed as dist

from dtrain.recovery.sever import GenerationLinks
from tests.ranks import RankFailed, run_ranks

VICTIM = 2


def ring_with_a_dead_rank() -> tuple[str, int]:
    """One rank of four: all-reduce until a collective fails (rank 2 ends itself in its 4th),
    then sever; the failure's text and how many connections were shut down."""
    rank = int(os.environ["RANK"])
    links = GenerationLinks()  # before the group's connections exist
    dist.init_process_group("gloo", rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    pids: list[int] = [0] * 4
    dist.all_gather_object(pids, os.getpid())
    tensor = torch.ones(1 << 16)
    try:
        for index in range(1000):
            if rank == VICTIM and index == 3:
                os._exit(0)
            dist.all_reduce(tensor)
    except Exception as exc:
        severed = links.sever(pid for pid in pids if pid != os.getpid())
        store = dist.distributed_c10d._get_default_store()
        store.set(f"survivor/{rank}", "alive")  # the store's connection was left alone
        return str(exc), severed
    return "no failure", 0


def test_survivors_not_next_to_the_dead_rank_fail_at_once() -> None:
    results = run_ranks(
        ring_with_a_dead_rank, 4, init_group=False, timeout=50, raise_on_failure=False
    )
    assert isinstance(results[VICTIM], RankFailed)
    survivors = [r for r in range(4) if r != VICTIM]
    for rank in survivors:
        text, _ = results[rank]
        # Failed on a closed connection (its peer's, or a severed one), not on the timeout.
        assert "timed out" not in text.lower() and "no failure" not in text, (rank, text)
    # The neighbours of the dead rank severed their links with the living ranks.
    assert sum(results[r][1] for r in survivors) >= 2


ECHO = """
import socket, sys, threading
def serve(listener):
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=echo, args=(conn,), daemon=True).start()
def echo(conn):
    while data := conn.recv(64):
        conn.sendall(data)
ports = []
for _ in range(2):
    listener = socket.create_server(("127.0.0.1", 0))
    ports.append(listener.getsockname()[1])
    threading.Thread(target=serve, args=(listener,), daemon=True).start()
print(*ports, flush=True)
sys.stdin.read()
"""


def test_connections_to_a_machine_cut_off_are_shut_down_but_not_the_store_s() -> None:
    # Another process plays the machine cut off: one port its worker's collectives use, one
    # the membership store (which the severing spares).
    peer = subprocess.Popen(
        [sys.executable, "-c", ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None
        collectives, store_port = (int(p) for p in peer.stdout.readline().split())
        before = socket.create_connection(("127.0.0.1", collectives))  # an earlier generation's
        links = GenerationLinks()
        gloo = socket.create_connection(("127.0.0.1", collectives))
        store = socket.create_connection(("127.0.0.1", store_port))
        assert links.sever_addresses(["10.81.0.9"], store_port) == 0  # another address
        assert links.sever_addresses(["127.0.0.1"], store_port) == 1
        assert gloo.recv(8) == b""  # shut down: a reader waiting on it returns at once
        for kept in (store, before):
            kept.sendall(b"ok")
            assert kept.recv(8) == b"ok"
        for sock in (before, gloo, store):
            sock.close()
    finally:
        peer.kill()
        peer.wait()
