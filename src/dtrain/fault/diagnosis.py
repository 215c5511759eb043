"""Who is missing, in words: the diagnosis a rank gives when a collective fails -- a peer
that failed and said so, one killed (its process gone, seen on its machine or posted by it),
one silent (probed at its published address: gone, cut off, or alive but stuck), or the
store's own host lost. A part of :class:`dtrain.fault.watchdog.Watchdog`, which holds the
store, this rank's identity and the beats it reads."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.dist.reachability import ADDRESS, OPEN, REFUSED, UNREACHABLE, probe, reach_key
from dtrain.dist.sealed_store import fits
from dtrain.dist.store_link import StoreTimeout
from dtrain.fault.liveness import (
    Liveness,
    liveness_path,
    read_liveness,
)
from dtrain.fault.peer_failure import (
    beat_words,
    probe_words,
    since_words,
    who,
)
from dtrain.process_exit import process_alive

# How much longer than a beat takes to go stale a rank reads the index of what the others
# posted: the watchers of a rank gone silent post it once they see its beats stop, which they
# began to watch about when this rank did (their collectives failed with this one's).
POSTS_GRACE_S = 2.0
_NEVER = "never checked in"


def stale_after_s(heartbeat_s: float) -> float:
    """How long an unchanged beat takes to count as stopped: 3 heartbeats, at least 3 s."""
    return max(3 * heartbeat_s, 3.0)


def quick_read_s(heartbeat_s: float) -> float:
    """The bound of one store read while a rank looks for who is missing: a healthy store
    answers in milliseconds, and a short bound keeps the whole diagnosis (after the
    collective's own timeout) within the time a user waits for it."""
    return max(1.0, min(2.0, heartbeat_s))


class PeerDiagnosis:
    """The watchdog's diagnosis (a mixin: :class:`~dtrain.fault.watchdog.Watchdog` gives the
    store, this rank's identity and its reads of the others' beats and failures)."""

    store: Any
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    host: str
    node: str
    heartbeat_s: float
    run_dir: Path | None
    _addresses: dict[int, tuple[str, int]]
    _rank0_beat: Liveness | None
    # The watchdog's reads of the others' beats and posted failures, its posts of what this
    # rank found, and its claim of the one read of every rank's beat.
    beats: Callable[[set[int], float | None], dict[int, Liveness | None]]
    failures: Callable[[float | None], dict[int, dict[str, Any]]]
    _report_dead_peer: Callable[[int, str, Liveness], None]
    _report_silent_peer: Callable[[int, str, bool, Liveness | None], None]
    _first_to_scan: Callable[[], bool]

    def _local_record(self, beat: Liveness) -> Liveness | None:
        """The live record of the rank a beat is from, if it is of this machine and its file
        (in the run folder the ranks share) is that process's."""
        if self.run_dir is None or beat.host != self.host:
            return None
        return read_liveness(liveness_path(self.run_dir, beat.rank), beat.pid)

    def diagnose(self, closed: bool = False) -> str:
        """Who is missing, in words (see :meth:`diagnosis`)."""
        return self.diagnosis(closed)[0]

    def diagnosis(self, closed: bool = False) -> tuple[str, bool]:
        """Who is missing, in words, and whether it is the network that lost them (a peer,
        or the store's host, that does not answer at all). ``closed``: this rank's collective
        failed because a peer's end of a connection closed (its process ended), not because
        one stopped answering.

        Each rank reads the index of what the ranks posted (failures, and what a watcher saw)
        and the beats of the few ranks it watches (:meth:`watched`), never every rank's: at
        W ranks that was W reads of W beats in every round, all at once. A rank that finds
        one of its watched ranks gone or silent posts what it found to the index, where
        every other rank reads it. A rank that died on another machine posts nothing and
        cannot be looked up; its beats only stop. So while nobody is named yet, the store is
        read again for as long as it takes a dead rank's beat to go stale (a few
        heartbeats), and its watchers' posts a little longer, instead of saying "every other
        rank is still beating" about a rank killed a moment ago. A silent rank on another
        machine is then probed at the address its start-up check published: a refused
        connection is a process gone (killed or crashed), no answer at all a network path
        lost (or the machine), a connection accepted a process alive but silent."""
        if self.store is None:
            return "no rendezvous store to ask which rank is missing", False
        stale_after = stale_after_s(self.heartbeat_s)
        start = time.monotonic()
        # Beats are read until one can be stale; the index a little longer, for what the
        # watchers of the rank at fault post once they have seen its beats stop.
        deadline, posts_until = start + stale_after + 0.5, start + stale_after + POSTS_GRACE_S
        # A beat's seen_at as this rank first read it, and when (time.monotonic()): a beat
        # that has not changed for stale_after of this machine's time has stopped, whatever
        # the two machines' clocks say.
        first_seen: dict[int, tuple[float, float]] = {}
        answered = start  # when the store last answered (time.monotonic())
        while True:
            now = time.monotonic()
            try:
                found, settled = self._missing(first_seen, stale_after, closed, now < deadline)
                answered = now
            except Exception as exc:
                # A read that timed out is a busy store as often as a frozen one: it is read
                # again, and the store (and rank 0 with it) is named lost only when it has
                # not answered for as long as a beat takes to go stale -- counted from the
                # first call it left unanswered, this thread's or the watchdog thread's (whose
                # reads of rank 0's beat met a stopped store's silence while the collective
                # waited out its timeout; counted from this read, a stopped rank 0 was named
                # 3-4 s later than a stopped peer, after the hang check had named it).
                silent = max(now - answered, self.store.silent_s())
                if not isinstance(exc, StoreTimeout) or silent >= stale_after:
                    return self._store_lost_by(exc)
                found, settled = [], False
            if found or time.monotonic() >= posts_until:
                break
            time.sleep(0.5)
        if not settled and self._first_to_scan():
            # Nobody named from what the watchers saw, or only ranks that never checked in
            # (a whole machine may not have started): a failure only this rank (or a few)
            # diagnoses (a hang, the resume check's collector), or none to be found. One rank
            # per attempt then reads every rank's beat, once: O(W) in all.
            try:
                found, _ = self._missing(first_seen, stale_after, closed, True, every=True)
            except Exception as exc:
                return self._store_lost_by(exc)
        if not found:
            return "every other rank is still beating (the failure may be in the network)", False
        return "; ".join(words for words, _ in found), any(network for _, network in found)

    def watched(self) -> set[int]:
        """The ranks whose beats this rank reads in a diagnosis: the next rank of its machine
        (which sees that rank's process and liveness file) and its own place on the next
        machine (which still sees that rank when its whole machine is lost). Every rank is
        watched by two, so each diagnosis reads a few beats at any W; what a watcher finds it
        posts for the others. The machine's ranks are consecutive, as torch's agent numbers
        them (where they are not, a watcher is on another machine and probes instead)."""
        world = self.world_size
        size = max(1, min(self.local_size, world))
        local = self.local_rank if 0 <= self.local_rank < size else self.rank % size
        base = self.rank - local
        mate = base + (local + 1) % size
        return {r for r in (mate, (self.rank + size) % world) if r != self.rank and r < world}

    def _store_lost_by(self, exc: BaseException) -> tuple[str, bool]:
        from dtrain.dist.runtime import store_hosted_by_launcher

        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        why = f"({type(exc).__name__}: {first})"
        return self._store_lost(why, isinstance(exc, StoreTimeout), store_hosted_by_launcher())

    def _missing(
        self,
        first_seen: dict[int, tuple[float, float]],
        stale_after: float,
        closed: bool,
        watching: bool,
        every: bool = False,
    ) -> tuple[list[tuple[str, bool]], bool]:
        """One reading of the store: the ranks found missing, in words, each with whether
        the network lost it (``watching``: the watched ranks' beats are read too, ``every``:
        every rank's); and
        whether that settles it (ranks that never checked in do not: at start-up every rank
        beats first, and a whole machine that never started is many such ranks, each seen
        by its own watchers only). Raises what the store's client raised when it cannot be
        read."""
        quick = quick_read_s(self.heartbeat_s)
        failed = self.failures(quick)
        # A rank of this machine that another posted (killed, silent) is looked at here too:
        # this machine sees its process, and its liveness file says where it was.
        local = {r for r, record in failed.items() if record.get("host") == self.host}
        look = set(range(self.world_size)) - {self.rank} if every else self.watched() | local
        beats = self.beats(look, quick) if watching else {}
        now, clock = time.time(), time.monotonic()
        found: list[tuple[str, bool]] = []
        named: set[int] = set()
        for rank, record in sorted(failed.items()):
            if "error" in record:
                named.add(rank)
                found.append(
                    (
                        f"rank {rank} ({record['host']}, pid {record['pid']}) failed at step "
                        f"{record['step']} in {record['phase']}: {record['error']}",
                        False,
                    )
                )
            elif record.get("host") == self.host and rank in beats:
                continue  # this machine sees its process itself, below
            elif "killed" in record:
                named.add(rank)
                found.append(
                    (
                        f"rank {rank} ({record['host']}, pid {record['pid']}) died: "
                        f"{record['killed']} (seen by rank {record['seen_by']} on its machine)",
                        False,
                    )
                )
            elif record["seen_by"] != self.rank or rank not in beats:
                named.add(rank)
                seen_by = record["seen_by"]
                by = "" if seen_by == self.rank else f" (seen by rank {seen_by})"
                found.append((f"{record['silent']}{by}", bool(record["network"])))
        for rank, beat in sorted(beats.items()):
            if rank in named:
                continue
            if beat is None:
                words = f"rank {rank} {_NEVER}"
                found.append((words, False))
                if rank not in failed:
                    self._report_silent_peer(rank, words, False, None)
                continue
            seen = first_seen.setdefault(rank, (beat.seen_at, clock))
            if seen[0] != beat.seen_at:
                first_seen[rank] = seen = (beat.seen_at, clock)
            silent = now - beat.seen_at > stale_after or clock - seen[1] > stale_after
            if beat.host == self.host and not process_alive(beat.pid):
                # Killed outright (kill -9, the OOM killer): no error posted, and a beat that
                # may be many steps behind; its liveness file says where it was.
                last_words = self._last_words_of(beat, now)
                found.append((f"{who(rank, beat)} died: {last_words}", False))
                if rank not in failed:
                    self._report_dead_peer(rank, last_words, beat)
                continue
            if not silent:
                continue
            if beat.host != self.host:
                words, network = self._remote_silent(rank, beat, now, closed, quick)
            else:
                words = f"{who(rank, beat)} stopped responding: {self._last_known(beat, now)}"
                network = False
            found.append((words, network))
            if rank not in failed:
                self._report_silent_peer(rank, words, network, beat)
        return found, any(_NEVER not in words for words, _ in found)

    def _remote_silent(
        self, rank: int, beat: Liveness, now: float, closed: bool, quick: float
    ) -> tuple[str, bool]:
        """A silent rank on another machine, probed at its published address."""
        address = self._address_of(rank, quick)
        if address is None:  # not published (an old attempt's store): what the error says
            if closed:
                return (
                    f"{who(rank, beat)} died: killed or crashed (its connection closed, it "
                    f"posted no error, and its heartbeats stopped): {beat_words(beat, now)}",
                    False,
                )
            return f"{who(rank, beat)} stopped responding: {beat_words(beat, now)}", False
        state, why = probe(address[0], address[1], quick)
        return probe_words(who(rank, beat), state, why, address[0], beat, now, self.node)

    def _address_of(self, rank: int, seconds: float) -> tuple[str, int] | None:
        """Where ``rank``'s start-up check listens (it stays open: ``reachability.probe``)."""
        if rank not in self._addresses:
            assert self.store is not None
            from dtrain.dist.runtime import store_namespace

            # Sealed by the rank (a stranger's address: none, warned once by the read).
            record = self.store.read(store_namespace() + reach_key(rank), seconds)
            if not fits(record, ADDRESS):
                return None
            self._addresses[rank] = (record["addr"], record["port"])
        return self._addresses[rank]

    def _last_words_of(self, beat: Liveness, now: float) -> str:
        """Where a rank of this machine whose process is gone was when it died."""
        record = self._local_record(beat)
        gone = "its process is gone (killed or crashed)"
        if record is None:  # no file to read: say plainly how old what we know is
            return f"{gone} at an unknown step: {beat_words(beat, now)}"
        return f"{gone} {record.where()}"

    def _last_known(self, beat: Liveness, now: float) -> str:
        """Where a rank that is alive but silent is: exact for a rank of this machine (from
        its liveness file), else its last heartbeat and how old it is."""
        record = self._local_record(beat)
        if record is None:
            return beat_words(beat, now)
        still = max(0.0, now - record.progress_at)
        age = max(0.0, now - record.seen_at)
        return f"no progress for {still:.1f}s, {record.where()} (last heartbeat {age:.1f}s ago)"

    def _store_lost(self, why: str, timed_out: bool, launcher_hosted: bool) -> tuple[str, bool]:
        """The diagnosis when the store cannot be reached: its host has died, or been cut
        off. The store's address is probed: refused, its process is gone; no answer, the
        network to it (or its machine)."""
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        state, said = probe(host, int(port), 2.0) if host and port.isdigit() else (OPEN, "")
        since = self.store.last_ok if self.store is not None else None
        beat = self._rank0_beat
        if launcher_hosted or beat is None:
            holder = "the launcher" if launcher_hosted else "rank 0"
            if state == UNREACHABLE:
                return (
                    f"lost the network path to {host}, where {holder} hosts the job's "
                    f"key-value store ({said}){since_words(since)} {why}",
                    True,
                )
            return (
                f"the job's key-value store is unreachable {why}: {holder}, which hosts it, "
                "has died",
                False,
            )
        now = time.time()
        network = False
        if beat.host == self.host and not process_alive(beat.pid):
            fate = f"died: {self._last_words_of(beat, now)}"
        elif state == REFUSED:
            fate = (
                f"died: killed or crashed (its machine {host} refuses connections to the store: "
                f"{said}): {beat_words(beat, now)}"
            )
        elif state == UNREACHABLE:
            network = True
            fate = (
                f"is cut off: {self.node} has no network path to {host} ({said})"
                f"{since_words(since)}: {beat_words(beat, now)}"
            )
        elif timed_out:  # alive but silent: stopped (SIGSTOP) or hung
            fate = f"stopped responding: {self._last_known(beat, now)}"
        else:
            fate = f"is unreachable (died, or its machine was cut off): {beat_words(beat, now)}"
        words = f"{who(0, beat)} {fate}; it hosted the job's key-value store, now unreachable {why}"
        return words, network
