"""The JSON collectives (``dtrain.comm.plain``) on 2 real ranks over gloo: unequal lengths,
non-ASCII text, empty values, a chosen source, destination and group; and no dtrain module
left that sends a pickle between the ranks through torch's ``*_object`` collectives."""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist

from dtrain.comm.plain import (
    all_gather_json,
    broadcast_json,
    dtype_named,
    gather_json,
    gather_tensors,
)
from tests.conftest import REPO
from tests.ranks import run_ranks

# Rank 0's value is short, rank 1's long and not ASCII, so padding and decoding both matter.
VALUES: list[Any] = [
    [],
    {"host": "nœud-1 ✓ 日本語", "ranks": [1, 2, 3], "ok": True, "none": None, "x": 1.5},
]


def exchange() -> dict[str, Any]:
    rank = dist.get_rank()
    pair = dist.new_group(ranks=[0, 1], backend="gloo")
    return {
        "all": all_gather_json(VALUES[rank]),
        "all_in_group": all_gather_json(VALUES[1 - rank], group=pair),
        "empty": all_gather_json([]),
        "text": all_gather_json("é" * (rank * 1000)),
        "gather_to_1": gather_json(VALUES[rank], dst=1),
        "gather_to_0": gather_json(rank, dst=0, group=pair),
        "from_1": broadcast_json(VALUES[1] if rank == 1 else "not read", src=1),
        "from_0": broadcast_json(["ü", (1, 2)] if rank == 0 else None, src=0, group=pair),
        "nan": all_gather_json(float("nan") if rank else float("inf")),
    }


def test_values_cross_as_json_with_any_length_and_text() -> None:
    results = run_ranks(exchange, 2)
    for rank, got in enumerate(results):
        assert got["all"] == VALUES
        assert got["all_in_group"] == VALUES[::-1]
        assert got["empty"] == [[], []]
        assert got["text"] == ["", "é" * 1000]
        assert got["gather_to_1"] == (VALUES if rank == 1 else None)
        assert got["gather_to_0"] == ([0, 1] if rank == 0 else None)
        assert got["from_1"] == VALUES[1]
        assert got["from_0"] == ["ü", [1, 2]]  # a tuple comes back a list, on every rank
        assert got["nan"][0] == math.inf and math.isnan(got["nan"][1])


OBJECT_COLLECTIVE = re.compile(
    r"\b(?:all_gather|gather|broadcast|scatter|send|recv)_object(?:_list)?\("
)


def test_no_other_module_sends_a_pickle_between_the_ranks() -> None:
    src = REPO / "src" / "dtrain"
    found = {
        str(path.relative_to(src)): OBJECT_COLLECTIVE.findall(path.read_text())
        for path in src.rglob("*.py")
    }
    assert {name for name, calls in found.items() if calls} == set(), found


def send_named_tensors() -> dict[str, Any]:
    rank = dist.get_rank()
    local = (
        {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "n": torch.tensor([7])}
        if rank == 1
        else {"b": torch.ones(2, dtype=torch.bfloat16)}
    )
    pieces = gather_tensors(local, dst=0)
    return {"pieces": pieces}


def test_named_tensors_gather_without_a_pickle() -> None:
    first, second = run_ranks(send_named_tensors, 2)
    assert second["pieces"] is None
    mine, theirs = first["pieces"]
    assert torch.equal(mine["b"], torch.ones(2, dtype=torch.bfloat16))
    assert list(theirs) == ["w", "n"]
    assert torch.equal(theirs["w"], torch.arange(6, dtype=torch.float32).reshape(2, 3))
    assert theirs["n"].dtype == torch.int64 and theirs["n"].tolist() == [7]


def test_a_dtype_a_peer_names_must_be_a_torch_dtype() -> None:
    assert dtype_named("bfloat16", 1) is torch.bfloat16
    for name in ("Tensor", "load", 3, "os.system"):
        with pytest.raises(ValueError, match=r"rank 1 named .* not a torch dtype"):
            dtype_named(name, 1)
