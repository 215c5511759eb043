"""dtrain.recovery.coordinator_link: a client of the membership store that rides through the
store being out of reach (here: its server closed, then opened again on the same port), and
gives up, naming it, after its patience."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from dtrain.dist.stores import host_store
from dtrain.launch.agent import held_port
from dtrain.recovery import coordinator_link
from dtrain.recovery.coordinator_link import StoreLink, StoreUnreachable


def test_a_call_waits_out_an_outage_on_a_fresh_connection() -> None:
    with held_port() as port:  # no one else takes it while the store is away (dtrain.launch.agent)
        server: Any = host_store("127.0.0.1", port, 10.0)
        link = StoreLink("127.0.0.1", port, call_s=2.0, patience_s=30.0)
        link.call(lambda s: s.set("k", "1"), "a set")
        del server  # the store is gone (its server closed): calls fail until it is back
        got: list[bytes] = []
        caller = threading.Thread(target=lambda: got.append(link.call(read, "a get")))
        caller.start()
        time.sleep(0.5)
        assert caller.is_alive()  # still trying
        server = host_store("127.0.0.1", port, 10.0)
        server.set("k", "2")
        caller.join(20)
    assert got == [b"2"] and link.outages >= 1


def read(store: Any) -> bytes:
    return bytes(store.get("k"))


def test_a_store_that_never_answers_is_named_after_the_patience() -> None:
    with held_port() as port:  # nothing listens there
        started = time.monotonic()
        with pytest.raises(StoreUnreachable, match=f"127.0.0.1:{port} did not answer for 0.3s"):
            StoreLink("127.0.0.1", port, call_s=1.0, patience_s=0.3)
    assert time.monotonic() - started < 10


def test_a_store_whose_address_refuses_connections_is_gone_within_seconds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coordinator_link, "REFUSED_S", 0.5)  # 5 s in a job
    with held_port() as port:  # nothing listens there: its launcher has ended
        started = time.monotonic()
        with pytest.raises(StoreUnreachable) as caught:
            StoreLink("127.0.0.1", port, call_s=1.0, patience_s=900.0)
    assert time.monotonic() - started < 5
    assert str(caught.value).startswith(
        f"lost the membership coordinator at 127.0.0.1:{port}: it refuses connections"
    )
