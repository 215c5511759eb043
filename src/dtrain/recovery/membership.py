"""Membership generations for ``fault.recovery = 'inplace'``: who trains together, numbered.

The launcher hosts a key-value store (a TCPStore) that outlives every worker and runs the
:class:`~dtrain.recovery.coordinator.Coordinator` beside it; each worker is a :class:`Member`
with a fixed id (0 .. N-1) that a restart of it keeps. A generation is a numbered, sorted list
of member ids; a member's rank in it is its place in the list. Every generation builds its own
process group on the store under ``inplace/gen<g>/`` (:mod:`dtrain.recovery.inplace`).

Keys (all under ``inplace/``)::

    member/<id>/info   {"pid", "host", "nonce"}: this incarnation of the member (a restart
                       posts a new nonce: the old incarnation is then gone)
    member/<id>/want   {"after", "nonce", "step"}: the member asks for a generation after
                       ``after`` (-1: it never belonged to one)
    member/<id>/state  {"nonce", "down"}: posted by the launcher of the member's machine
                       (not the coordinator's) when its process ends or stops, or runs again
    member/<id>/gen    {"gen", "nonce"}: written by the coordinator with each generation that
                       holds the member: the incarnation (nonce) of it that generation holds
    nodes              {"nnodes", "nproc"}: the job's shape, for the other machines' launchers
    gen/latest         the newest generation's number
    gen/<g>            {"spans", "left", "joined", "asked_at", "stop"}: the members as runs
                       of consecutive ids ([first, last] each)
    pending            g: a worker waits to join; generation g regroups after its next step
    done               the run completed: a worker still waiting to join exits
    stopped            why the job stops (fewer members than fault.min_replicas): a worker
                       waiting to join exits
    cut                {"gen", "members"}: the members of machines fallen silent in ``gen``
    node/<k>/launcher  the launcher that holds --node-rank k (:mod:`dtrain.recovery.node_claim`)
    node/<k>/alive     a counter that launcher adds to while it lives: the voice of machine k
    changes            what was posted since the coordinator last read it: ``<id>/<part>`` a
                       line, appended after each post of ``member/<id>/<part>``
    news               a counter the coordinator (and a member saying ``done``) adds to after
                       writing a generation, ``stopped`` or ``done``; ``news/<n>`` is set
                       right after: a waiting member blocks on the next one (``wait``)

A generation names incarnations, not only ids: a member restarted after the coordinator formed
generation g from its old incarnation must not join g (its peers would take it for the old one,
whose state it lacks). Each member finds its own incarnation in ``member/<id>/gen``, sealed under
that key and naming its generation, rather than every member's nonce in ``gen/<g>``: a member
then reads O(1) bytes of a regroup (the runs of ids, and who left and joined), not O(W) (at
4,096 members every member read 59 kB of nonces and ids: 243 MB through the store per regroup).

Every value but the counters and the change log is sealed with the job's secret under its full key
(:mod:`dtrain.dist.sealed_store`): one that fails (a stranger's, who reached the store's
port) is ignored, with one warning naming its key -- read as absent, or, by the coordinator,
a member and a launcher's watcher, as the last value of the job's they read there.

The coordinator forms generation g+1 once every member of g has asked for a new one or is
gone, and admits a joining member at the next step boundary (the members of g learn of it
from ``pending`` and agree on the step in its gradient sync). A member is gone when its
process has ended or is stopped (the coordinator reads /proc for the workers on its machine;
the launcher of every other machine reads /proc for its own and posts ``member/<id>/state``),
when its machine's launcher falls silent for ``stale_s`` (the machine is cut off: nothing it
posts arrives), or when it has not asked within ``hang_s`` of the first member that did (it is
stuck, and will come back as a joiner). A member itself does not beat: where a rank is, and
that it lives, is its liveness record (:mod:`dtrain.fault.liveness`), and what it hears of the
coordinator (``pending``, ``cut``) it reads on its watchdog's thread (:meth:`Member.look`).
Across machines, a member's and a launcher's store calls ride through an outage of the network
(:mod:`dtrain.dist.store_link`).

Nobody polls the whole membership: a member waiting for a generation blocks on the store until
the coordinator announces one (``news``), and the coordinator reads what was posted since its
last look (``changes``) plus a bounded slice of every member's keys (what a stranger, or a
poster killed between its two calls, wrote unannounced), so the calls of both do not grow with
the number of members (docs/fault-tolerance.md).

A regroup that would leave fewer than ``min_members`` (``fault.min_replicas``) forms one last
generation with a ``stop`` reason: its members heal, save a checkpoint and end; the
coordinator forms no generation after it.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dtrain.dist import sealed_store
from dtrain.dist.reachability import NODE_ADDR_ENV
from dtrain.dist.sealed_store import Opener, Shape
from dtrain.dist.store_link import StoreLink

PREFIX = "inplace/"
POLL_S = 0.01  # how often the coordinator looks at the store (and a waiting member at give_up)
# How long one blocking wait for news lasts before the member looks again (a news key a
# stranger's add skipped is missed for at most this long); well within a store call's bound.
WAIT_S = 2.0
CHANGES = "changes"
NEWS = "news"
# How long a machine's launcher may fall silent before its members count as gone (a stopped
# or ended process is seen at once through /proc, on any machine; this tells that a machine is
# cut off).
STALE_S = 3.0

# What the launcher tells each worker (the plumbing of torchrun's RANK, not configuration).
COORDINATOR_ENV = "DTRAIN_INPLACE_COORDINATOR"  # host:port of the store
MEMBER_ENV = "DTRAIN_INPLACE_MEMBER"  # this worker's member id
MEMBERS_ENV = "DTRAIN_INPLACE_MEMBERS"  # how many members the job has
LOCAL_ENV = "DTRAIN_INPLACE_LOCAL"  # "INDEX/COUNT": this worker's place among its machine's
PATIENCE_ENV = "DTRAIN_INPLACE_PATIENCE_S"  # how long the store may be out of reach


@dataclass(frozen=True)
class Generation:
    number: int
    members: tuple[int, ...]  # member ids; a member's rank is its index
    left: tuple[int, ...]  # members of the generation before that are not in this one
    joined: tuple[int, ...]  # members that were not in the generation before
    asked_at: float  # wall-clock time the first member asked for it (0: the first generation)
    stop: str = ""  # why the job stops after this generation saved (below fault.min_replicas)

    @property
    def world_size(self) -> int:
        return len(self.members)

    def rank_of(self, member: int) -> int:
        return self.members.index(member)


def store_call_s(timeout_s: float) -> float:
    """The bound of one membership store call: its values are a few bytes, so seconds only
    pass when the store cannot be reached."""
    return min(timeout_s, 5.0)


# The records' shapes (what their readers use of them): a value of another shape is ignored.
INFO: Shape = {"pid": int, "nonce": str}  # and "host", "addr" (str)
WANT: Shape = {"after": int, "nonce": str, "step": int}
STATE: Shape = {"nonce": str, "down": bool}
GENERATION: Shape = {
    "spans": [[int]],
    "left": [int],
    "joined": [int],
    "asked_at": float,
    "stop": str,
}
PROOF: Shape = {"gen": int, "nonce": str}
CUT: Shape = {"gen": int, "members": [int]}
NODES: Shape = {"nnodes": int, "nproc": int}


def read_text(store: Any, key: str, opener: Opener | None = None) -> str | None:
    """The text at ``inplace/<key>``; None while it is not set, or when it fails its seal
    (with ``opener``, a key read over and over: the last text that opened there)."""
    return (opener or sealed_store).read_text(store, PREFIX + key)


def read_json(store: Any, key: str, shape: Shape, opener: Opener | None = None) -> Any:
    """The JSON value at ``inplace/<key>`` if it has ``shape``; None while it is not set, or
    when it fails its seal or has another shape (with ``opener``: as :func:`read_text`)."""
    return (opener or sealed_store).read_json(store, PREFIX + key, shape)


def write_value(store: Any, key: str, value: Any) -> None:
    """``inplace/<key>`` = value (a string as it is, anything else as JSON), sealed."""
    sealed_store.put(store, PREFIX + key, value if isinstance(value, str) else json.dumps(value))


def write_values(store: Any, values: dict[str, Any]) -> None:
    """``inplace/<key>`` = value for each (as :func:`write_value`), sealed, in one call: a
    reader finds all of them or none."""
    sealed_store.put_many(
        store, {PREFIX + k: v if isinstance(v, str) else json.dumps(v) for k, v in values.items()}
    )


def proof(gen: int, nonce: str) -> str:
    """``member/<id>/gen``'s value: generation ``gen`` holds the incarnation ``nonce``."""
    return json.dumps({"gen": gen, "nonce": nonce})


def spans_of(members: Iterable[int]) -> list[list[int]]:
    """Sorted member ids as runs of consecutive ids, ``[first, last]`` each."""
    spans: list[list[int]] = []
    for m in members:
        if spans and spans[-1][1] == m - 1:
            spans[-1][1] = m
        else:
            spans.append([m, m])
    return spans


def members_in(spans: list[list[int]]) -> tuple[int, ...]:
    """The member ids of :func:`spans_of`'s runs."""
    return tuple(m for first, last in spans for m in range(first, last + 1))


def post(store: Any, member: int, part: str, value: Any) -> None:
    """``member/<member>/<part>`` = value, then its name appended to ``changes``: the
    coordinator reads it at its next poll without reading every member's keys."""
    write_value(store, f"member/{member}/{part}", value)
    store.append(PREFIX + CHANGES, f"{member}/{part}\n".encode())


def announce(store: Any) -> None:
    """Wake the members waiting for news (after a generation, ``stopped`` or ``done`` is
    written): the counter first, then the key of its new value, which they wait on."""
    number = int(store.add(PREFIX + NEWS, 1))
    write_value(store, f"{NEWS}/{number}", "")


def _say_done(store: Any) -> None:
    write_value(store, "done", "1")
    announce(store)


def news_count(store: Any) -> int:
    """How many times news was announced (a counter: 0 before the first)."""
    return int(store.add(PREFIX + NEWS, 0))


def wait_for(store: Any, key: str, seconds: float) -> bool:
    """Whether ``inplace/<key>`` was set within ``seconds`` (one blocking call to the store).
    torch logs a timed-out wait at WARNING: the workers run at TORCH_CPP_LOG_LEVEL=ERROR."""
    import torch.distributed as dist

    try:
        store.wait([PREFIX + key], datetime.timedelta(seconds=seconds))
    except dist.DistStoreError:  # timed out (a lost connection is a DistNetworkError)
        return False
    return True


# -- the worker's side ------------------------------------------------------------------------


class Member:
    """This worker in the membership, registered on construction. ``local``: this worker's
    index among its machine's and their count; ``patience_s``: how long its store calls retry
    while the store cannot be reached (a machine cut off from the coordinator's) before they
    raise."""

    def __init__(
        self,
        address: str,
        member_id: int,
        members: int,
        timeout_s: float,
        *,
        local: tuple[int, int] | None = None,
        patience_s: float = 900.0,
    ) -> None:
        host, port = address.rsplit(":", 1)
        self.address = (host, port)
        self.id = member_id
        self.members = members
        self.local = local if local is not None else (member_id, members)
        self.nonce = f"{os.getpid()}-{time.time_ns()}"
        call_s = store_call_s(timeout_s)
        # What this member reads: a value a stranger wrote over one of the job's is ignored.
        self._opener = Opener()
        self.link = StoreLink(host, int(port), call_s, patience_s)
        # The looks' own connection, without patience: they run on the watchdog's thread
        # beside the training thread's calls, and one that fails is simply made again later.
        self._look_link = StoreLink(host, int(port), call_s, 0.0, connect_s=patience_s)
        # A blocking wait for news given up on (give_up): its call still holds the link, so
        # the next call waits for it to end (within WAIT_S) instead of sharing the connection.
        self._waiting: threading.Thread | None = None
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "nonce": self.nonce,
            "addr": os.environ.get(NODE_ADDR_ENV, ""),  # this machine's, across machines
        }
        self._call(lambda s: post(s, member_id, "info", info), "registering")
        self.pending = -1  # the generation that must regroup for a joiner, as last seen
        # Called by :meth:`look` with (generation, the members cut off, every member's machine
        # address) when the coordinator finds every worker of some machines silent in that
        # generation (cut off; this member's own machine, heard of once its link is back).
        self.on_cut: Callable[[int, list[int], dict[int, str]], None] | None = None
        self._cut_seen: dict[str, Any] | None = None
        self._warned = False

    @property
    def store(self) -> Any:
        """A connected client of the store (a process group's rendezvous is built on it)."""
        return self.link.client

    def _call(self, op: Any, what: str, seconds: float | None = None) -> Any:
        if self._waiting is not None:
            self._waiting.join()
            self._waiting = None
        return self.link.call(op, what, seconds)

    def look(self) -> None:
        """Read what the coordinator tells the members: a worker waits to join (``pending``),
        machines fell silent (``cut``: :attr:`on_cut` is told). Called on the watchdog's
        thread while a generation trains (the training thread makes no store call for it).
        Never raises: a store out of reach is read again at the next look."""
        opener = self._opener

        def news(store: Any) -> tuple[int | None, dict[str, Any] | None]:
            return read_json(store, "pending", int, opener), read_json(store, "cut", CUT, opener)

        try:
            pending, cut = self._look_link.call(news, "a look at the membership")
        except Exception:  # out of reach now; a collective that waits on it will tell
            return
        self.pending = pending if pending is not None else -1
        if cut is None or cut == self._cut_seen:
            return
        try:
            self._cut_off(cut)
            self._cut_seen = cut
        except Exception:  # heard again at the next look; our bug: said once
            if not self._warned:
                self._warned = True
                traceback.print_exc()

    def _cut_off(self, cut: dict[str, Any]) -> None:
        if self.on_cut is None:
            return
        everyone = range(self.members)
        infos = self._look_link.call(
            lambda s: [read_json(s, f"member/{m}/info", INFO, self._opener) for m in everyone],
            "reading members",
        )
        addresses = {
            m: info["addr"]
            for m, info in zip(everyone, infos, strict=True)
            if info is not None and isinstance(info.get("addr"), str) and info["addr"]
        }
        self.on_cut(int(cut["gen"]), [int(m) for m in cut["members"]], addresses)

    def ask(self, after: int, step: int) -> None:
        """Ask for a generation after ``after`` (-1: none yet); ``step``: this member's."""
        want = {"after": after, "nonce": self.nonce, "step": step}
        self._call(lambda s: post(s, self.id, "want", want), "asking")

    def wait(self, after: int, give_up: Callable[[], object] | None = None) -> Generation | None:
        """Wait until a generation after ``after`` that holds this member is formed; None when
        the run completed or stopped (:meth:`stopped`) meanwhile, or once ``give_up()`` is
        true (a preemption signal before there is anything to save: looked at every
        ``POLL_S``). Blocks on the store between announcements (``news``): two calls every
        ``WAIT_S`` while nothing happens (it made about 400 a second, polling)."""
        seen = -1
        while True:
            # The count before the look: whatever is announced after it sets news/<count+1>.
            count = self._call(news_count, "waiting for a generation")
            if count != seen:
                found = self._call(lambda s: self._look(s, after), "waiting for a generation")
                if found != "wait":
                    return found
                seen = count
            if give_up is not None and give_up():
                return None
            if self._await(f"{NEWS}/{count + 1}", give_up):
                return None

    def _await(self, key: str, give_up: Callable[[], object] | None) -> bool:
        """Until ``inplace/<key>`` is set or ``WAIT_S`` has passed; True once ``give_up()``
        is (the wait left running)."""
        wait = functools.partial(wait_for, key=key, seconds=WAIT_S)
        seconds = WAIT_S + self.link.call_s
        if give_up is None:
            self._call(wait, "waiting for news", seconds)
            return False
        # The blocking call on a thread of its own, so that give_up is answered as promptly
        # as when the member polled; it makes no store call.
        failed: list[BaseException] = []

        def run() -> None:
            try:
                self.link.call(wait, "waiting for news", seconds)
            except BaseException as exc:  # handed to the caller
                failed.append(exc)

        thread = threading.Thread(target=run, name="dtrain-member-wait", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(POLL_S)
            if thread.is_alive() and give_up():
                # Wake the blocked call (news for every waiting member: one look each) and let
                # it end: a process ending with a store call in flight on a thread aborts.
                # The store out of reach: so is the call, bounded by the link.
                with contextlib.suppress(Exception):
                    self._look_link.call(announce, "ending a wait")
                thread.join(self.link.call_s)
                self._waiting = thread if thread.is_alive() else None
                return True
        if failed:
            raise failed[0]
        return False

    def _look(self, store: Any, after: int) -> Generation | str | None:
        opener = self._opener
        if read_text(store, "done", opener) is not None:
            return None
        # Read before the generation: the coordinator writes the last generation before
        # "stopped", so a member of that generation finds it below (and saves).
        stopped = read_text(store, "stopped", opener) or ""
        latest = read_json(store, "gen/latest", int, opener)
        if latest is not None and latest > after:
            record = read_json(store, f"gen/{latest}", GENERATION, opener)
            members = members_in(record["spans"]) if record is not None else ()
            # This incarnation is the generation's: its proof names both (one written for a
            # later generation means another formed meanwhile: its news wakes this wait).
            proof = read_json(store, f"member/{self.id}/gen", PROOF, opener) if members else None
            if (
                self.id in members
                and proof is not None
                and (proof["gen"], proof["nonce"]) == (latest, self.nonce)
            ):
                return Generation(
                    latest,
                    members,
                    tuple(record["left"]),
                    tuple(record["joined"]),
                    float(record["asked_at"]),
                    record["stop"],
                )
        return None if stopped else "wait"

    def stopped(self) -> str:
        """Why the job stops (below ``fault.min_replicas``), or "" while it goes on."""
        read = functools.partial(read_text, key="stopped", opener=self._opener)
        return self._call(read, "reading the job's state") or ""

    def pids(self, members: Iterable[int]) -> list[int]:
        """The processes of ``members`` on this machine as registered now (one not registered,
        or on another machine: left out)."""
        wanted = [m for m in members if self._node(m) == self._node()]
        infos = self._call(
            lambda s: [read_json(s, f"member/{m}/info", INFO, self._opener) for m in wanted],
            "reading members",
        )
        return [int(info["pid"]) for info in infos if info is not None]

    def _node(self, member: int | None = None) -> int:
        """The machine of ``member`` (default: this one): members are numbered machine by
        machine, ``local[1]`` per machine."""
        return (self.id if member is None else member) // self.local[1]

    def finish(self) -> None:
        """The run completed: members still waiting to join need not."""
        with contextlib.suppress(Exception):
            self._call(_say_done, "saying the run completed")

    def close(self) -> None:
        """Stop telling :attr:`on_cut` (the last generation's) of machines cut off."""
        self.on_cut = None
