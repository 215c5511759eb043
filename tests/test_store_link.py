"""dtrain.dist.store_link: the one bounded client of a job's store. With patience (the
membership's) it rides through the store being out of reach (here: its server closed, then
opened again on the same port) and gives up, naming it, after its patience; without (the
watchdog's) it raises the call's own error and reconnects on the next call. The patience is
counted on a clock the tests drive: nothing here sleeps."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from dtrain.dist.store_link import (
    REFUSED_S,
    StoreLink,
    StoreTimeout,
    StoreUnreachable,
    in_store_calls,
)
from dtrain.dist.stores import host_store
from dtrain.launch.agent import held_port


class Clock:
    """Monotonic time that passes only when the link waits between attempts."""

    def __init__(self) -> None:
        self.now = 0.0
        self.waits = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.waits += 1
        self.now += seconds


def read(store: Any) -> bytes:
    return bytes(store.get("k"))


def test_a_call_waits_out_an_outage_on_a_fresh_connection() -> None:
    retrying, back = threading.Event(), threading.Event()

    def sleep(_seconds: float) -> None:  # the link waits to try again: the store comes back
        retrying.set()
        assert back.wait(30)

    with held_port() as port:  # no one else takes it while the store is away (dtrain.launch.agent)
        server: Any = host_store("127.0.0.1", port, 10.0)
        link = StoreLink("127.0.0.1", port, call_s=2.0, patience_s=30.0, sleep=sleep)
        link.call(lambda s: s.set("k", "1"), "a set")
        del server  # the store is gone (its server closed): calls fail until it is back
        got: list[bytes] = []
        caller = threading.Thread(target=lambda: got.append(link.call(read, "a get")))
        caller.start()
        assert retrying.wait(30)
        assert caller.is_alive() and not got  # still trying
        server = host_store("127.0.0.1", port, 10.0)
        server.set("k", "2")
        back.set()
        caller.join(30)
    assert got == [b"2"] and link.outages >= 1


def test_a_store_that_never_answers_is_named_after_the_patience() -> None:
    clock = Clock()
    with held_port() as port, pytest.raises(StoreUnreachable) as caught:  # nothing listens
        StoreLink("127.0.0.1", port, 1.0, 0.3, clock=clock, sleep=clock.sleep)
    assert f"127.0.0.1:{port} did not answer for 0.3s" in str(caught.value)
    assert 0.3 <= clock.now < 0.3 + 0.2 + 1e-9  # one wait past the patience at most


def test_a_store_whose_address_refuses_connections_is_gone_within_seconds() -> None:
    clock = Clock()
    # Nothing listens there: its launcher has ended.
    with held_port() as port, pytest.raises(StoreUnreachable) as caught:
        StoreLink("127.0.0.1", port, 1.0, 900.0, clock=clock, sleep=clock.sleep)
    assert REFUSED_S <= clock.now < REFUSED_S + 0.2 + 1e-9  # not the whole patience
    assert str(caught.value).startswith(
        f"lost the membership coordinator at 127.0.0.1:{port}: it refuses connections"
    )


def test_without_patience_a_call_raises_its_own_error_and_the_next_one_reconnects() -> None:
    server = host_store("127.0.0.1", 0, 10.0)
    link = StoreLink("127.0.0.1", server.port, call_s=2.0, patience_s=0.0)
    before = link.client
    release = threading.Event()
    try:
        with pytest.raises(StoreTimeout, match="no answer to a stuck call in 0s"):
            link.call(lambda s: release.wait(30), "a stuck call", seconds=0.05)
    finally:
        release.set()
    assert link.outages == 1
    link.call(lambda s: s.set("k", "3"), "a set")  # on a fresh connection
    assert link.client is not before and link.read("k") is None  # unsealed: no record
    assert read(server) == b"3"


def test_without_patience_a_store_gone_is_a_connection_error_naming_it() -> None:
    with held_port() as port:
        server: Any = host_store("127.0.0.1", port, 10.0)
        link = StoreLink("127.0.0.1", port, 2.0, 0.0, name="the job's key-value store")
        link.call(lambda s: s.set("k", "1"), "a set")
        del server  # its address refuses connections from here on
        with pytest.raises(Exception):  # noqa: B017 (torch's own error: its words vary)
            link.call(read, "a get")
        with pytest.raises(ConnectionError, match=f"the job's key-value store at 127.0.0.1:{port}"):
            link.call(read, "a get")
    assert link.outages == 1  # the second was refused before any call was made


def test_silence_counts_from_the_first_call_left_unanswered_by_any_thread() -> None:
    # A diagnosis counts how long the store has not answered from the first call that went
    # unanswered since the last answer, whichever thread made it (the watchdog's own reads).
    clock = Clock()
    server = host_store("127.0.0.1", 0, 10.0)
    link = StoreLink("127.0.0.1", server.port, call_s=2.0, patience_s=0.0, clock=clock)
    link.call(lambda s: s.set("k", "1"), "a set")
    assert link.silent_s() == 0.0
    release = threading.Event()
    try:
        clock.now = 10.0
        with pytest.raises(StoreTimeout):
            link.call(lambda s: release.wait(30), "a stuck call", seconds=0.05)
        clock.now = 12.5  # another call, later, unanswered too: the silence began at 10
        with pytest.raises(StoreTimeout):
            link.call(lambda s: release.wait(30), "a stuck call", seconds=0.05)
        clock.now = 13.0
        assert link.silent_s() == 3.0
    finally:
        release.set()
    link.call(read, "a get")  # answered: no silence since
    assert link.silent_s() == 0.0


def test_a_link_makes_its_calls_on_one_thread_and_replaces_it_when_a_call_is_stuck() -> None:
    # A thread started for every call cost each about 50 us of CPU and two more hand-offs of
    # the interpreter's lock: with every rank of a process diagnosing at once, those starved
    # the ranks' own beats. The calls run on one thread of the link's, which a process's exit
    # does not wait for (in_store_calls); one stuck past its bound is left, and replaced.
    server = host_store("127.0.0.1", 0, 10.0)
    link = StoreLink("127.0.0.1", server.port, call_s=2.0, patience_s=0.0)
    ran_on = {link.call(lambda s: (s.add("n", 1), threading.current_thread())[1], "an add")}
    for _ in range(50):
        ran_on.add(link.call(lambda s: (s.add("n", 1), threading.current_thread())[1], "an add"))
    assert len(ran_on) == 1 and threading.current_thread() not in ran_on
    (caller,) = ran_on
    assert caller.name == "dtrain-store-call" and caller in in_store_calls()
    assert int(server.add("n", 0)) == 51
    release = threading.Event()
    try:
        with pytest.raises(StoreTimeout):
            link.call(lambda s: release.wait(30), "a stuck call", seconds=0.05)
        after = link.call(lambda s: threading.current_thread(), "a look")
        assert after is not caller and caller.is_alive()  # still in the stuck call
    finally:
        release.set()
    caller.join(30)
    assert not caller.is_alive() and caller not in in_store_calls()  # ended after its call
