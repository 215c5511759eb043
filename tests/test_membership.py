"""The membership coordinator of ``fault.recovery = 'inplace'`` on a real store, members played
by this process: their processes' states (alive, ended, stopped) and the time that passes are
what the test says (:class:`Processes`, :class:`Clock`), not real processes and sleeps; and
members as threads of this process running the worker's side of the protocol. One test reads a
real stopped process in /proc, one a launcher posting its real worker down and up again."""

from __future__ import annotations

import os
import subprocess
import threading
from typing import Any

import pytest

from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import host_store
from dtrain.process_exit import process_state
from dtrain.recovery.changes import BATCH
from dtrain.recovery.coordinator import Coordinator, NodeWatcher
from dtrain.recovery.membership import (
    CUT,
    GENERATION,
    PREFIX,
    PROOF,
    STATE,
    Generation,
    Member,
    members_in,
    post,
    read_json,
    read_text,
    write_value,
)
from dtrain.recovery.node_claim import alive_key


class Clock:
    """The coordinator's monotonic time: it passes when the test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Processes:
    """Local processes' states as the tests play them: every pid runs until it is ended."""

    def __init__(self) -> None:
        self.ended: set[int] = set()

    def __call__(self, pid: int) -> str:
        return "X" if pid in self.ended else "R"


@pytest.fixture
def store() -> Any:
    return host_store("127.0.0.1", 0, 30.0)


def coordinator_on(
    store: Any,
    members: int,
    clock: Clock | None = None,
    processes: Processes | None = None,
    **kw: Any,
) -> Coordinator:
    kw.setdefault("stale_s", 3.0)
    kw.setdefault("hang_s", 30.0)
    return Coordinator(
        store, members, clock=clock or Clock(), state_of=processes or Processes(), **kw
    )


def register(store: Any, member: int, pid: int, nonce: str) -> None:
    info = {"pid": pid, "host": "here", "nonce": nonce}
    write_value(store, f"member/{member}/info", info)


def ask(store: Any, member: int, nonce: str, after: int, step: int = -1) -> None:
    want = {"after": after, "nonce": nonce, "step": step}
    write_value(store, f"member/{member}/want", want)


def polls_to_form(coordinator: Coordinator, count: int) -> int:
    """How many polls until the coordinator has formed ``count`` generations (at most 100)."""
    for polls in range(1, 101):
        coordinator.poll()
        if len(coordinator.formed) >= count:
            return polls
    raise AssertionError(f"{len(coordinator.formed)} generations formed after 100 polls")


def latest(store: Any) -> dict[str, Any] | None:
    """The newest generation as the coordinator formed it: its record, its members' ids, and
    the incarnation of each that it holds (from each member's proof, which names it)."""
    if not store.check([f"{PREFIX}gen/latest"]):
        return None
    number = read_json(store, "gen/latest", int)
    record: dict[str, Any] = read_json(store, f"gen/{number}", GENERATION)
    members = list(members_in(record.pop("spans")))
    proofs = [read_json(store, f"member/{m}/gen", PROOF) for m in members]
    assert all(proof["gen"] == number for proof in proofs), proofs
    nonces = [proof["nonce"] for proof in proofs]
    return {"number": number, "members": members, "nonces": nonces, **record}


def two_members(store: Any, coordinator: Coordinator) -> None:
    """Generation 0 = members 0 (process 100) and 1 (process 101)."""
    for member in (0, 1):
        register(store, member, 100 + member, f"n{member}")
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


def test_a_member_reads_the_same_few_bytes_of_a_generation_at_any_size() -> None:
    # A generation's record names its members as runs of ids, and each member's incarnation
    # is in the member's own proof: what a member reads of a regroup does not grow with the
    # members (it read every member's id and nonce: 59 kB each at 4,096 members).
    read = {}
    for members in (2, 256):
        store = host_store("127.0.0.1", 0, 30.0)
        processes = Processes()
        coordinator = coordinator_on(store, members, processes=processes)
        for m in range(members):  # posted as members post (the coordinator reads the log)
            post(store, m, "info", {"pid": 100 + m, "host": "here", "nonce": f"n{m}"})
            post(store, m, "want", {"after": -1, "nonce": f"n{m}", "step": -1})
        # Read BATCH posted records a poll: 2 x 256 of them in four polls, the asks in two.
        assert polls_to_form(coordinator, 1) == -(-2 * members // BATCH)
        processes.ended.add(100)  # member 0 ends: the others regroup without it
        for m in range(1, members):
            post(store, m, "want", {"after": 0, "nonce": f"n{m}", "step": 5})
        assert polls_to_form(coordinator, 2) == -(-(members - 1) // BATCH)
        gen = latest(store)
        assert (gen["number"], gen["members"], gen["left"]) == (1, list(range(1, members)), [0])
        assert gen["nonces"] == [f"n{m}" for m in range(1, members)]
        keys = [f"{PREFIX}gen/1", f"{PREFIX}member/1/gen"]
        read[members] = sum(len(store.get(key)) for key in keys)
    assert 0 <= read[256] - read[2] <= 4, read  # the last id's digits ("1" to "255")


def test_the_first_generation_waits_for_every_member(store: Any) -> None:
    coordinator = coordinator_on(store, 2)
    register(store, 0, 100, "n0")
    ask(store, 0, "n0", -1)
    coordinator.poll()
    assert latest(store) is None
    two_members(store, coordinator)


def test_a_dead_member_is_left_out_once_the_survivor_asks(store: Any) -> None:
    processes = Processes()
    coordinator = coordinator_on(store, 2, processes=processes)
    two_members(store, coordinator)
    processes.ended.add(100)  # member 0's process ends (kill -9)
    coordinator.poll()
    assert latest(store)["number"] == 0  # the survivor has not asked yet
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["left"], gen["joined"]) == (1, [1], [0], [])
    assert gen["asked_at"] > 0


def test_a_restarted_member_joins_the_survivor_at_its_next_step(store: Any) -> None:
    processes = Processes()
    coordinator = coordinator_on(store, 2, processes=processes)
    two_members(store, coordinator)
    processes.ended.add(100)
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    assert latest(store)["members"] == [1]
    # Member 0 restarted: a new incarnation (nonce) asks to join; the survivor trains on, is
    # told to regroup after its next step (``pending``), and asks.
    register(store, 0, 102, "n0-again")
    ask(store, 0, "n0-again", -1)
    coordinator.poll()
    assert read_text(store, "pending") == "1"
    assert latest(store)["number"] == 1
    ask(store, 1, "n1", after=1, step=9)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["nonces"]) == (2, [0, 1], ["n0-again", "n1"])
    assert (gen["left"], gen["joined"]) == ([], [0])


def test_a_member_restarted_before_the_others_noticed_both_left_and_joined(store: Any) -> None:
    processes = Processes()
    coordinator = coordinator_on(store, 2, processes=processes)
    two_members(store, coordinator)
    register(store, 0, 102, "n0-again")  # back before member 1's collective failed
    ask(store, 0, "n0-again", -1)
    ask(store, 1, "n1", after=0, step=7)
    coordinator.poll()
    gen = latest(store)
    assert (gen["number"], gen["members"], gen["nonces"]) == (1, [0, 1], ["n0-again", "n1"])
    assert (gen["left"], gen["joined"]) == ([0], [0])


def test_fewer_survivors_than_min_members_form_a_last_generation_that_stops(store: Any) -> None:
    processes = Processes()
    coordinator = coordinator_on(store, 2, processes=processes, min_members=2)
    two_members(store, coordinator)
    processes.ended.add(100)
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
    clock = Clock()
    coordinator = coordinator_on(store, 2, clock, hang_s=0.3)
    two_members(store, coordinator)
    ask(store, 1, "n1", after=0)
    coordinator.poll()
    assert latest(store)["number"] == 0  # member 0 alive: waited for
    clock.now += 0.29
    coordinator.poll()
    assert latest(store)["number"] == 0  # still within hang_s
    clock.now += 0.02
    coordinator.poll()
    assert latest(store)["members"] == [1]


def test_a_stopped_process_counts_as_gone() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert process_state(proc.pid) not in ("T", "t", "X", "Z")
        os.kill(proc.pid, 19)  # SIGSTOP
        os.waitpid(proc.pid, os.WUNTRACED)  # returns once it has stopped
        assert process_state(proc.pid) in ("T", "t")
    finally:
        proc.kill()
        proc.wait()
    assert process_state(proc.pid) == "X"


def test_members_wait_for_the_generation_that_holds_them(store: Any) -> None:
    coordinator = Coordinator(store, 2, stale_s=3.0, hang_s=30.0)  # its own thread, real time
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
    # posts its state. Its machine is heard (stale_s is long): only the posted state counts.
    coordinator = coordinator_on(store, 2, stale_s=30.0, local=[0], per_node=1)
    two_members(store, coordinator)
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
    clock = Clock()
    coordinator = coordinator_on(store, 4, clock, stale_s=0.2, local=[0, 1], per_node=2)
    for member in range(4):
        register(store, member, 100 + member, f"n{member}")
        ask(store, member, f"n{member}", -1)
    coordinator.poll()
    assert latest(store)["members"] == [0, 1, 2, 3]
    clock.now += 0.3
    store.add(alive_key(1), 1)  # machine 1's launcher still answers
    coordinator.poll()
    assert not store.check([f"{PREFIX}cut"])
    clock.now += 0.3  # and now has fallen silent for longer than stale_s
    # A launcher that posts a worker down still answers: not cut off (the timeout applies).
    write_value(store, "member/3/state", {"nonce": "n3", "down": True})
    coordinator.poll()
    assert not store.check([f"{PREFIX}cut"])
    write_value(store, "member/3/state", {"nonce": "n3", "down": False})
    coordinator.poll()
    assert read_json(store, "cut", CUT) == {"gen": 0, "members": [2, 3]}
    # Its members are gone for the next generation too, once the others ask.
    ask(store, 0, "n0", after=0, step=5)
    ask(store, 1, "n1", after=0, step=5)
    coordinator.poll()
    assert (latest(store)["number"], latest(store)["members"]) == (1, [0, 1])


def test_a_member_hears_of_a_machine_cut_off_with_the_addresses(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DTRAIN_NODE_ADDR", "10.81.0.1")
    member = Member(f"127.0.0.1:{store.port}", 0, 2, timeout_s=10.0, local=(0, 1))
    heard: list[tuple[int, list[int], dict[int, str]]] = []
    member.on_cut = lambda gen, cut, addresses: heard.append((gen, cut, addresses))
    try:
        member.look()
        assert heard == [] and member.pending == -1  # nothing to hear yet
        info = {"pid": 1, "host": "there", "nonce": "n1", "addr": "10.81.0.2"}
        write_value(store, "member/1/info", info)
        write_value(store, "cut", {"gen": 3, "members": [1]})
        write_value(store, "pending", "3")
        member.look()
        assert heard == [(3, [1], {0: "10.81.0.1", 1: "10.81.0.2"})]
        assert member.pending == 3
        member.look()
        assert len(heard) == 1  # told once
    finally:
        member.close()


@pytest.fixture
def sleeper() -> Any:
    """A real process to play a worker on another machine (stopped, continued)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_launcher_posts_its_workers_down_and_up_again(store: Any, sleeper: Any) -> None:
    link = StoreLink("127.0.0.1", store.port, call_s=5.0, patience_s=10.0)
    clock = Clock()
    watcher = NodeWatcher(link, [1], node=1, clock=clock)
    register(store, 1, sleeper.pid, "n1")

    def state() -> Any:
        return read_json(store, "member/1/state", STATE)

    watcher.poll()
    assert state() == {"nonce": "n1", "down": False}
    assert int(store.add(alive_key(1), 0)) == 1  # the machine's voice, for the coordinator
    os.kill(sleeper.pid, 19)  # SIGSTOP
    os.waitpid(sleeper.pid, os.WUNTRACED)  # it has stopped
    watcher.poll()
    assert state() == {"nonce": "n1", "down": True}
    os.kill(sleeper.pid, 18)  # SIGCONT: running again
    os.waitpid(sleeper.pid, os.WCONTINUED)
    watcher.poll()
    assert state() == {"nonce": "n1", "down": False}
    # Why the job stopped, for this machine's launcher to say (its members' records and the
    # job's state are read at most twice a second while its workers run).
    write_value(store, "stopped", "1 of 2 workers left")
    watcher.poll()
    assert watcher.stopped == ""
    clock.now += 0.6
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
    coordinator = coordinator_on(counting, members)
    for m in range(members):
        register(store, m, 100 + m, f"n{m}")
        ask(store, m, f"n{m}", -1)
    coordinator.poll()
    assert latest(store)["members"] == list(range(members))
    counting.calls = 0
    for _ in range(5):
        coordinator.poll()
    assert counting.calls == 5  # one multi_get a poll, whatever the number of members
    assert latest(store)["number"] == 0  # and nothing changed


def test_members_as_threads_go_on_without_a_lost_one_and_take_it_back(store: Any) -> None:
    """The worker's side of the protocol, three members as threads against the coordinator's
    thread: generation 0 holds all; member 2 is lost (its launcher posts it down) and the two
    survivors, asking after 0, get generation 1 without it; member 2 restarted asks to join,
    the survivors hear ``pending`` at their next look and ask: generation 2 holds all three,
    the survivors as they were, the restarted one joined."""
    # Three machines of one worker each: each member's liveness is its launcher's word
    # (member/<id>/state) and its machine's voice, heard for the whole test (the clock stands).
    coordinator = coordinator_on(store, 3, local=[], per_node=1)
    coordinator.start()
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 3, timeout_s=10.0, local=(0, 1)) for m in range(3)]
    got: dict[int, list[Generation | None]] = {m: [] for m in range(3)}

    def life(member: Member, after: int, step: int) -> None:
        member.ask(after, step)
        got[member.id].append(member.wait(after))

    def together(lives: list[tuple[Member, int, int]]) -> None:
        threads = [threading.Thread(target=life, args=args) for args in lives]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in threads)

    restarted: Member | None = None
    try:
        together([(member, -1, -1) for member in members])
        assert [g.members if g else None for m in range(3) for g in got[m]] == [(0, 1, 2)] * 3
        write_value(store, "member/2/state", {"nonce": members[2].nonce, "down": True})
        together([(members[0], 0, 7), (members[1], 0, 7)])
        first = got[0][-1]
        assert first is not None and got[1][-1] == first
        assert (first.number, first.members, first.left, first.joined) == (1, (0, 1), (2,), ())
        # Member 2 runs again, a new incarnation; it waits until the survivors regroup.
        restarted = Member(address, 2, 3, timeout_s=10.0, local=(0, 1))
        joiner = threading.Thread(target=life, args=(restarted, -1, -1))
        joiner.start()
        heard = threading.Event()

        def survivor(member: Member) -> None:
            while member.pending != 1:  # a look at every step, as the watchdog's thread does
                member.look()
            heard.set()
            life(member, 1, 9)

        survivors = [threading.Thread(target=survivor, args=(m,)) for m in members[:2]]
        for thread in survivors:
            thread.start()
        assert heard.wait(30)
        for thread in [*survivors, joiner]:
            thread.join(30)
        second = got[2][-1]
        assert second is not None and got[0][-1] == got[1][-1] == second
        assert (second.number, second.members, second.left, second.joined) == (
            2,
            (0, 1, 2),
            (),
            (2,),
        )
    finally:
        coordinator.stop()
        for member in [*members, *([restarted] if restarted else [])]:
            member.close()
