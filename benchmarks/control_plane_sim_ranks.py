"""The processes of ``benchmarks/control_plane_sim.py``: the store host, and the simulated ranks.

``serve``: the job's store as dtrain hosts it (:func:`dtrain.dist.stores.host_store`), alone in
its process so that its CPU can be read from ``/proc``; for the in-place pieces, the launcher's
:class:`~dtrain.recovery.coordinator.Coordinator` beside it on the same store object, each poll
timed; it reads in ``/proc`` the processes of its own machine's members only (the first
``--per-machine``), as a real job's does. ``launchers``: the other machines' launchers, each
dtrain's :class:`~dtrain.recovery.coordinator.NodeWatcher` for its machine's members (their
states posted, its liveness counter added to). ``ranks``: many simulated ranks (threads) of
one process, each driving dtrain's own client objects -- a
:class:`~dtrain.fault.watchdog.Watchdog` (beats, diagnosis),
:class:`~dtrain.fault.peer_words.PeerWords`, a :class:`~dtrain.recovery.membership.Member` --
through their public methods. Each process plays one machine (its hostname is ``sim-<index>``),
so a rank of another process is on another machine to the diagnosis, as most peers are at
scale. The driver steers them through keys of the same store (``sim/...``, a connection of
their own, not counted) and reads what they print as one JSON line when they end.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

FATE = re.compile(r"rank (\d+) \([^)]*\) (?:died|stopped responding|is cut off|is unreachable)")
OPS = frozenset(
    {"set", "get", "add", "check", "multi_get", "multi_set", "wait", "append", "compare_set"}
    | {"delete_key", "num_keys"}
)
LONG = datetime.timedelta(seconds=3600)

TALLY: Counter[str] = Counter()  # store operations and link calls of this process's ranks
STARVED: Starved  # restart mode's (made once the process knows its mode)


class Counted:
    """A store client whose operations are counted (``TALLY``), otherwise the client itself:
    what dtrain's objects call on it reaches torch's ``TCPStore`` unchanged."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in OPS:
            return attr

        def op(*args: Any, **kwargs: Any) -> Any:
            TALLY["ops"] += 1
            TALLY[name] += 1
            return attr(*args, **kwargs)

        return op


def count_store_calls() -> None:
    """Every connection dtrain's objects open is counted, and every call: ``StoreLink.call``
    as ``benchmarks/control_plane_task.py`` counts it in a real job, and each store operation.
    The one place that knows how dtrain makes its clients: ``store_link.client_store``."""
    from dtrain.dist import store_link

    make, call = store_link.client_store, store_link.StoreLink.call

    def counted_client(*args: Any, **kwargs: Any) -> Counted:
        TALLY["connections"] += 1
        started = time.monotonic()
        try:
            return Counted(make(*args, **kwargs))
        except Exception:
            TALLY["connect_failures"] += 1
            raise
        finally:  # torch's client stalls 5 s on some connections (the report counts them)
            TALLY["slow_connections"] += time.monotonic() - started >= 1.0

    def counted_call(self: Any, op: Any, what: str, seconds: float | None = None) -> Any:
        TALLY["calls"] += 1
        return call(self, op, what, seconds)

    store_link.client_store = counted_client  # type: ignore[assignment]
    store_link.StoreLink.call = counted_call  # type: ignore[method-assign]


class Control:
    """The driver's word, through keys of the store on a connection of its own."""

    def __init__(self, port: int) -> None:
        from dtrain.dist.stores import client_store

        self.store = client_store("127.0.0.1", port, 600.0)
        self.store.set_timeout(LONG)

    def until(self, key: str) -> str:
        self.store.wait([f"sim/{key}"], LONG)
        return bytes(self.store.get(f"sim/{key}")).decode()

    def add(self, key: str, n: int = 1) -> None:
        self.store.add(f"sim/{key}", n)


class Steps:
    """The training loop's phase changes on every rank of this process, one thread for all:
    each step enters ``forward_backward`` (with the step's number), then ``sync`` at three
    quarters of it -- what makes the watchdogs beat promptly, as a real job's do."""

    def __init__(self, dogs: list[Any], step_s: float) -> None:
        self.dogs, self.step_s, self.step = dogs, step_s, 0
        self.frozen = threading.Event()  # a collective has failed: nobody moves any more
        threading.Thread(target=self._run, name="sim-steps", daemon=True).start()

    def _run(self) -> None:
        while not self.frozen.is_set():
            self.step += 1
            for dog in self.dogs:
                dog.set_phase("forward_backward", self.step)
            time.sleep(0.75 * self.step_s)
            for dog in self.dogs:
                dog.set_phase("sync")
            time.sleep(0.25 * self.step_s)


class Starved:
    """What the harness did to its ranks, per piece: how late this process's threads ran
    (a ticker that sleeps 50 ms, its lateness: the cores and the interpreter's lock that the
    ranks of one process share) and the longest gap between two beats of each live rank
    (``Watchdog._beat`` timed: a gap over the diagnosis's 3 s makes a live rank look
    stopped). A real rank has a process and a core of its own."""

    def __init__(self) -> None:
        self.late: list[tuple[float, float]] = []  # (time, lateness s)
        self.beats: dict[int, list[float]] = {}  # rank -> its beats' times (time.time())
        from dtrain.fault.watchdog import Watchdog

        beat, beats = Watchdog._beat, self.beats

        def timed(dog: Any, seconds: float | None = None) -> None:
            beat(dog, seconds)
            beats.setdefault(dog.rank, []).append(time.time())

        Watchdog._beat = timed  # type: ignore[method-assign]
        threading.Thread(target=self._tick, name="sim-ticker", daemon=True).start()

    def _tick(self) -> None:
        while True:
            started = time.monotonic()
            time.sleep(0.05)
            self.late.append((time.time(), time.monotonic() - started - 0.05))

    def during(self, start: float, end: float) -> dict[str, float]:
        """Within [start, end]: the ticker's lateness p99 and max, and the longest gap
        between beats of any rank that beat in it (from its last beat before)."""
        late = sorted(x for t, x in self.late if start <= t <= end) or [0.0]
        gap = 0.0
        for times in list(self.beats.values()):
            inside = [t for t in times if t <= end]
            if inside and inside[-1] >= start:
                marks = [t for t in inside if t >= start]
                before = [t for t in inside if t < start][-1:]
                seq = before + marks + [end]
                gap = max(gap, max(b - a for a, b in itertools.pairwise(seq)))
        p99 = late[min(len(late) - 1, len(late) * 99 // 100)]
        return {"late_p99": p99, "late_max": late[-1], "beat_gap": gap}


def sample(series: list[list[float]]) -> None:
    """The tally over time, every 0.1 s: [time, link calls, store operations]."""
    while True:
        series.append([time.time(), float(TALLY["calls"]), float(TALLY["ops"])])
        time.sleep(0.1)


def on_threads(items: list[Any], fn: Callable[[Any], Any], calls: list[int]) -> list[Any]:
    """``fn(item)`` for every item at once, one thread each (every rank acts at once);
    ``calls`` gets this process's link calls and store operations meanwhile."""
    out: list[Any] = [None] * len(items)
    before = (TALLY["calls"], TALLY["ops"])

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except Exception as exc:
            out[i] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(items))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    calls += [TALLY["calls"] - before[0], TALLY["ops"] - before[1]]
    return out


def made(items: list[Any], make: Callable[[Any], Any]) -> list[Any]:
    """``make(item)`` for every item, 64 at a time: each opens connections to the store, and
    some of torch's take seconds (made one by one, a thousand would take minutes)."""
    with ThreadPoolExecutor(64) as pool:
        return list(pool.map(make, items))


def watchdogs(ranks: list[int], world: int, args: argparse.Namespace) -> list[Any]:
    from dtrain.fault.watchdog import Watchdog

    # Staggered starts (--stagger-s a process, in order): a real job's ranks start over
    # seconds; thousands connecting and beating at once on 2 cores left a first beat unanswered
    # past its 3 s bound at W = 4,096.
    time.sleep(args.index * args.stagger_s)
    dogs = made(
        ranks, lambda r: Watchdog(r, world, heartbeat_s=args.heartbeat_s, timeout_s=args.timeout_s)
    )
    for dog in dogs:  # rank 0 first where it is here: the others wait for its first beat
        dog.start()
    return dogs


def restart(ctl: Control, ranks: list[int], args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Restart mode: watchdogs beating, then resume verification's words, then a diagnosis by
    every rank once the driver has killed the victim's process."""
    from dtrain.fault.peer_words import PeerWords

    global STARVED
    STARVED = Starved()
    dogs = watchdogs(ranks, args.world, args)
    ctl.add("ready", len(dogs))
    ctl.until("steady")
    steps = Steps(dogs, args.step_s)
    if ctl.until("words") == "go":
        expected = [str(r) for r in range(args.world)]

        def gather(dog: Any) -> dict[str, Any]:
            words = PeerWords(dog).gather("sim", str(dog.rank), "the simulation's words")
            return {"end": time.time(), "right": words == expected}

        began = time.time()
        out["words"] = on_threads(dogs, gather, out.setdefault("words_calls", []))
        out["words_starved"] = STARVED.during(began, time.time())
        ctl.add("words_right", sum(1 for x in out["words"] if x.get("right")))
        ctl.add("words_done", len(dogs))
    if ctl.until("kill") != "skip":
        steps.frozen.set()  # the survivors sit in the failed collective

        def diagnose(dog: Any) -> dict[str, Any]:
            words = dog.diagnosis(True)[0]
            named = sorted({int(m.group(1)) for m in FATE.finditer(words)})
            right = named == [args.world - 1]
            return {"end": time.time(), "right": right, "words": words[:300]}

        began = time.time()
        out["diagnosis"] = on_threads(dogs, diagnose, out.setdefault("diagnosis_calls", []))
        out["diagnosis_starved"] = STARVED.during(began, time.time())
        ctl.add("diagnosis_right", sum(1 for x in out["diagnosis"] if x.get("right")))
        ctl.add("diagnosis_done", len(dogs))


def inplace(ctl: Control, ids: list[int], args: argparse.Namespace, out: dict[str, Any]) -> None:
    """In-place mode: members wait for the first generation (the victim's process registers
    late: the others wait meanwhile), train in it with their watchdogs looking at the
    membership, then the victim's process is killed and the others regroup."""
    from dtrain.recovery.membership import Member

    address = f"127.0.0.1:{args.port}"
    if args.victim:
        ctl.until("late")
    per = args.per_machine or args.world

    def member(m: int) -> Any:
        local = (m % per, per)  # its place among its machine's members
        return Member(address, m, args.world, args.timeout_s, local=local, patience_s=120.0)

    members = made(ids, member)
    if not args.victim:
        ctl.add("ready", len(members))
        ctl.until("ask")

    def first(member: Any) -> Any:
        member.ask(-1, 0)
        return member.wait(-1)

    out["first_calls"] = []
    generations = on_threads(members, first, out["first_calls"])
    out["first"] = [time.time()]
    ctl.add("gen0_right", sum(1 for g in generations if getattr(g, "world_size", 0) == args.world))
    ctl.add("gen0", len(members))
    if not all(hasattr(g, "members") for g in generations):
        out["error"] = [str(g) for g in generations if not hasattr(g, "members")][:3]
        return
    generation = generations[0]
    dogs = watchdogs([generation.rank_of(m.id) for m in members], generation.world_size, args)
    for dog, member in zip(dogs, members, strict=True):
        dog.on_wake(member.look)
    ctl.add("ready2", len(dogs))
    ctl.until("steady2")
    steps = Steps(dogs, args.step_s)
    if ctl.until("kill") != "skip":
        steps.frozen.set()

        def regroup(pair: tuple[Any, Any]) -> dict[str, Any]:
            member, dog = pair
            # As a worker does: its trainer's loop ends on the failed collective and stops its
            # watchdog (and the looks at the membership on its thread) before it asks.
            dog.stop()
            member.ask(generation.number, steps.step)
            found = member.wait(generation.number)
            size = found.world_size if found else 0
            return {"end": time.time(), "right": size == args.world - 1}

        pairs = list(zip(members, dogs, strict=True))
        out["regroup"] = on_threads(pairs, regroup, out.setdefault("regroup_calls", []))
        right = sum(1 for x in out["regroup"] if x.get("right"))
        ctl.add("regroup_right", right)
        ctl.add("regroup_done", len(members))


def serve(args: argparse.Namespace) -> None:
    from dtrain.dist.stores import host_store
    from dtrain.recovery.coordinator import Coordinator
    from dtrain.recovery.membership import STALE_S

    store = host_store("127.0.0.1", 0, args.timeout_s)
    print(json.dumps({"port": store.port, "pid": os.getpid()}), flush=True)
    polls: list[tuple[float, float]] = []
    coordinator = None
    if args.world:  # in-place: the launcher's coordinator, as launch/launcher.py makes it
        per = args.per_machine or args.world
        coordinator = Coordinator(
            Counted(store),
            args.world,
            stale_s=STALE_S,
            hang_s=args.timeout_s + 5.0,
            local=range(min(per, args.world)),
            per_node=per,
        )
        poll = coordinator.poll

        def timed() -> None:
            started = time.perf_counter()
            poll()
            polls.append((time.time(), time.perf_counter() - started))

        coordinator.poll = timed  # type: ignore[method-assign]
        coordinator.start()
    sys.stdin.read()  # until the driver closes it
    if coordinator is not None:
        coordinator.stop()
    print(json.dumps({"polls": polls, "ops": TALLY["ops"]}), flush=True)
    os._exit(0)


def launchers(args: argparse.Namespace) -> None:
    """The launchers of machines 1 .. (the coordinator's is 0), each a NodeWatcher on a link
    of its own, as ``launch/launcher.py`` starts it. The watcher of the victim's machine polls
    on its own thread every ``POLL_S``, as a real one; the others, whose members never end,
    take turns on one thread every ``--watch-s``: what they send the store is paced by time,
    not by their polls (a counter every ``BUMP_S``, their members' records twice a second),
    and a hundred threads each reading /proc every 10 ms would take this machine's cores
    from the ranks. Ends when the driver closes its stdin."""
    from dtrain.dist.store_link import StoreLink
    from dtrain.recovery.coordinator import NodeWatcher

    per = args.per_machine
    nodes = range(1, -(-args.world // per))
    victim_node = (args.world - 1) // per
    watchers = []
    for node in nodes:
        link = StoreLink("127.0.0.1", args.port, 5.0, 120.0)
        members = range(node * per, min(args.world, (node + 1) * per))
        watchers.append(NodeWatcher(link, members, node))
    print(json.dumps({"launchers": len(watchers)}), flush=True)
    quiet = [w for w in watchers if w.node != victim_node]
    for watcher in watchers:
        if watcher.node == victim_node:
            watcher.start()

    def take_turns() -> None:
        while True:
            started = time.monotonic()
            for watcher in quiet:
                try:
                    watcher.poll()
                except Exception as exc:
                    watcher.failed(exc)
            time.sleep(max(0.0, args.watch_s - (time.monotonic() - started)))

    threading.Thread(target=take_turns, name="sim-launchers", daemon=True).start()
    sys.stdin.read()  # until the driver closes it
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=("serve", "launchers", "restart", "inplace"))
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--world", type=int, default=0)
    parser.add_argument("--ranks", default="0:0", help="first:stop, this process's ranks")
    parser.add_argument("--index", type=int, default=0, help="this process's machine")
    parser.add_argument("--victim", action="store_true")
    parser.add_argument("--stagger-s", type=float, default=0.0, help="start delay per --index")
    parser.add_argument("--heartbeat-s", type=float, default=1.0)
    parser.add_argument("--timeout-s", type=float, default=300.0)
    parser.add_argument("--step-s", type=float, default=0.15)
    parser.add_argument("--per-machine", type=int, default=0, help="members a machine (0: all)")
    parser.add_argument("--watch-s", type=float, default=0.1, help="the quiet launchers' pace")
    args = parser.parse_args()
    if args.role == "serve":
        serve(args)
        return
    if args.role == "launchers":
        launchers(args)
        return
    hostname = f"sim-{args.index}"
    socket.gethostname = lambda: hostname  # each process one machine, to the diagnosis
    ctl = Control(args.port)
    count_store_calls()
    series: list[list[float]] = []
    threading.Thread(target=sample, args=(series,), daemon=True).start()
    first, stop = (int(x) for x in args.ranks.split(":"))
    ranks = list(range(first, stop))
    out: dict[str, Any] = {}

    def report() -> None:
        print(
            "SIM "
            + json.dumps({**out, "series": series, "tally": dict(TALLY), "ranks": len(ranks)})
        )
        sys.stdout.flush()
        os._exit(0)  # thousands of daemon threads: no orderly shutdown to wait for

    def on_request() -> None:  # a piece that did not finish: what this process has, now
        Control(args.port).until("dump")
        report()

    threading.Thread(target=on_request, daemon=True).start()
    (restart if args.role == "restart" else inplace)(ctl, ranks, args, out)
    report()  # thousands of daemon threads: no orderly shutdown to wait for


if __name__ == "__main__":
    main()
