"""``fault.recovery = 'inplace'`` across machines: what it cannot do is one line each, before
any worker starts (the trial itself, on namespace hosts: tests/test_inplace_hosts.py, slow)."""

from __future__ import annotations

import pytest

from dtrain.errors import UserError
from dtrain.launch import make_options
from dtrain.launch_inplace import check_machines


def check(nnodes: str, node_rank: int | None, endpoint: str = "127.0.0.1:29400") -> None:
    opts = make_options(1, nnodes, node_rank, endpoint, 0, "job")
    check_machines(opts, nnodes)


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
