"""A stranger who reaches a store's port (torch's stores have no authentication) writes dtrain's
own keys: each forged, moved or malformed value is ignored -- the coordinator, a member, a
launcher and a rank act as if it were absent -- with one warning naming its key, and nothing
raises; the job's own sealed values still work. On real stores hosted in this process, the
members and ranks played by this process (as in test_membership.py and test_watchdog.py)."""

from __future__ import annotations

import datetime
import json
import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from dtrain.dist import sealed_store
from dtrain.dist.reachability import REACH, close_probe_listener, peers_checked
from dtrain.dist.runtime import NAMESPACE_ENV
from dtrain.dist.sealed_store import Opener
from dtrain.dist.secret import JobSecret
from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import host_store
from dtrain.errors import UserError
from dtrain.fault.peer_words import PeerWords
from dtrain.fault.watchdog import Watchdog
from dtrain.launch.launcher import check_shape
from dtrain.launch.options import make_options
from dtrain.recovery.coordinator import Coordinator, NodeWatcher
from dtrain.recovery.membership import Generation, Member, write_value
from dtrain.recovery.node_claim import claim_key, claim_node
from tests.ranks import free_port


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each key is warned about once per process: each test counts its own warnings.
    monkeypatch.setattr(sealed_store, "_warned", set())


@pytest.fixture
def store() -> Any:
    """The membership store (the launcher's), or a job's store (rank 0's)."""
    return host_store("127.0.0.1", 0, 10.0)


def client_of(store: Any) -> Any:
    return dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10)
    )


@pytest.fixture
def stranger(store: Any) -> Any:
    """A plain client of the same store: anyone who reaches its port."""
    return client_of(store)


@pytest.fixture
def job_store(store: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """``store`` as restart mode's job store: the ranks' watchdogs reach it at MASTER_ADDR."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)  # keys under dtrain/
    monkeypatch.delenv(NAMESPACE_ENV, raising=False)
    return store


def payload(raw: bytes) -> Any:
    """What a stranger reads in a value: sealed values are signed, not secret."""
    raw = bytes(raw)
    return json.loads(raw.split(b":", 2)[2] if raw.startswith(b"dtrain-hmac1:") else raw)


def warnings_of(err: str, key: str, why: str = sealed_store.FAILS_SEAL) -> int:
    """How many times ``err`` says the value at ``key`` was ignored."""
    return err.count(f"dtrain: warning: ignored the value of store key {key!r}: {why}\n")


def joined(members: list[Member], after: int) -> list[tuple[int, tuple[int, ...], str]]:
    """Each member's wait for a generation after ``after``: (number, members, stop)."""
    generations = [member.wait(after) for member in members]
    assert all(isinstance(g, Generation) for g in generations), generations
    return [(g.number, g.members, g.stop) for g in generations if g is not None]


def two_members(store: Any) -> tuple[Coordinator, list[Member]]:
    """A coordinator (polled by the test) and members 0 and 1, registered."""
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=30.0)
    address = f"127.0.0.1:{store.port}"
    return coordinator, [Member(address, m, 2, timeout_s=10.0) for m in (0, 1)]


def close(members: list[Member]) -> None:
    for member in members:
        member.close()


# -- the in-place membership store -------------------------------------------------------------


def test_a_stranger_s_stopped_does_not_end_the_job_at_the_next_failure(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=30.0, min_members=2)
    coordinator.start()
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 2, timeout_s=10.0) for m in (0, 1)]
    watcher = NodeWatcher(StoreLink("127.0.0.1", store.port, 5.0, 10.0), [1])
    try:
        for member in members:
            member.ask(-1, -1)
        assert joined(members, -1) == [(0, (0, 1), "")] * 2
        stranger.set("inplace/stopped", "the job stops, says a stranger")
        # An ordinary failure: both members' collective fails, both ask for a generation.
        for member in members:
            member.ask(0, 7)
        assert joined(members, 0) == [(1, (0, 1), "")] * 2
        assert [member.stopped() for member in members] == ["", ""]
        watcher.poll()  # another machine's launcher, which says why the job stopped
        assert watcher.stopped == coordinator.stopped == ""
    finally:
        close(members)
        coordinator.stop()
    assert warnings_of(capsys.readouterr().err, "inplace/stopped") == 1


def test_a_member_waiting_to_join_is_not_sent_away_by_a_forged_done_or_stopped(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    stranger.set("inplace/done", "1")
    stranger.set("inplace/stopped", "the job stops, says a stranger")
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=30.0)
    coordinator.start()
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 2, timeout_s=10.0) for m in (0, 1)]
    try:
        for member in members:
            member.ask(-1, -1)
        assert joined(members, -1) == [(0, (0, 1), "")] * 2
    finally:
        close(members)
        coordinator.stop()
    err = capsys.readouterr().err
    assert warnings_of(err, "inplace/done") == warnings_of(err, "inplace/stopped") == 1


def test_a_forged_generation_is_not_joined(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    coordinator, members = two_members(store)
    try:
        # The stranger reads member 0's nonce in the store and forges a generation of member 0
        # alone (without member 1, whose collectives would then hang on it).
        nonce = payload(stranger.get("inplace/member/0/info"))["nonce"]
        forged = {"members": [0], "nonces": [nonce], "left": [1], "joined": [], "stop": ""}
        stranger.set("inplace/gen/7", json.dumps({**forged, "spans": [[0, 0]], "asked_at": 0.0}))
        stranger.set("inplace/member/0/gen", json.dumps({"gen": 7, "nonce": nonce}))
        stranger.set("inplace/gen/latest", "7")
        for member in members:
            member.ask(-1, -1)
        assert members[0].wait(-1, give_up=lambda: True) is None  # nothing formed: nothing joined
        coordinator.poll()
        assert joined(members, -1) == [(0, (0, 1), "")] * 2
    finally:
        close(members)
    assert warnings_of(capsys.readouterr().err, "inplace/gen/latest") == 1


def test_a_proof_of_membership_moved_or_forged_lets_no_other_incarnation_join(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # A generation names each member's incarnation in that member's own sealed proof
    # (``member/<id>/gen``): member 0 restarted (a new incarnation) must not join generation 0,
    # which holds its old one, whatever a stranger copies or writes there.
    coordinator, members = two_members(store)
    address = f"127.0.0.1:{store.port}"
    again = None
    try:
        for member in members:
            member.ask(-1, -1)
        coordinator.poll()
        assert joined(members, -1) == [(0, (0, 1), "")] * 2
        again = Member(address, 0, 2, timeout_s=10.0)  # member 0 restarted
        again.ask(-1, -1)
        assert again.wait(-1, give_up=lambda: True) is None  # generation 0 holds the old one
        stranger.set("inplace/member/0/gen", stranger.get("inplace/member/1/gen"))  # moved
        assert again.wait(-1, give_up=lambda: True) is None
        stranger.set("inplace/member/0/gen", json.dumps({"gen": 0, "nonce": again.nonce}))
        assert again.wait(-1, give_up=lambda: True) is None
        assert warnings_of(capsys.readouterr().err, "inplace/member/0/gen") == 1
        # The coordinator takes the new incarnation in at the next generation, with its proof.
        members[1].ask(0, 3)
        coordinator.poll()
        assert joined([again, members[1]], 0) == [(1, (0, 1), "")] * 2
    finally:
        close([*members, *([again] if again else [])])


def test_the_coordinator_acts_on_no_forged_state_want_or_registration(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # Member 1 runs on another machine (per_node=1): its launcher posts its state there.
    coordinator = Coordinator(store, 2, stale_s=30.0, hang_s=30.0, local=[0], per_node=1)
    address = f"127.0.0.1:{store.port}"
    members = [Member(address, m, 2, timeout_s=10.0) for m in (0, 1)]
    try:
        for member in members:
            member.ask(-1, -1)
        coordinator.poll()
        assert joined(members, -1) == [(0, (0, 1), "")] * 2
        nonce = payload(stranger.get("inplace/member/1/info"))["nonce"]
        members[0].ask(0, 5)  # member 0's collective failed; member 1 (alive) is on its way
        forged = {
            "inplace/member/1/state": {"nonce": nonce, "down": True},  # "it is gone"
            "inplace/member/1/want": {"after": 0, "nonce": nonce, "step": 5},  # "it asks"
            "inplace/member/1/info": {"pid": os.getpid(), "host": "x", "nonce": "restarted"},
        }
        for key, value in forged.items():
            stranger.set(key, json.dumps(value))
            coordinator.poll()
            # Member 1 is still waited for: no generation without it, none of it asked.
            assert [g.number for g in coordinator.formed] == [0], key
        # A value of the job's, moved to another key, is no value there either.
        stranger.set("inplace/member/1/want", stranger.get("inplace/member/0/want"))
        coordinator.poll()
        assert [g.number for g in coordinator.formed] == [0]
        members[1].ask(0, 5)  # the member itself
        coordinator.poll()
        assert joined(members, 0) == [(1, (0, 1), "")] * 2
        assert coordinator.stopped == ""
    finally:
        close(members)
    err = capsys.readouterr().err
    assert [warnings_of(err, key) for key in forged] == [1, 1, 1]


def test_a_forged_claim_of_a_node_rank_is_replaced_at_once(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    stranger.set(claim_key(1), "a stranger's machine (pid 1, launcher 0)")
    link = StoreLink("127.0.0.1", store.port, call_s=2.0, patience_s=10.0)
    token = claim_node(link, 1, 2, sleep=no_wait)  # no launcher of the job holds it
    assert sealed_store.read_text(store, claim_key(1)) == token
    assert warnings_of(capsys.readouterr().err, claim_key(1)) == 1


def no_wait(seconds: float) -> None:
    raise AssertionError("a claim that fails its seal is waited on as a live launcher's")


def test_a_forged_shape_of_the_job_is_none(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    link = StoreLink("127.0.0.1", store.port, call_s=2.0, patience_s=10.0)
    stranger.set("inplace/nodes", json.dumps({"nnodes": 3, "nproc": 5}))
    opts = make_options(1, "2", 1, f"127.0.0.1:{store.port}", 0, "job", rdzv_timeout_s=1)
    with pytest.raises(UserError, match="no membership coordinator answered there within 1s"):
        check_shape(link, opts)  # not "the machine with --node-rank 0 runs --nnodes 3"
    write_value(store, "nodes", {"nnodes": 2, "nproc": 1})  # node 0's own
    check_shape(link, opts)
    assert warnings_of(capsys.readouterr().err, "inplace/nodes") == 1


def test_without_a_secret_values_stay_plain_and_a_malformed_one_is_still_ignored(
    store: Any, stranger: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A worker of plain torchrun, started without the job's secret.
    monkeypatch.delenv("DTRAIN_JOB_SECRET")
    monkeypatch.delenv("DTRAIN_JOB_SECRET_FILE", raising=False)
    coordinator = Coordinator(store, 1, stale_s=30.0, hang_s=30.0)
    member = Member(f"127.0.0.1:{store.port}", 0, 1, timeout_s=10.0)
    try:
        assert payload(stranger.get("inplace/member/0/info"))["nonce"] == member.nonce
        assert not bytes(stranger.get("inplace/member/0/info")).startswith(b"dtrain-hmac1:")
        stranger.set("inplace/member/0/want", b"\xff{ not json")
        stranger.set("inplace/gen/latest", "zero")
        coordinator.poll()  # neither raises nor forms a generation
        assert member.wait(-1, give_up=lambda: True) is None
        member.ask(-1, -1)
        coordinator.poll()
        assert joined([member], -1) == [(0, (0,), "")]
    finally:
        member.close()
    err = capsys.readouterr().err
    assert warnings_of(err, "inplace/member/0/want", "it is malformed (not text)") == 1
    assert warnings_of(err, "inplace/gen/latest", "it is malformed (not JSON)") == 1


# -- restart mode's job store ------------------------------------------------------------------


def test_a_forged_failure_or_heartbeat_names_no_rank(
    job_store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    watchdog = Watchdog(0, 2, heartbeat_s=1.0, timeout_s=5.0)
    forged = {"host": "x", "pid": 1, "step": 3, "phase": "data", "error": "RuntimeError: forged"}
    stranger.set("dtrain/watchdog/failed/1", json.dumps(forged))
    stranger.append("dtrain/watchdog/failed", "1,99999,")
    beat = {"rank": 1, "host": "x", "pid": 1, "attempt": 0, "world_size": 2, "step": 3}
    stranger.set("dtrain/watchdog/hb/1", json.dumps(beat))
    assert watchdog.failures() == {}
    assert watchdog.peers() == {1: None}
    assert watchdog.diagnose() == "rank 1 never checked in"
    peer = Watchdog(1, 2, heartbeat_s=1.0, timeout_s=5.0)  # rank 1 itself
    peer.set_phase("forward_backward", 4)
    peer.report_failure(RuntimeError("its own"))
    assert watchdog.failures()[1]["error"] == "RuntimeError: its own"
    err = capsys.readouterr().err
    assert warnings_of(err, "dtrain/watchdog/failed/1") == 1
    assert warnings_of(err, "dtrain/watchdog/hb/1") == 1


class ThenCall:
    """A store client that calls ``then()`` right after its first read of ``key`` (a ``get`` of
    it, or a ``multi_get`` among others)."""

    def __init__(self, store: Any, key: str, then: Callable[[], Any]) -> None:
        self._store, self._key, self._then = store, key, then

    def get(self, key: str) -> Any:
        value = self._store.get(key)
        self._after([key])
        return value

    def multi_get(self, keys: list[str]) -> Any:
        values = self._store.multi_get(keys)
        self._after(keys)
        return values

    def _after(self, keys: list[str]) -> None:
        if self._key in keys and self._then is not None:
            then, self._then = self._then, None
            then()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def test_a_forged_word_or_verdict_is_no_word(
    job_store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = [Watchdog(rank, 2, heartbeat_s=1.0, timeout_s=30.0) for rank in (0, 1)]
    prefix = "dtrain/words/resume/"
    key, verdict = f"{prefix}1", f"{prefix}verdict"
    # Rank 1's word on its share of the checkpoint, forged and counted as posted (so rank 0,
    # the collector, reads it), and the verdict every other rank waits for, forged.
    stranger.set(key, "torn")
    stranger.add(f"{prefix}posted", 1)
    stranger.set(verdict, json.dumps({"words": ["torn", "torn"]}))
    # Rank 1 says its own word once rank 0 has read the forged one, and rank 0 goes on once
    # rank 1 has read the forged verdict.
    theirs: list[list[str]] = []
    read_forged = threading.Event()
    assert ranks[1].store is not None
    ranks[1].store._client = ThenCall(ranks[1].store.client, verdict, read_forged.set)
    rank1 = threading.Thread(
        target=lambda: theirs.append(PeerWords(ranks[1]).gather("resume", "whole", "the check"))
    )

    def then() -> None:
        rank1.start()
        assert read_forged.wait(30)

    assert ranks[0].store is not None
    ranks[0].store._client = ThenCall(ranks[0].store.client, key, then)
    assert PeerWords(ranks[0]).gather("resume", "whole", "the check") == ["whole", "whole"]
    rank1.join(30)
    assert theirs == [["whole", "whole"]]
    err = capsys.readouterr().err
    assert warnings_of(err, key) == 1
    assert warnings_of(err, verdict) == 1


def test_a_forged_address_or_failure_does_not_stop_the_job_s_start(
    job_store: Any,
    stranger: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # the ranks' collectives on loopback
    # One rank: a stranger's failure and "all" before its check.
    one = "dtrain/attempt_0/"
    stranger.set(f"{one}reach//failed", "rank 1: a stranger says the job cannot start")
    stranger.set(f"{one}reach//all", "1")
    reach = dist.PrefixStore(one + REACH, job_store)  # type: ignore[attr-defined]
    with peers_checked(reach, 0, 1, "gloo", 5.0, False, namespace=one):
        pass
    # Two ranks: rank 1's address forged (a port nobody listens on) before rank 1 publishes
    # its own, which it does once rank 0 has read the forged one.
    two = "dtrain/attempt_1/"
    forged = {"addr": "127.0.0.1", "port": free_port(), "host": "a stranger"}
    stranger.set(f"{two}reach//1", json.dumps(forged))
    errors: list[BaseException] = []

    def rank1() -> None:
        try:
            own = client_of(job_store)  # each rank has its own connection
            store = dist.PrefixStore(two + REACH, own)  # type: ignore[attr-defined]
            with peers_checked(store, 1, 2, "gloo", 5.0, False, namespace=two):
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=rank1)
    reach = ThenCall(dist.PrefixStore(two + REACH, job_store), "1", thread.start)  # type: ignore[attr-defined]
    try:
        with peers_checked(reach, 0, 2, "gloo", 5.0, False, namespace=two):
            pass
    finally:
        if thread.ident is not None:
            thread.join(30)
        close_probe_listener()
    assert errors == []
    err = capsys.readouterr().err
    assert warnings_of(err, f"{one}reach//failed") == warnings_of(err, f"{two}reach//1") == 1


def test_a_value_moved_to_another_key_is_ignored(
    store: Any, stranger: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    sealed_store.put(store, "inplace/gen/latest", "3")
    stranger.set("inplace/pending", stranger.get("inplace/gen/latest"))
    assert sealed_store.read_text(store, "inplace/gen/latest") == "3"
    assert sealed_store.read_text(store, "inplace/pending") is None
    assert sealed_store.read_text(store, "inplace/pending") is None
    assert warnings_of(capsys.readouterr().err, "inplace/pending") == 1  # once


def test_shapes() -> None:
    generation = {"members": [0, 1], "nonces": ["a", "b"], "stop": ""}
    shape = {"members": [int], "nonces": [str], "stop": str}
    assert sealed_store.fits(generation, shape)
    assert sealed_store.fits({**generation, "extra": 1}, shape)
    assert not sealed_store.fits({**generation, "members": ["0"]}, shape)
    assert not sealed_store.fits({"members": [0], "nonces": []}, shape)  # "stop" missing
    assert not sealed_store.fits({"down": 1}, {"down": bool})
    assert not sealed_store.fits({"pid": True}, {"pid": int})
    assert sealed_store.fits({"asked_at": 0}, {"asked_at": float})
    assert not sealed_store.fits([1], {"a": int})


def test_an_opener_checks_each_value_s_seal_once_and_keeps_the_last_good_one(
    store: Any, stranger: Any, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The coordinator reads every member's records again and again: a value is checked when it
    # first appears at its key (one HMAC each when all members ask at once), never again.
    checked: list[str] = []
    unseal = JobSecret.unseal

    def counted(self: JobSecret, name: str, sealed: bytes) -> bytes | None:
        checked.append(name)
        return unseal(self, name, sealed)

    monkeypatch.setattr(JobSecret, "unseal", counted)
    opener = Opener()
    key, shape = "inplace/member/0/want", {"after": int}
    write_value(store, "member/0/want", {"after": 0})
    for _ in range(3):
        assert opener.read_json(store, key, shape) == {"after": 0}
    assert checked == [key]
    write_value(store, "member/0/want", {"after": 1})
    assert [opener.read_json(store, key, shape) for _ in range(2)] == [{"after": 1}] * 2
    assert checked == [key] * 2
    stranger.set(key, json.dumps({"after": 9}))  # a forgery: the last good value stands
    assert [opener.read_json(store, key, shape) for _ in range(2)] == [{"after": 1}] * 2
    assert checked == [key] * 3
    assert warnings_of(capsys.readouterr().err, key) == 1
