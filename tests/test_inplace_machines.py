"""``fault.recovery = 'inplace'`` across machines: what it cannot do is one line each, before
any worker starts (the trial itself, on namespace hosts: tests/test_inplace_hosts.py, slow)."""

from __future__ import annotations

from typing import Any

import pytest

from dtrain.cli.train import job_shape
from dtrain.config.job import validate_in_place_machines
from dtrain.dist import sealed_store
from dtrain.dist.store_link import StoreLink
from dtrain.dist.stores import host_store
from dtrain.errors import UserError
from dtrain.launch.options import make_options
from dtrain.recovery.coordinator import NodeWatcher
from dtrain.recovery.node_claim import claim_key, claim_node


def check(nnodes: str, node_rank: int | None, endpoint: str = "127.0.0.1:29400") -> None:
    opts = make_options(1, nnodes, node_rank, endpoint, 0, "job")
    validate_in_place_machines(job_shape(opts, nnodes, in_place=True))


def test_two_machines_with_node_ranks_are_accepted() -> None:
    check("2", 0)  # 127.0.0.1 is this machine's: node 0 hosts the coordinator there
    check("2", 1)


@pytest.mark.parametrize(
    ("nnodes", "node_rank", "endpoint", "words"),
    [
        ("1:2", 0, "127.0.0.1:29400", "--nnodes 1:2: fault.recovery = 'inplace' needs a fixed"),
        ("2", None, "127.0.0.1:29400", "needs --node-rank K on each"),
        ("2", 2, "127.0.0.1:29400", "--node-rank 2: must be below --nnodes 2 (0 .. 1)"),
        ("2", 0, "192.0.2.7:29400", "--rdzv-endpoint 192.0.2.7:29400 is not an address of"),
    ],
)
def test_what_cannot_work_is_one_line(
    nnodes: str, node_rank: int | None, endpoint: str, words: str
) -> None:
    with pytest.raises(UserError) as caught:
        check(nnodes, node_rank, endpoint)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_a_node_rank_another_live_launcher_runs_is_refused_and_a_dead_ones_taken_over() -> None:
    # Two machines with the same --node-rank started workers under the same member ids, each
    # overwriting the other's registration (it was not detected). The store is real; the
    # quiet interval is the test's own: during it, a live holder's watcher polls once.
    server: Any = host_store("127.0.0.1", 0, 10.0)
    first = StoreLink("127.0.0.1", server.port, call_s=2.0, patience_s=10.0)
    token = claim_node(first, 1, 2, sleep=fail_if_called)  # free: taken at once
    watcher = NodeWatcher(first, [], node=1)  # the first launcher's, polled by hand
    second = StoreLink("127.0.0.1", server.port, call_s=2.0, patience_s=10.0)
    with pytest.raises(UserError) as caught:
        claim_node(second, 1, 2, sleep=lambda _: watcher.poll())
    words = str(caught.value)
    assert f"--node-rank 1: the launcher on {token} runs that rank in this job already" in words
    assert "give each machine its own --node-rank (0 .. 1)" in words and "\n" not in words
    taken = claim_node(second, 1, 2, sleep=lambda _: None)  # nobody beat: the holder ended
    assert taken != token and sealed_store.read_text(server, claim_key(1)) == taken


def fail_if_called(seconds: float) -> None:
    raise AssertionError("a free rank is claimed without waiting")
