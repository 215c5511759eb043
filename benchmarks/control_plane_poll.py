"""The in-place coordinator's poll alone (issue 44): one process hosts the store as dtrain hosts
it and runs dtrain's :class:`~dtrain.recovery.coordinator.Coordinator` on it, polled by hand;
W members' records are posted by 8 client threads as dtrain's members post them. It times
every poll that forms the first generation once every member has registered and asked, steady
polls, and every poll that forms the regroup once one member's process ended and every other
asked (a poll reads and writes at most ``BATCH`` records: a burst of asks takes several polls,
each within its interval); and counts the bytes a member reads to learn its generation (the
record and its proof). The regroup's total is its polls' time plus the intervals between them
(``Coordinator.interval``: ``POLL_S``, a fifth of it while it catches up).

    PYTHONPATH=src python benchmarks/control_plane_poll.py --worlds 1024,4096

No ranks, no /proc: each member's process is a number the poll's ``state_of`` answers for, so
what is timed is the coordinator's own work and its calls to the store. Members sit on
machines of ``--per-machine`` (the coordinator reads its own machine's processes; the other
machines' launchers post their members' states, as in a real job). The store's thread
runs beside the posting threads on the same cores: on a loaded machine the figures are
ceilings.
"""

from __future__ import annotations

import argparse
import gc
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from _report import machine_line
from dtrain.dist.stores import client_store, host_store
from dtrain.recovery.coordinator import Coordinator
from dtrain.recovery.membership import POLL_S, PREFIX, STALE_S, post

POSTERS = 8


def burst(port: int, world: int, fn: Callable[[Any, int], object]) -> list[threading.Thread]:
    """``fn(client, member)`` for every member, from ``POSTERS`` threads of their own clients."""

    def run(members: range) -> None:
        client = client_store("127.0.0.1", port, 60.0)
        for m in members:
            fn(client, m)

    threads = [
        threading.Thread(target=run, args=(range(i, world, POSTERS),)) for i in range(POSTERS)
    ]
    for thread in threads:
        thread.start()
    return threads


def timed_poll(coordinator: Coordinator) -> tuple[float, float]:
    """One poll's wall time and the CPU time of this process meanwhile (the coordinator's
    thread and the store's: what the poll cost, less what other jobs took of the cores)."""
    # The posting threads' garbage is this script's, not the launcher's (its posters are other
    # processes): collected before, so that a sweep it left due does not land in the poll.
    gc.collect()
    cpu, started = time.process_time(), time.perf_counter()
    coordinator.poll()
    return time.perf_counter() - started, time.process_time() - cpu


waits: list[float] = []  # the coordinator's interval after each poll polls_until made


def polls_until(coordinator: Coordinator, number: int) -> list[tuple[float, float]]:
    """Every poll's times until generation ``number`` is formed (at most 1,000 polls)."""
    times: list[tuple[float, float]] = []
    while coordinator.number < number or coordinator.catching_up:
        times.append(timed_poll(coordinator))
        waits.append(coordinator.interval())
        assert len(times) < 1000, f"generation {number} did not form in 1,000 polls"
    return times


def spread(times: list[tuple[float, float]]) -> str:
    """``N poll(s) p50/p99/max ms``, of the wall time and (in brackets) of the CPU time."""

    def three(values: list[float]) -> str:
        ordered = sorted(values)
        p99 = ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)]
        return f"{ordered[len(ordered) // 2] * 1e3:.1f}/{p99 * 1e3:.1f}/{ordered[-1] * 1e3:.1f}"

    walls, cpus = [w for w, _ in times], [c for _, c in times]
    return f"{len(times)} poll(s) p50/p99/max {three(walls)} ms (CPU {three(cpus)})"


def joined(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()


def one_world(world: int, per_machine: int) -> str:
    """The figures of one world size; members on machines of ``per_machine`` (0: all on the
    coordinator's, whose processes it then reads one by one at every poll)."""
    server = host_store("127.0.0.1", 0, 60.0)
    dead: set[int] = set()
    local = range(per_machine) if per_machine else None
    # The clock stands: every other machine's launcher counts as heard throughout.
    coordinator = Coordinator(
        server,
        world,
        stale_s=STALE_S,
        hang_s=300.0,
        local=local,
        per_node=per_machine or None,
        clock=lambda: 1000.0,
        state_of=lambda pid: "X" if pid in dead else "S",
    )

    def register(client: Any, m: int) -> None:
        post(client, m, "info", {"pid": 100_000 + m, "host": "h", "nonce": f"n{m}"})
        post(client, m, "want", {"after": -1, "nonce": f"n{m}", "step": 0})

    joined(burst(server.port, world, register))
    first = polls_until(coordinator, 0)  # every member registered and asks
    steady = [timed_poll(coordinator) for _ in range(50)]
    # The last member's process ends (its machine's launcher posts it down, or this machine's
    # /proc says so), and every other member asks.
    victim = world - 1
    dead.add(100_000 + victim)
    if per_machine and victim >= per_machine:
        post(server, victim, "state", {"nonce": f"n{victim}", "down": True})

    def ask(client: Any, m: int) -> None:
        if m != victim:
            post(client, m, "want", {"after": 0, "nonce": f"n{m}", "step": 5})

    joined(burst(server.port, world, ask))
    del waits[:]
    regroup = polls_until(coordinator, 1)
    assert coordinator.formed[1].left == (victim,), "the regroup did not leave out the victim"
    # The regroup's polls and the waits between them (the coordinator's interval after each).
    total = sum(wall for wall, _ in regroup) + sum(waits[-len(regroup) : -1])
    # What a member reads of the generation it joins: the record, and its own proof.
    read = [f"{PREFIX}gen/1", f"{PREFIX}member/0/gen"]
    member_bytes = sum(len(server.get(key)) for key in read if server.check([key]))
    every = [wall for wall, _ in first + steady + regroup]
    return (
        f"W = {world:>5}: first generation {spread(first)}; steady {spread(steady)}; regroup "
        f"{spread(regroup)}, {total * 1e3:.0f} ms in all with the intervals; every poll: max "
        f"{max(every) * 1e3:.1f} ms, {sum(t > POLL_S for t in every)} of {len(every)} over "
        f"{POLL_S * 1e3:.0f} ms (wall); a member reads {member_bytes:,} bytes of its generation "
        f"({member_bytes * (world - 1) / 1e6:.2f} MB through the store in all)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="1024,4096")
    parser.add_argument(
        "--per-machine", type=int, default=8, help="members per machine (0: all on one)"
    )
    args = parser.parse_args()
    os.environ.setdefault("DTRAIN_JOB_SECRET", secrets.token_hex(32))  # values sealed, as a job's
    print(f"members on machines of {args.per_machine or 'all'}; one poll after all posted:")
    for world in (int(w) for w in args.worlds.split(",") if w):
        print(one_world(world, args.per_machine), flush=True)
    print(machine_line())


if __name__ == "__main__":
    main()
