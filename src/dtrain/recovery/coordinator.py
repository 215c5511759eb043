"""The launcher's side of ``fault.recovery = 'inplace'``: the :class:`Coordinator` that forms
membership generations (on the machine of ``--node-rank 0``), and the :class:`NodeWatcher`
that every other machine's launcher runs to post its workers' states. The keys they read and
write, and the rules, are described in :mod:`dtrain.recovery.membership`, which holds the
worker's side."""

from __future__ import annotations

import functools
import itertools
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dtrain.dist.sealed_store import Opener
from dtrain.dist.store_link import StoreLink, StoreUnreachable
from dtrain.process_exit import process_state
from dtrain.recovery.changes import BATCH, Changes, member_key
from dtrain.recovery.forming import Forming
from dtrain.recovery.membership import (
    INFO,
    POLL_S,
    STATE,
    WANT,
    Generation,
    announce,
    post,
    read_json,
    read_text,
    write_value,
)
from dtrain.recovery.node_claim import BUMP_S, alive_key

NOTICE_S = 15.0  # the workers of machines started together ask to join well within this

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

    def interval(self) -> float:
        """How long to wait before the next poll."""
        return POLL_S

    def _run(self) -> None:
        while not self._stop.wait(self.interval()):
            try:
                self.poll()
            except Exception as exc:
                self.failed(exc)


class NodeWatcher(PollingThread):
    """In the launcher of a machine that does not host the coordinator: reads the states of
    its own workers in /proc and posts each change (``member/<id>/state``), so that the
    coordinator sees a worker killed or stopped on another machine as soon as one on its own.
    Its store calls wait out an outage of the network (:class:`StoreLink`, never giving up:
    the launcher must not end because its machine was cut off for a while). With ``node``,
    it also adds to that rank's liveness counter, which holds this launcher's claim on it
    (:mod:`dtrain.recovery.node_claim`)."""

    def __init__(
        self,
        link: StoreLink,
        members: Iterable[int],
        node: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``clock``: the monotonic time its paces count in (tests pass their own)."""
        self._clock = clock
        self.link = link
        self.members = list(members)
        self.node = node
        self._bumped_at = 0.0
        self._posted: dict[int, tuple[str, bool]] = {}
        self._pids: dict[int, tuple[str, int]] = {}  # member -> (nonce, pid)
        self._read_at = 0.0
        self.stopped = ""  # why the job stopped (below fault.min_replicas), once it did
        self.halted = ""  # why node 0 stopped the job at once (dtrain.recovery.halt), once it did
        self._opener = Opener()  # a stranger's value over one of the job's: ignored
        super().__init__("dtrain-node-watch")

    def failed(self, exc: Exception) -> None:
        if not isinstance(exc, StoreUnreachable):  # out of reach for the whole patience: on
            super().failed(exc)

    def poll(self) -> None:
        now = self._clock()
        if self.node is not None and now - self._bumped_at >= BUMP_S:
            self._bumped_at = now
            key = alive_key(self.node)
            self.link.call(lambda s: s.add(key, 1), "this launcher's liveness")
        # Who runs each member changes only when it restarts: its info is read twice a
        # second, ten times while the process known for one is down (its restart registers).
        down = {m: process_state(pid) in DOWN_STATES for m, (_, pid) in self._pids.items()}
        if now - self._read_at > (0.1 if any(down.values()) else 0.5):
            self._read_at = now
            opener = self._opener
            infos, stopped, halted = self.link.call(
                lambda s: (
                    [read_json(s, f"member/{m}/info", INFO, opener) for m in self.members],
                    read_text(s, "stopped", opener),
                    read_text(s, "halt", opener),
                ),
                "reading this machine's members",
            )
            self.stopped, self.halted = stopped or "", halted or ""
            for m, info in zip(self.members, infos, strict=True):
                if info is not None:
                    self._pids[m] = (str(info["nonce"]), int(info["pid"]))
            down = {m: process_state(pid) in DOWN_STATES for m, (_, pid) in self._pids.items()}
        for m, (nonce, _) in self._pids.items():
            state = (nonce, down[m])
            if self._posted.get(m) != state:
                record = {"nonce": nonce, "down": down[m]}
                posting = functools.partial(post, member=m, part="state", value=record)
                self.link.call(posting, "a state")
                self._posted[m] = state


@dataclass
class _Seen:
    nonce: str = ""
    pid: int = 0


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
        join_timeout_s: float = 0.0,
        on_wait: Callable[[list[int], bool], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        state_of: Callable[[int], str] = process_state,
    ) -> None:
        """``local``: the members on this machine, whose processes it reads in /proc (default:
        all); the others' launchers post their states. ``per_node``: members per machine.
        ``join_timeout_s``: how long the first generation waits for every machine's workers
        (0: for ever); ``on_wait(nodes, gave_up)`` is told, once after ``NOTICE_S`` (or half
        the timeout, if sooner) and once on giving up, which machines (node ranks) it still
        waits for. Given up, the job stops (``gave_up``, and ``stopped`` for the workers)
        before any step. ``clock``: the monotonic time ``stale_s``, ``hang_s`` and the join
        timeout count in; ``state_of``: a local process's state (:func:`process_state`); tests
        pass their own of both."""
        self._clock, self._state_of = clock, state_of
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
        # What a poll reads: every member's registration, wish for the next generation and,
        # on another machine, the state its launcher posts; and every other machine's voice.
        keys = [
            member_key(m, part)
            for m in range(members)
            for part in ("info", "want", *(("state",) if m not in self.local else ()))
        ]
        here = {m // self.per_node for m in self.local}
        others = sorted({m // self.per_node for m in range(members)} - here)
        self._changes = Changes(store, members, keys, others)
        self._member_of = {key: int(key.split("/")[-2]) for key in keys}  # member/<id>/<part>
        self._all_local = self.local == set(range(members))
        # What the decisions found, kept between polls and brought up to date only for the
        # members whose records, machine's voice or process changed (:meth:`_update`): who is
        # alive, and the wishes of those asking. A deciding poll looked at all W of them: a
        # poll while every member asks took 25 ms at W = 1,024, 0.3-0.6 s at 4,096.
        self._alive: set[int] = set()
        self._asking: dict[int, dict[str, Any]] = {}
        # And of the current generation's members (:meth:`_classify`): those whose running
        # incarnation is the generation's, and those that ask for the next one.
        self._current_set: set[int] = set()
        self._same_set: set[int] = set()
        self._regrouping: set[int] = set()
        # Members to look at again (:meth:`_update`), BATCH a poll, and the generation
        # decided and being written (:meth:`_write_forming`): no decision while either waits.
        self._stale: dict[int, None] = {}
        self._forming: Forming | None = None
        # What the last decision saw of time-driven state: machines heard, local members down.
        self._heard: set[int] | None = None
        self._down: set[int] = set()
        # Each value's seal is checked once, not at every poll; a stranger's value over a
        # member's record leaves the record as it was.
        self._opener = Opener()
        self.join_timeout_s = join_timeout_s
        self.on_wait = on_wait
        self._born = clock()
        self._noticed = False
        self.gave_up = ""  # the first generation never formed: why, once given up
        super().__init__("dtrain-coordinator")

    @property
    def catching_up(self) -> bool:
        """Whether records posted, members to look at again or a generation decided wait for
        the next polls (each poll does a bounded part of them)."""
        return bool(self._stale or self._changes.behind or self._forming)

    def interval(self) -> float:
        """``POLL_S``; a fifth of it while catching up: each poll's work stays bounded (the
        store's other callers and the launcher's threads get in between), and a burst of 4,096
        asks is read and its generation written in about 0.2 s, not 0.6 s of intervals."""
        return POLL_S / 5 if self.catching_up else POLL_S

    def _record(self, snap: dict[str, bytes | None], member: int, part: str, shape: Any) -> Any:
        """A member's record in the snapshot; None where unset. One that fails its seal or has
        another shape (a stranger's: warned once) leaves the last record that opened there."""
        key = member_key(member, part)
        return self._opener.parse(key, snap[key], shape)

    def _hear(self, now: float) -> set[int]:
        """The other machines whose launcher was heard within ``stale_s`` (its counter moved;
        a machine is heard from the first poll on, and falls silent ``stale_s`` after its
        counter last moved)."""
        return {node for node, (_, at) in self._changes.voices.items() if now - at < self.stale_s}

    def _local_down(self) -> set[int]:
        """The members on this machine whose process is known and ended or stopped (/proc)."""
        return {
            m
            for m in self.local
            if self._seen[m].pid and self._state_of(self._seen[m].pid) in DOWN_STATES
        }

    def _update(self, heard: set[int], down: set[int], snap: dict[str, bytes | None]) -> None:
        """:attr:`_alive` and :attr:`_asking` brought up to date, ``BATCH`` members a poll (the
        rest wait in :attr:`_stale`): every member at the first decision; then those whose
        records the last read found changed, those of machines heard or fallen silent since,
        and those of this machine whose process ended, stopped or runs again -- nothing else
        moves what :meth:`_is_alive` finds."""
        if self._heard is None:
            self._stale.update(dict.fromkeys(range(self.members)))
        else:
            dirty = {self._member_of[k] for k in self._changes.changed if k in self._member_of}
            dirty |= down ^ self._down
            for node in heard ^ self._heard:
                dirty |= self._members_of(node) & set(range(self.members))
            self._stale.update(dict.fromkeys(sorted(dirty)))
        batch = list(itertools.islice(self._stale, BATCH))
        for m in batch:
            del self._stale[m]
            if not self._is_alive(m, heard, snap):
                self._alive.discard(m)
                self._asking.pop(m, None)
                continue
            self._alive.add(m)
            want = self._record(snap, m, "want", WANT)
            if want is not None and want["nonce"] == self._seen[m].nonce:
                self._asking[m] = want
            else:
                self._asking.pop(m, None)
        for m in batch:
            self._classify(m)

    def _classify(self, m: int) -> None:
        """Whether member ``m`` of the current generation runs its incarnation there, and
        asks for the next generation: for the members :meth:`_update` looked at, and for
        all once the generation changes."""
        ours = m in self._current_set
        if ours and self.nonces.get(m) == self._seen[m].nonce:
            self._same_set.add(m)
        else:
            self._same_set.discard(m)
        want = self._asking.get(m)
        if (
            ours
            and want is not None
            and self.nonces.get(m) == want["nonce"]
            and int(want["after"]) == self.number
        ):
            self._regrouping.add(m)
        else:
            self._regrouping.discard(m)

    def _set_current(self, members: tuple[int, ...], nonces: dict[int, str]) -> None:
        """The current generation's members and their incarnations, as :meth:`_classify`
        finds them without looking at each: a generation holds the incarnations last seen
        (so every member runs its own), and none of its members has asked for the one after
        it yet (a member asks after a generation it read, and this one is not written yet)."""
        self.current, self.nonces = members, nonces
        self._current_set = set(members)
        self._same_set = {m for m in members if nonces[m] == self._seen[m].nonce}
        self._regrouping = set()

    def _is_alive(self, member: int, heard: set[int], snap: dict[str, bytes | None]) -> bool:
        """Whether the member's newest incarnation is running: its process exists and is not
        stopped (/proc here, its launcher's word elsewhere), and its machine is heard."""
        seen = self._seen[member]
        info = self._record(snap, member, "info", INFO)
        if info is None:
            return False
        if info["nonce"] != seen.nonce:
            seen.nonce, seen.pid = info["nonce"], info["pid"]
        if member in self.local:
            return self._state_of(seen.pid) not in DOWN_STATES
        state = self._record(snap, member, "state", STATE)
        if state is not None and state["nonce"] == seen.nonce and state["down"]:
            return False
        return member // self.per_node in heard

    def _silent_machines(self, heard: set[int], snap: dict[str, bytes | None]) -> list[int]:
        """The members of the current generation on other machines whose launcher has fallen
        silent (and posted none of them down, which would mean their machine still answers):
        that machine is cut off, or gone. (Machine by machine: a loop over the generation's
        members took a millisecond of every poll at 4,096.)"""
        silent: list[int] = []
        for node in sorted(set(self._changes.voices) - heard):
            node_members = sorted(self._members_of(node) & self._current_set)
            states = [self._record(snap, m, "state", STATE) for m in node_members]
            if not any(st is not None and st["down"] for st in states):
                silent += node_members
        return sorted(silent)

    def poll(self) -> None:
        if self.stopped:
            return  # the last generation is formed
        if self._forming is not None:
            self._write_forming()  # its next proofs; nothing is decided meanwhile
            return
        now = self._clock()
        changed = self._changes.read(now)
        heard, down = self._hear(now), self._local_down()
        # A decision reads every member's record: made only when something it reads changed
        # (a post, a machine heard or silent, a local process ended), or while time itself
        # decides (a regroup's hang_s, the first generation's wait for the machines).
        still = not changed and heard == self._heard and down == self._down
        caught_up = not self._stale and not self._changes.behind
        if still and caught_up and self.first_ask is None and self.number >= 0:
            return
        snap = self._changes.raw
        self._update(heard, down, snap)
        self._heard, self._down = heard, down
        if self._stale or self._changes.behind:
            # Decided only on every record posted so far: a regroup whose asks all came at
            # once waits for the polls that read them, BATCH a poll (32 at 4,096 members).
            return
        alive, wants = self._alive, self._asking
        if self.current and not self._all_local:
            cut_off = self._silent_machines(heard, snap)
            cut = {"gen": self.number, "members": cut_off}
            if cut_off and cut != self._cut:
                # The others shut down their connections to those machines (dtrain.recovery.sever)
                # instead of waiting out the collective timeout.
                write_value(self.store, "cut", cut)
                self._cut = cut
        asking = set(wants)
        # Members of the current generation (this incarnation) that ask for the next one,
        # and those running the incarnation it holds: kept up to date member by member, so
        # a poll's decision is set operations (its comprehensions over W members and the
        # generation's tuple took 0.7 s of one poll at W = 1,024).
        regrouping, same = self._regrouping, self._same_set
        joiners = asking - regrouping - same
        if not self.current:
            # The first generation (or one after every member was lost): everyone expected.
            if len(joiners) == self.members:
                self._form(sorted(joiners))
            elif self.number < 0:
                self._wait_for_machines(joiners, now)
            return
        stayed = same & alive
        gone = self._current_set - stayed
        if not regrouping and not gone:
            if joiners:
                write_value(self.store, "pending", str(self.number))
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
            self._set_current((), {})

    def _wait_for_machines(self, joiners: set[int], now: float) -> None:
        """Before the first generation: say which machines it waits for (their workers have
        not asked to join), once; give up after ``join_timeout_s``."""
        waited = now - self._born
        missing = sorted({m // self.per_node for m in set(range(self.members)) - joiners})
        others = [node for node in missing if not self.local & self._members_of(node)]
        notice_s = min(NOTICE_S, self.join_timeout_s / 2) if self.join_timeout_s else NOTICE_S
        if others and not self._noticed and waited >= notice_s:
            self._noticed = True  # this machine's own workers may still be starting: not them
            if self.on_wait is not None:
                self.on_wait(others, False)
        # Only other machines are given up on: this machine's own workers may be slow to
        # start on a loaded machine, and their launcher reports a worker that fails to.
        if others and self.join_timeout_s > 0 and waited >= self.join_timeout_s:
            nodes = ", ".join(map(str, others))
            self.gave_up = (
                f"the workers of the machine(s) with --node-rank {nodes} did not join within "
                f"{self.join_timeout_s:g}s"
            )
            if self.on_wait is not None:
                self.on_wait(others, True)
            self.stopped = self.gave_up
            write_value(self.store, "stopped", self.gave_up)
            announce(self.store)

    def _members_of(self, node: int) -> set[int]:
        return set(range(node * self.per_node, (node + 1) * self.per_node))

    def _stop_reason(self, survivors: list[int], lost: list[int], step: int) -> str:
        who = ", ".join(str(m) for m in lost)
        return (
            f"{len(survivors)} of {self.members} workers left at step {step} (member(s) {who} "
            f"lost), fewer than fault.min_replicas = {self.min_members}"
        )

    def _form(self, members: list[int], stop: str = "") -> None:
        """Decide generation ``number + 1`` of ``members``; it is written over this poll and
        the next (:meth:`_write_forming`), ``PROOFS`` proofs a poll, the number last."""
        before, chosen = self._current_set, set(members)
        self.number += 1
        # A member restarted meanwhile both left (its old incarnation) and joined.
        kept = before & chosen & self._same_set
        generation = Generation(
            self.number,
            tuple(members),
            tuple(sorted(before - kept)),
            tuple(sorted(chosen - kept)),
            self.first_ask_wall if self.first_ask is not None else 0.0,
            stop,
        )
        self.first_ask = None
        self._set_current(tuple(members), {m: self._seen[m].nonce for m in members})
        self._forming = Forming(self.store, generation, self.nonces)
        self._write_forming()

    def _write_forming(self) -> None:
        """The generation decided goes on being written (:class:`Forming`); once whole, it is
        formed (and the last, with a stop reason)."""
        assert self._forming is not None
        if not self._forming.write():
            return
        generation, self._forming = self._forming.generation, None
        self.formed.append(generation)
        self.stopped = generation.stop
