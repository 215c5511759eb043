"""What the in-place membership costs the store while nothing happens, counted call by call on a
real store: a member waiting for a generation blocks on the store (it polled: about 400 calls a
second each), and a coordinator's poll reads what was posted, not every member's keys (one poll
read 3-4 keys per member: 1.2 s at 4,096 members against its 10 ms interval). Members are
threads, or their posts written as they write them; no time passes but what the waits take."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dtrain.dist import store_link
from dtrain.dist.stores import host_store
from dtrain.recovery import membership
from dtrain.recovery.changes import BATCH, PROOFS, SWEEP_KEYS
from dtrain.recovery.coordinator import Coordinator
from dtrain.recovery.membership import Member, post


class Counting:
    """A store client that counts its calls and the keys they name, and tells :attr:`waited`
    at each blocking ``wait`` that timed out or ended (a member's side)."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls, self.keys = store, 0, 0
        self.waits = self.started = 0  # blocking waits ended, and begun
        self.calls_at_ends: list[int] = []  # the calls made by the end of each wait
        self.waited = threading.Condition()

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            if name == "wait":
                with self.waited:
                    self.started += 1
                    self.waited.notify_all()
            named = args[0] if args else None
            self.keys += len(named) if isinstance(named, list) else 1
            try:
                return method(*args)
            finally:
                if name == "wait":
                    with self.waited:
                        self.waits += 1
                        self.calls_at_ends.append(self.calls)
                        self.waited.notify_all()

        return call if callable(method) else method


@pytest.fixture
def store() -> Any:
    return host_store("127.0.0.1", 0, 30.0)


@pytest.fixture
def clients(monkeypatch: pytest.MonkeyPatch) -> list[Counting]:
    """Every store client a member opens, counted."""
    made: list[Counting] = []
    real = store_link.client_store

    def counted(host: str, port: int, timeout_s: float) -> Counting:
        made.append(Counting(real(host, port, timeout_s)))
        return made[-1]

    monkeypatch.setattr(store_link, "client_store", counted)
    return made


def waits_reach(client: Counting, count: int, started: bool = False) -> None:
    """Until ``count`` blocking waits have ended (``started``: begun) on ``client``."""
    with client.waited:
        done = client.waited.wait_for(
            lambda: (client.started if started else client.waits) >= count, timeout=30
        )
    assert done


def test_a_waiting_member_blocks_on_the_store_and_wakes_on_news(
    store: Any, clients: list[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "WAIT_S", 0.05)  # a slice ends often: count its calls
    member = Member(f"127.0.0.1:{store.port}", 0, 1, timeout_s=10.0)
    link = clients[0]  # the member's calls (the second client is its looks')
    got: list[Any] = []
    member.ask(-1, -1)
    thread = threading.Thread(target=lambda: got.append(member.wait(-1)))
    thread.start()
    try:
        waits_reach(link, 1)
        started = time.monotonic()
        waits_reach(link, 6)  # five slices of waiting with nothing announced
        # Counted at the waits' ends, not when this thread wakes (the member runs on meanwhile).
        calls = link.calls_at_ends[5] - link.calls_at_ends[0]
        rate = calls / (time.monotonic() - started)
        # Each slice: the news counter read, one blocking wait (the look at the membership
        # only when the counter moved); polling, it made 4 calls every 10 ms.
        assert 10 <= calls <= 11
        print(f"a waiting member: {rate:.0f} store calls/s with WAIT_S = 0.05 s")
        # A generation announced: the member wakes (not at its slice's end) and takes it.
        monkeypatch.setattr(membership, "WAIT_S", 60.0)
        waits_reach(link, link.started + 1, started=True)  # blocked now, for 60 s
        coordinator = Coordinator(store, 1, stale_s=3.0, hang_s=30.0)
        coordinator.poll()
        thread.join(30)
        assert not thread.is_alive()
        assert got[0] is not None and got[0].members == (0,)
    finally:
        member.close()


def test_give_up_and_done_end_a_blocked_wait(
    store: Any, clients: list[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "WAIT_S", 60.0)  # only what is announced ends a wait
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 3, timeout_s=10.0) for m in range(3)]
    links = clients[0::2]
    flag = threading.Event()
    got: dict[int, Any] = {}

    def wait(m: int) -> None:
        got[m] = members[m].wait(-1, give_up=flag.is_set if m == 0 else None)

    threads = [threading.Thread(target=wait, args=(m,)) for m in range(3)]
    try:
        for thread in threads:
            thread.start()
        for link in links:
            waits_reach(link, 1, started=True)
        flag.set()  # a preemption signal before the first generation: seen within POLL_S
        threads[0].join(30)
        assert not threads[0].is_alive() and got[0] is None
        # Its blocked call was woken (news: the others look, find nothing new, wait on) and
        # has ended: nothing of the member's is in flight when its process exits.
        assert members[0]._waiting is None
        members[0].finish()
        for thread in threads[1:]:
            thread.join(30)
        assert [got[m] for m in (1, 2)] == [None, None]  # the run completed: nothing to join
        assert members[1].stopped() == ""
    finally:
        for member in members:
            member.close()


def settle(coordinator: Coordinator) -> int:
    """Polls until what was posted is read and decided on (BATCH records a poll): how many."""
    polls = 1
    coordinator.poll()
    while coordinator.catching_up:
        coordinator.poll()
        polls += 1
        assert polls <= 100
    return polls


def on_machines_of_8(store: Any, members: int) -> Coordinator:
    """The coordinator of machines of 8 workers on node 0, which reads its own 8 in /proc
    (all running); the others heard through their launchers (the clock stands: throughout)."""
    return Coordinator(
        store,
        members,
        stale_s=3.0,
        hang_s=30.0,
        local=range(8),
        per_node=8,
        clock=lambda: 1000.0,
        state_of=lambda pid: "R",
    )


def posted_job(store: Any, members: int) -> None:
    """Every member registered and asking for the first generation, posted as members post,
    and the state of those on other machines (8 a machine) as their launchers post it."""
    for m in range(members):
        post(store, m, "info", {"pid": 100 + m, "host": "here", "nonce": f"n{m}"})
        post(store, m, "want", {"after": -1, "nonce": f"n{m}", "step": -1})
        if m >= 8:
            post(store, m, "state", {"nonce": f"n{m}", "down": False})


@pytest.mark.parametrize("members", [8, 512])
def test_a_poll_reads_what_changed_not_every_member(store: Any, members: int) -> None:
    # Machines of 8 workers; this one (node 0) reads its own in /proc (all running), the
    # others are heard through their launchers' counters (the clock stands: heard throughout).
    counting = Counting(store)
    coordinator = on_machines_of_8(counting, members)
    posted_job(store, members)
    # Every member's records posted at once are read BATCH a poll (info, want and, but for
    # this machine's 8, state), each poll a few calls and a bounded number of keys, decided on
    # once all are read; the generation is then written PROOFS proofs a poll.
    posted = 2 * members + members - 8
    # The log (read and emptied), the slice, the voices and the batch (a key seen set for the
    # first time is looked for once more: ``check``); and the proofs written, with the record,
    # the number, the news.
    bound = 3 + members // 8 + 2 * (min(SWEEP_KEYS, posted) + BATCH) + PROOFS + 4
    polls = 0
    while not coordinator.formed:
        counting.calls = counting.keys = 0
        coordinator.poll()
        polls += 1
        assert counting.calls <= 7 and counting.keys <= bound
    assert polls == max(1, -(-posted // BATCH) + -(-members // PROOFS) - 1)
    assert [g.members for g in coordinator.formed] == [tuple(range(members))]
    counting.calls = counting.keys = 0
    started = time.perf_counter()
    for _ in range(20):
        coordinator.poll()
    took = (time.perf_counter() - started) / 20
    # Nothing changed: one call a poll (the change log and a slice of the members' keys),
    # whatever the number of members.
    assert counting.calls == 20
    assert counting.keys <= 20 * (1 + min(SWEEP_KEYS, 2 * members + 7 * members // 8))
    print(f"{members} members: a steady poll {took * 1e3:.2f} ms, {counting.keys / 20:.0f} keys")
    # One member asks for the next generation: the log and its record, in three calls.
    post(store, 3, "want", {"after": 0, "nonce": "n3", "step": 5})
    counting.calls = 0
    coordinator.poll()
    assert counting.calls <= 3  # multi_get, the log emptied (compare_set), the record read
    assert coordinator.first_ask is not None and len(coordinator.formed) == 1
    for m in range(members):
        post(store, m, "want", {"after": 0, "nonce": f"n{m}", "step": 5})
    # The asks read BATCH a poll, then the generation written PROOFS proofs a poll.
    polls = 0
    while len(coordinator.formed) < 2:
        counting.calls = 0
        coordinator.poll()
        polls += 1
        assert counting.calls <= 7  # and the generation written (2), announced (2)
    assert polls == max(1, -(-members // BATCH) + -(-members // PROOFS) - 1)
    assert [len(g.members) for g in coordinator.formed] == [members, members]


def test_a_deciding_poll_looks_again_only_at_the_members_that_changed(store: Any) -> None:
    # Every member on this machine (as the control-plane simulation runs them): each poll reads
    # the processes in /proc (``state_of``) to see one end; a decision looks again only at the
    # members whose records changed, where it looked at all of them, and tested each against
    # the generation's tuple (O(W^2): 0.7 s of one poll at 1,024 members).
    members = 512
    looked: list[int] = []
    coordinator = Coordinator(
        store,
        members,
        stale_s=3.0,
        hang_s=30.0,
        clock=lambda: 1000.0,
        state_of=lambda pid: looked.append(pid) or ("X" if pid == 100 + members - 1 else "R"),
    )
    for m in range(members):
        post(store, m, "info", {"pid": 100 + m, "host": "here", "nonce": f"n{m}"})
        post(store, m, "want", {"after": -1, "nonce": f"n{m}", "step": -1})
    settle(coordinator)  # the first decision looks at every member (the last one is down)
    del looked[:]
    for m in range(members - 1):
        post(store, m, "want", {"after": -1, "nonce": f"n{m}", "step": -1})
    post(store, members - 1, "info", {"pid": 100, "host": "here", "nonce": "again"})
    post(store, members - 1, "want", {"after": -1, "nonce": "again", "step": -1})
    settle(coordinator)
    assert [g.members for g in coordinator.formed] == [tuple(range(members))]
    coordinator.poll()  # (its new process, seen up in /proc: looked at once more)
    del looked[:]
    post(store, 3, "want", {"after": 0, "nonce": "n3", "step": 5})
    coordinator.poll()  # member 3 asks: it alone is looked at again
    assert coordinator.first_ask is not None and len(coordinator.formed) == 1
    assert len(looked) == members + 1, looked[members - 2 :]  # each in /proc, and member 3's
    for m in range(members):
        if m != 3:
            nonce = "again" if m == members - 1 else f"n{m}"
            post(store, m, "want", {"after": 0, "nonce": nonce, "step": 5})
    settle(coordinator)
    assert [len(g.members) for g in coordinator.formed] == [members, members]
    assert coordinator.formed[1].left == coordinator.formed[1].joined == ()


def test_the_job_stopping_ends_a_blocked_wait(
    store: Any, clients: list[Counting], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(membership, "WAIT_S", 60.0)
    # Member 1's machine never joins: the coordinator gives up on it and the job stops.
    coordinator = Coordinator(
        store, 2, stale_s=3.0, hang_s=30.0, local=[0], per_node=1, join_timeout_s=5.0
    )
    member = Member(f"127.0.0.1:{store.port}", 0, 2, timeout_s=10.0)
    got: list[Any] = []
    member.ask(-1, -1)
    thread = threading.Thread(target=lambda: got.append(member.wait(-1)))
    thread.start()
    try:
        waits_reach(clients[0], 1, started=True)
        coordinator._born -= 10.0  # as if the join timeout had passed
        coordinator.poll()
        assert coordinator.stopped
        thread.join(30)
        assert not thread.is_alive() and got == [None]
        assert member.stopped() == coordinator.stopped
    finally:
        member.close()


def test_every_poll_of_a_regroup_at_thousands_of_members_is_bounded(store: Any) -> None:
    # 2,048 members on machines of 8; the last machine's launcher posts its last member down
    # and every other member asks at once. Each poll reads at most BATCH posted records and
    # writes at most PROOFS proofs (the poll that read all 4,096 asks of a regroup at 4,096
    # members at once took 0.1-0.4 s against its 10 ms interval); the generation leaves out
    # the dead member, and only it.
    members = 2048
    counting = Counting(store)
    coordinator = on_machines_of_8(counting, members)
    posted_job(store, members)
    settle(coordinator)
    assert [g.members for g in coordinator.formed] == [tuple(range(members))]
    dead = members - 1
    post(store, dead, "state", {"nonce": f"n{dead}", "down": True})
    for m in range(members - 1):
        post(store, m, "want", {"after": 0, "nonce": f"n{m}", "step": 5})
    polls, most = 0, 0
    while len(coordinator.formed) < 2:
        counting.calls = counting.keys = 0
        coordinator.poll()
        polls += 1
        most = max(most, counting.keys)
        assert counting.calls <= 7
    # Read: 2,048 records over 16 polls; written: 2,047 proofs over 4, the first in the poll
    # that decides.
    assert polls == -(-members // BATCH) + -(-(members - 1) // PROOFS) - 1
    assert most <= 3 + members // 8 + 2 * (SWEEP_KEYS + BATCH) + PROOFS + 4
    regroup = coordinator.formed[1]
    assert (regroup.members, regroup.left, regroup.joined) == (tuple(range(dead)), (dead,), ())
