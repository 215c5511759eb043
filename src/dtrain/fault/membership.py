"""Membership generations for ``fault.recovery = 'inplace'``: who trains together, numbered.

The launcher hosts a key-value store (a TCPStore) that outlives every worker and runs the
:class:`Coordinator` beside it; each worker is a :class:`Member` with a fixed id (0 .. N-1)
that a restart of it keeps. A generation is a numbered, sorted list of member ids; a member's
rank in it is its place in the list. Every generation builds its own process group on the
store under ``inplace/gen<g>/`` (:mod:`dtrain.fault.inplace`).

Keys (all under ``inplace/``)::

    member/<id>/info   {"pid", "host", "nonce"}: this incarnation of the member (a restart
                       posts a new nonce: the old incarnation is then gone)
    member/<id>/beat   a counter the member's heartbeat thread adds to every BEAT_S
    member/<id>/want   {"after", "nonce", "step"}: the member asks for a generation after
                       ``after`` (-1: it never belonged to one)
    member/<id>/state  {"nonce", "down"}: posted by the launcher of the member's machine
                       (not the coordinator's) when its process ends or stops, or runs again
    nodes              {"nnodes", "nproc"}: the job's shape, for the other machines' launchers
    gen/latest         the newest generation's number
    gen/<g>            {"members", "nonces", "left", "joined", "asked_at"}
    pending            g: a worker waits to join; generation g regroups after its next step
    done               the run completed: a worker still waiting to join exits
    stopped            why the job stops (fewer members than fault.min_replicas): a worker
                       waiting to join exits

The coordinator forms generation g+1 once every member of g has asked for a new one or is
gone, and admits a joining member at the next step boundary (the members of g learn of it
from ``pending`` and agree on the step in its gradient sync). A member is gone when its
process has ended or is stopped (the coordinator reads /proc for the workers on its machine;
the launcher of every other machine reads /proc for its own and posts ``member/<id>/state``),
when its beats stop for ``stale_s`` (a machine cut off: nothing it posts arrives), or when it
has not asked within ``hang_s`` of the first member that did (it is stuck, and will come back
as a joiner). Across machines, a member's and a launcher's store calls ride through an outage
of the network (:mod:`dtrain.fault.coordinator_link`).

A regroup that would leave fewer than ``min_members`` (``fault.min_replicas``) forms one last
generation with a ``stop`` reason: its members heal, save a checkpoint and end; the
coordinator forms no generation after it.
"""

from __future__ import annotations

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

import torch.distributed as dist

from dtrain.fault.coordinator_link import StoreLink, StoreUnreachable
from dtrain.reachability import NODE_ADDR_ENV

PREFIX = "inplace/"
BEAT_S = 0.1  # a member's heartbeat period
POLL_S = 0.01  # how often the coordinator and a waiting member look at the store
# How long the beats of a member may stop before it counts as gone (a stopped or hung
# process is seen at once through /proc, on any machine; this is the backstop, and what tells
# that a machine is cut off).
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


def open_store(host: str, port: int, timeout_s: float, *, is_master: bool = False) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        host,
        port,
        is_master=is_master,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def store_call_s(timeout_s: float) -> float:
    """The bound of one membership store call: its values are a few bytes, so seconds only
    pass when the store cannot be reached."""
    return min(timeout_s, 5.0)


def _get(store: Any, key: str) -> str | None:
    if not store.check([PREFIX + key]):
        return None
    return bytes(store.get(PREFIX + key)).decode()


def _get_json(store: Any, key: str) -> Any:
    text = _get(store, key)
    return None if text is None else json.loads(text)


def _post(store: Any, *, key: str, value: Any) -> None:
    _set(store, key, value)


def _set(store: Any, key: str, value: Any) -> None:
    store.set(PREFIX + key, value if isinstance(value, str) else json.dumps(value))


# -- the worker's side ------------------------------------------------------------------------


class Member:
    """This worker in the membership: registered on construction, beating on its own thread
    (with its own store connection) until :meth:`close`. ``local``: this worker's index among
    its machine's and their count; ``patience_s``: how long its store calls retry while the
    store cannot be reached (a machine cut off from the coordinator's) before they raise."""

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
        self.link = StoreLink(host, int(port), call_s, patience_s)
        self._beat_link = StoreLink(host, int(port), call_s, patience_s)
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "nonce": self.nonce,
            "addr": os.environ.get(NODE_ADDR_ENV, ""),  # this machine's, across machines
        }
        self._call(lambda s: _set(s, f"member/{member_id}/info", info), "registering")
        self.pending = -1  # the generation that must regroup for a joiner, as last seen
        # Called on the heartbeat thread with (generation, the members cut off, every member's
        # machine address) when the coordinator finds every worker of some machines silent in
        # that generation (cut off; this member's own machine, heard of once its link is back).
        self.on_cut: Callable[[int, list[int], dict[int, str]], None] | None = None
        self._cut_seen = ""
        self._warned = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="dtrain-membership", daemon=True)
        self._thread.start()

    @property
    def store(self) -> Any:
        """A connected client of the store (a process group's rendezvous is built on it)."""
        return self.link.client

    def _call(self, op: Any, what: str) -> Any:
        return self.link.call(op, what)

    def _beat(self) -> None:
        key = f"{PREFIX}member/{self.id}/beat"

        def beat(store: Any) -> tuple[str | None, str | None]:
            store.add(key, 1)
            return _get(store, "pending"), _get(store, "cut")

        while not self._stop.wait(BEAT_S):
            try:
                pending, cut = self._beat_link.call(beat, "a beat")
                self.pending = int(pending) if pending is not None else -1
                if cut is not None and cut != self._cut_seen:
                    self._cut_seen = cut
                    self._cut_off(json.loads(cut))
            except StoreUnreachable:  # for the whole patience: the wait says so
                return
            except Exception:  # our bug: the beats must go on (a cut only saves a timeout)
                if not self._warned:
                    self._warned = True
                    traceback.print_exc()

    def _cut_off(self, cut: dict[str, Any]) -> None:
        if self.on_cut is None:
            return
        everyone = range(self.members)
        infos = self._beat_link.call(
            lambda s: [_get_json(s, f"member/{m}/info") for m in everyone], "reading members"
        )
        addresses = {
            m: str(info["addr"])
            for m, info in zip(everyone, infos, strict=True)
            if info is not None and info.get("addr")
        }
        self.on_cut(int(cut["gen"]), [int(m) for m in cut["members"]], addresses)

    def ask(self, after: int, step: int) -> None:
        """Ask for a generation after ``after`` (-1: none yet); ``step``: this member's."""
        want = {"after": after, "nonce": self.nonce, "step": step}
        self._call(lambda s: _set(s, f"member/{self.id}/want", want), "asking")

    def wait(self, after: int) -> Generation | None:
        """Wait until a generation after ``after`` that holds this member is formed; None when
        the run completed or stopped (:meth:`stopped`) meanwhile."""
        while True:
            found = self._call(lambda s: self._look(s, after), "waiting for a generation")
            if found != "wait":
                return found
            time.sleep(POLL_S)

    def _look(self, store: Any, after: int) -> Generation | str | None:
        if _get(store, "done") is not None:
            return None
        # Read before the generation: the coordinator writes the last generation before
        # "stopped", so a member of that generation finds it below (and saves).
        stopped = _get(store, "stopped") or ""
        latest = _get(store, "gen/latest")
        if latest is not None and int(latest) > after:
            record = _get_json(store, f"gen/{latest}")
            members = [int(m) for m in record["members"]]
            if self.id in members and record["nonces"][members.index(self.id)] == self.nonce:
                return Generation(
                    int(latest),
                    tuple(members),
                    tuple(record["left"]),
                    tuple(record["joined"]),
                    float(record["asked_at"]),
                    str(record.get("stop", "")),
                )
        return None if stopped else "wait"

    def stopped(self) -> str:
        """Why the job stops (below ``fault.min_replicas``), or "" while it goes on."""
        return self._call(lambda s: _get(s, "stopped"), "reading the job's state") or ""

    def pids(self, members: Iterable[int]) -> list[int]:
        """The processes of ``members`` on this machine as registered now (one not registered,
        or on another machine: left out)."""
        wanted = [m for m in members if self._node(m) == self._node()]
        infos = self._call(
            lambda s: [_get_json(s, f"member/{m}/info") for m in wanted], "reading members"
        )
        return [int(info["pid"]) for info in infos if info is not None]

    def _node(self, member: int | None = None) -> int:
        """The machine of ``member`` (default: this one): members are numbered machine by
        machine, ``local[1]`` per machine."""
        return (self.id if member is None else member) // self.local[1]

    def finish(self) -> None:
        """The run completed: members still waiting to join need not."""
        try:
            self._call(lambda s: _set(s, "done", "1"), "saying the run completed")
        except Exception:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * BEAT_S + 1)


# -- the launcher's side ----------------------------------------------------------------------


def process_state(pid: int) -> str:
    """The one-letter state of a local process ("R", "S", "T" stopped, "Z" ended, ...); "X"
    when there is none."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


DOWN_STATES = ("X", "Z", "T", "t")  # no process, ended, stopped, stopped by a tracer


class PollingThread:
    """A daemon thread that calls :meth:`poll` every ``POLL_S`` until :meth:`stop`; an
    exception from it goes to :meth:`failed`, and the polling goes on (a job must not hang or
    end on one bad look at the store)."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._warned = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def poll(self) -> None:
        raise NotImplementedError

    def failed(self, exc: Exception) -> None:
        """Our bug: its traceback, once (the store closing with the launcher: nothing)."""
        if not self._stop.is_set() and not self._warned:
            self._warned = True
            traceback.print_exception(exc)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                self.poll()
            except Exception as exc:
                self.failed(exc)


class NodeWatcher(PollingThread):
    """In the launcher of a machine that does not host the coordinator: reads the states of
    its own workers in /proc and posts each change (``member/<id>/state``), so that the
    coordinator sees a worker killed or stopped on another machine as soon as one on its own.
    Its store calls wait out an outage of the network (:class:`StoreLink`, never giving up:
    the launcher must not end because its machine was cut off for a while)."""

    def __init__(self, link: StoreLink, members: Iterable[int]) -> None:
        self.link = link
        self.members = list(members)
        self._posted: dict[int, tuple[str, bool]] = {}
        self._pids: dict[int, tuple[str, int]] = {}  # member -> (nonce, pid)
        self._read_at = 0.0
        self.stopped = ""  # why the job stopped (below fault.min_replicas), once it did
        super().__init__("dtrain-node-watch")

    def failed(self, exc: Exception) -> None:
        if not isinstance(exc, StoreUnreachable):  # out of reach for the whole patience: on
            super().failed(exc)

    def poll(self) -> None:
        now = time.monotonic()
        # Who runs each member changes only when it restarts: its info is read twice a
        # second, ten times while the process known for one is down (its restart registers).
        down = {m: process_state(pid) in DOWN_STATES for m, (_, pid) in self._pids.items()}
        if now - self._read_at > (0.1 if any(down.values()) else 0.5):
            self._read_at = now
            infos, stopped = self.link.call(
                lambda s: (
                    [_get_json(s, f"member/{m}/info") for m in self.members],
                    _get(s, "stopped"),
                ),
                "reading this machine's members",
            )
            self.stopped = stopped or ""
            for m, info in zip(self.members, infos, strict=True):
                if info is not None:
                    self._pids[m] = (str(info["nonce"]), int(info["pid"]))
            down = {m: process_state(pid) in DOWN_STATES for m, (_, pid) in self._pids.items()}
        for m, (nonce, _) in self._pids.items():
            state = (nonce, down[m])
            if self._posted.get(m) != state:
                record = {"nonce": nonce, "down": down[m]}
                post = functools.partial(_post, key=f"member/{m}/state", value=record)
                self.link.call(post, "a state")
                self._posted[m] = state


@dataclass
class _Seen:
    nonce: str = ""
    pid: int = 0
    beats: int = -1
    beat_at: float = 0.0  # time.monotonic() when the beat counter last moved


class Coordinator(PollingThread):
    """Numbers the generations; runs on its own thread in the launcher, beside the store."""

    def __init__(
        self,
        store: Any,
        members: int,
        *,
        stale_s: float,
        hang_s: float,
        min_members: int = 1,
        local: Iterable[int] | None = None,
        per_node: int | None = None,
    ) -> None:
        """``local``: the members on this machine, whose processes it reads in /proc (default:
        all); the others' launchers post their states. ``per_node``: members per machine."""
        self.store = store
        self.members = members
        self.local = set(range(members) if local is None else local)
        self.per_node = per_node or members  # members are numbered machine by machine
        self._cut: dict[str, Any] = {}  # the silent machines' members last posted
        self.min_members = min_members
        self.stopped = ""  # why the job stops (below min_members), once it does
        self.stale_s = stale_s
        self.hang_s = hang_s
        self.number = -1
        self.current: tuple[int, ...] = ()
        self.nonces: dict[int, str] = {}  # of the current generation's members
        self.first_ask: float | None = None  # monotonic; of the regroup under way
        self.first_ask_wall = 0.0
        self.formed: list[Generation] = []
        self._seen = {m: _Seen() for m in range(members)}
        super().__init__("dtrain-coordinator")

    def _alive(self, member: int, now: float) -> bool:
        """Whether the member's newest incarnation is running: its process exists and is
        not stopped, and its beats moved within ``stale_s``."""
        seen = self._seen[member]
        info = _get_json(self.store, f"member/{member}/info")
        if info is None:
            return False
        if info["nonce"] != seen.nonce:
            seen.nonce, seen.pid = info["nonce"], int(info["pid"])
            seen.beats, seen.beat_at = -1, now
        beats = int(self.store.add(f"{PREFIX}member/{member}/beat", 0))
        if beats != seen.beats:
            seen.beats, seen.beat_at = beats, now
        if member in self.local:
            if process_state(seen.pid) in DOWN_STATES:
                return False
        else:
            state = _get_json(self.store, f"member/{member}/state")
            if state is not None and state["nonce"] == seen.nonce and state["down"]:
                return False
        return now - seen.beat_at < self.stale_s

    def _silent_machines(self, alive: set[int]) -> list[int]:
        """The members of the current generation on other machines whose every member of it
        has fallen silent (beats stale; not posted down by their launcher, which would mean
        their machine still answers): that machine is cut off, or gone."""
        nodes: dict[int, list[int]] = {}
        for m in self.current:
            if m not in self.local:
                nodes.setdefault(m // self.per_node, []).append(m)
        silent: list[int] = []
        for node_members in nodes.values():
            if all(m not in alive and self._seen[m].beats >= 0 for m in node_members):
                states = [_get_json(self.store, f"member/{m}/state") for m in node_members]
                if not any(st is not None and st["down"] for st in states):
                    silent += node_members
        return sorted(silent)

    def poll(self) -> None:
        if self.stopped:
            return  # the last generation is formed
        now = time.monotonic()
        alive = {m for m in range(self.members) if self._alive(m, now)}
        if self.current and self.local != set(range(self.members)):
            cut_off = self._silent_machines(alive)
            cut = {"gen": self.number, "members": cut_off}
            if cut_off and cut != self._cut:
                # The others shut down their connections to those machines (dtrain.fault.sever)
                # instead of waiting out the collective timeout.
                _set(self.store, "cut", cut)
                self._cut = cut
        wants = {m: _get_json(self.store, f"member/{m}/want") for m in alive}
        asking = {
            m
            for m, want in wants.items()
            if want is not None and want["nonce"] == self._seen[m].nonce
        }
        # Members of the current generation (this incarnation) that ask for the next one.
        regrouping = {
            m
            for m in asking
            if m in self.current
            and self.nonces.get(m) == wants[m]["nonce"]
            and int(wants[m]["after"]) == self.number
        }
        joiners = asking - regrouping - {m for m in self.current if self._same(m)}
        if not self.current:
            # The first generation (or one after every member was lost): everyone expected.
            if len(joiners) == self.members:
                self._form(sorted(joiners))
            return
        stayed = {m for m in self.current if m in alive and self._same(m)}
        gone = set(self.current) - stayed
        if not regrouping and not gone:
            if joiners:
                _set(self.store, "pending", str(self.number))
            return
        if self.first_ask is None:
            self.first_ask, self.first_ask_wall = now, time.time()
        silent = stayed - regrouping
        if silent and now - self.first_ask < self.hang_s:
            return  # a member still on its way to asking (its collective has not failed yet)
        survivors = sorted(regrouping | joiners)
        if 0 < len(survivors) < self.min_members:
            step = max(int(wants[m]["step"]) for m in survivors)
            lost = sorted(set(self.current) - set(survivors))
            self._form(survivors, stop=self._stop_reason(survivors, lost, step))
        elif survivors:
            self._form(survivors)
        else:
            self.current, self.nonces = (), {}

    def _stop_reason(self, survivors: list[int], lost: list[int], step: int) -> str:
        who = ", ".join(str(m) for m in lost)
        return (
            f"{len(survivors)} of {self.members} workers left at step {step} (member(s) {who} "
            f"lost), fewer than fault.min_replicas = {self.min_members}"
        )

    def _same(self, member: int) -> bool:
        """Whether the member's running incarnation is the one in the current generation."""
        return self.nonces.get(member) == self._seen[member].nonce

    def _form(self, members: list[int], stop: str = "") -> None:
        before = set(self.current)
        self.number += 1
        generation = Generation(
            self.number,
            tuple(members),
            # A member restarted meanwhile both left (its old incarnation) and joined.
            tuple(sorted(m for m in before if m not in members or not self._same(m))),
            tuple(sorted(m for m in members if m not in before or not self._same(m))),
            self.first_ask_wall if self.first_ask is not None else 0.0,
            stop,
        )
        self.nonces = {m: self._seen[m].nonce for m in members}
        self.current = tuple(members)
        self.first_ask = None
        record = {
            "members": list(members),
            "nonces": [self.nonces[m] for m in members],
            "left": list(generation.left),
            "joined": list(generation.joined),
            "asked_at": generation.asked_at,
            "stop": stop,
        }
        _set(self.store, f"gen/{self.number}", record)
        _set(self.store, "gen/latest", str(self.number))
        self.formed.append(generation)
        if stop:  # after the generation: a member of it must see the generation first
            self.stopped = stop
            _set(self.store, "stopped", stop)
