"""The membership coordinator of ``fault.recovery = 'inplace'`` on a real store, members played
by this process (its own pid: alive) and by processes it ends (gone)."""

from __future__ import annotations

import os
import subprocess
import time
from typing import Any

import pytest

from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import host_store
from dtrain.recovery.coordinator import Coordinator, NodeWatcher, process_state
from dtrain.recovery.membership import (
    CUT,
    GENERATION,
    PREFIX,
    STATE,
    Member,
    read_json,
    read_text,
    write_value,
)


@pytest.fixture
def store() -> Any:
    return host_store("127.0.0.1", 0, 30.0)


def register(store: Any, member: int, pid: int, nonce: str) -> None:
    info = {"pid": pid, "host": "here", "nonce": nonce}
    write_value(store, f"member/{member}/info", info)
    store.add(f"{PREFIX}member/{member}/beat", 1)


def ask(store: Any, member: int, nonce: str, after: int, step: int = -1) -> None:
    want = {"after": after, "nonce": nonce, "step": step}
    write_value(store, f"member/{member}/want", want)


def latest(store: Any) -> dict[str, Any] | None:
    if not store.check([f"{PREFIX}gen/latest"]):
        return None
    number = read_json(store, "gen/latest", int)
    record: dict[str, Any] = read_json(store, f"gen/{number}", GENERATION)
    return {"number": number, **record}


@pytest.fixture
def sleeper() -> Any:
    """A process to play member 0 (and to end)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def two_members(store: Any, coordinator: Coordinator, pid0: int | None = None) -> None:
    """Generation 0 = members 0 (process ``pid0``, default this one) and 1 (this process)."""
    for member, pid in ((0, pid0 or os.getpid()), (1, os.getpid())):
        register(store, member, pid, f"n{member}")
        ask(store, member, f"n{member}", -1)
    coordinator.poll()
    assert latest(store) == {
        "number": 0,
        "members": [0, 1],
        "nonces": ["n0", "n1"],
        "left": [],
        "joined": [0, 1],
        "asked_at": 0.0,
        "stop": "",
    }


def test_the_first_generation_waits_for_every_member(store: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)
    register(store, 0, os.getpid(), "n0")
    ask(store, 0, "n0", -1)
    coordinator.poll()
    assert latest(store) is None
    two_members(store, coordinator)


def test_a_dead_member_is_left_out_once_the_survivor_asks(store: Any, sleeper: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)
    two_members(store, coordinator, sleeper.pid)
    sleeper.kill()  # member 0's process ends (kill -9)
    sleeper.wait()
    coordinator.poll()
    assert latest(store)["number"] == 0  # the survivor has not asked yet
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["left"], gen["joined"]) == (1, [1], [0], [])
    assert gen["asked_at"] > 0


def test_a_restarted_member_joins_the_survivor_at_its_next_step(store: Any, sleeper: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)
    two_members(store, coordinator, sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    assert latest(store)["members"] == [1]
    # Member 0 restarted: a new incarnation (nonce) asks to join; the survivor trains on, is
    # told to regroup after its next step (``pending``), and asks.
    register(store, 0, os.getpid(), "n0-again")
    ask(store, 0, "n0-again", -1)
    coordinator.poll()
    assert read_text(store, "pending") == "1"
    assert latest(store)["number"] == 1
    ask(store, 1, "n1", after=1, step=9)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["nonces"]) == (2, [0, 1], ["n0-again", "n1"])
    assert (gen["left"], gen["joined"]) == ([], [0])


def test_a_member_restarted_before_the_others_noticed_both_left_and_joined(
    store: Any, sleeper: Any
) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)
    two_members(store, coordinator, sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    register(store, 0, os.getpid(), "n0-again")  # back before member 1's collective failed
    ask(store, 0, "n0-again", -1)
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["nonces"]) == (1, [0, 1], ["n0-again", "n1"])
    assert (gen["left"], gen["joined"]) == ([0], [0])


def test_fewer_survivors_than_min_members_form_a_last_generation_that_stops(
    store: Any, sleeper: Any
) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0, min_members=2)
    two_members(store, coordinator, sleeper.pid)
    sleeper.kill()
    sleeper.wait()
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    gen = latest(store)
    # The survivor still gets a generation: it heals, saves and ends there.
    assert (gen["number"], gen["members"], gen["left"]) == (1, [1], [0])
    reason = "1 of 2 workers left at step 7 (member(s) 0 lost), fewer than fault.min_replicas = 2"
    assert gen["stop"] == reason
    assert read_text(store, "stopped") == reason
    # None after it: member 0, restarted, is told the job stopped instead of joining.
    restarted = Member(f"127.0.0.1:{store.port}", 0, 2, timeout_s=10.0)
    try:
        restarted.ask(-1, -1)
        coordinator.poll()
        assert latest(store)["number"] == 1
        assert restarted.wait(-1) is None
        assert restarted.stopped() == reason
    finally:
        restarted.close()


def test_a_member_that_never_asks_is_left_out_after_hang_s(store: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=0.3)
    two_members(store, coordinator)
    ask(store, 1, "n1", after=0)
    coordinator.poll()
    assert latest(store)["number"] == 0  # member 0 alive and beating: waited for
    time.sleep(0.4)
    store.add(f"{PREFIX}member/0/beat", 1)
    coordinator.poll()
    assert latest(store)["members"] == [1]


def test_a_stopped_process_counts_as_gone() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        os.kill(proc.pid, 19)  # SIGSTOP
        deadline = time.monotonic() + 5
        while process_state(proc.pid) not in ("T", "t") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(proc.pid) in ("T", "t")
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) == "X"


def test_members_wait_for_the_generation_that_holds_them(store: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)
    coordinator.start()
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 2, timeout_s=10.0) for m in (1, 0)]
    try:
        for member in members:
            member.ask(-1, -1)
        generations = [member.wait(-1) for member in members]
        assert all(g is not None and g.members == (0, 1) for g in generations)
        assert [g.rank_of(m.id) for g, m in zip(generations, members) if g] == [1, 0]
        members[0].finish()
        assert members[1].wait(0) is None  # the run completed: nothing to wait for
    finally:
        for member in members:
            member.close()
        coordinator.stop()


def test_a_member_on_another_machine_is_gone_when_its_launcher_posts_it_down(
    store: Any,
) -> None:
    # Member 1 is on another machine (per_node=1): its pid means nothing here; its launcher
    # posts its state. Its beats go on (stale_s is long): only the posted state counts.
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=30.0, local=[0], per_node=1)
    two_members(store, coordinator, pid0=os.getpid())
    write_value(store, "member/1/state", {"nonce": "n1", "down": False})
    ask(store, 0, "n0", after=0)
    coordinator.poll()
    assert latest(store)["number"] == 0  # alive: waited for
    write_value(store, "member/1/state", {"nonce": "old", "down": True})
    coordinator.poll()
    assert latest(store)["number"] == 0  # a state of an earlier incarnation: ignored
    write_value(store, "member/1/state", {"nonce": "n1", "down": True})
    coordinator.poll()
    assert latest(store)["members"] == [0]


def test_a_machine_fallen_silent_is_named_cut_off_but_not_one_posted_down(store: Any) -> None:
    coordinator = Coordinator(store, 4, stale_s=0.2, hang_s=30.0, local=[0, 1], per_node=2)
    for member in range(4):
        register(store, member, os.getpid(), f"n{member}")
        ask(store, member, f"n{member}", -1)
    coordinator.poll()
    assert latest(store)["members"] == [0, 1, 2, 3]
    time.sleep(0.3)
    store.add(f"{PREFIX}member/0/beat", 1)
    store.add(f"{PREFIX}member/1/beat", 1)
    store.add(f"{PREFIX}member/2/beat", 1)  # machine 1 still answers through member 2
    coordinator.poll()
    assert not store.check([f"{PREFIX}cut"])
    time.sleep(0.3)
    for member in (0, 1):
        store.add(f"{PREFIX}member/{member}/beat", 1)
    # A launcher that posts a worker down still answers: not cut off (the timeout applies).
    write_value(store, "member/3/state", {"nonce": "n3", "down": True})
    coordinator.poll()
    assert not store.check([f"{PREFIX}cut"])
    write_value(store, "member/3/state", {"nonce": "n3", "down": False})
    coordinator.poll()
    assert read_json(store, "cut", CUT) == {"gen": 0, "members": [2, 3]}


def test_a_member_hears_of_a_machine_cut_off_with_the_addresses(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTRAIN_NODE_ADDR", "10.81.0.1")
    member = Member(f"127.0.0.1:{store.port}", 0, 2, timeout_s=10.0, local=(0, 1))
    heard: list[tuple[int, list[int], dict[int, str]]] = []
    member.on_cut = lambda gen, cut, addresses: heard.append((gen, cut, addresses))
    try:
        info = {"pid": 1, "host": "there", "nonce": "n1", "addr": "10.81.0.2"}
        write_value(store, "member/1/info", info)
        write_value(store, "cut", {"gen": 3, "members": [1]})
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.02)
        assert heard == [(3, [1], {0: "10.81.0.1", 1: "10.81.0.2"})]
    finally:
        member.close()


def test_a_launcher_posts_its_workers_down_and_up_again(store: Any, sleeper: Any) -> None:
    link = StoreLink("127.0.0.1", store.port, call_s=5.0, patience_s=10.0)
    watcher = NodeWatcher(link, [1])
    register(store, 1, sleeper.pid, "n1")

    def state() -> Any:
        return read_json(store, "member/1/state", STATE)

    watcher.poll()
    assert state() == {"nonce": "n1", "down": False}
    os.kill(sleeper.pid, 19)  # SIGSTOP
    deadline = time.monotonic() + 5
    while state()["down"] is False and time.monotonic() < deadline:
        watcher.poll()
    assert state() == {"nonce": "n1", "down": True}
    os.kill(sleeper.pid, 18)  # SIGCONT: running again
    while state()["down"] is True and time.monotonic() < deadline:
        watcher.poll()
    assert state() == {"nonce": "n1", "down": False}
    # Why the job stopped, for this machine's launcher to say.
    write_value(store, "stopped", "1 of 2 workers left")
    while not watcher.stopped and time.monotonic() < deadline:
        watcher.poll()
    assert watcher.stopped == "1 of 2 workers left"


class CountingStore:
    """A store that counts the calls made to it (the coordinator's load on the launcher)."""

    def __init__(self, store: Any) -> None:
        self.store, self.calls = store, 0

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.store, name)

        def call(*args: Any) -> Any:
            self.calls += 1
            return method(*args)

        return call


@pytest.mark.parametrize("members", [2, 8])
def test_a_steady_poll_reads_every_member_in_one_call(store: Any, members: int) -> None:
    # It made 5-7 calls per member every 10 ms: 0.119 of a core in the launcher at 4 members.
    counting = CountingStore(store)
    coordinator = Coordinator(counting, members, stale_s=3.0, hang_s=30.0)
    for m in range(members):
        register(store, m, os.getpid(), f"n{m}")
        ask(store, m, f"n{m}", -1)
    coordinator.poll()
    assert latest(store)["members"] == list(range(members))
    counting.calls = 0
    for _ in range(5):
        coordinator.poll()
    assert counting.calls == 5  # one multi_get a poll, whatever the number of members
    assert latest(store)["number"] == 0  # and nothing changed
