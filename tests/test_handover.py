"""dtrain.recovery.handover: a training state from one rank to another, tensor by tensor: every
tensor arrives equal (dtype, shape, values), plain values and the nest's kinds as they were,
small tensors of one dtype packed together and a large one alone."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch

from dtrain.recovery import handover
from dtrain.recovery.handover import Slot, batches, split
from tests.ranks import run_ranks


def a_state() -> dict[str, Any]:
    """What a heal carries, in miniature: a model's state dict (an OrderedDict with
    ``_metadata``), an optimizer's (scalar step counters, moments), the trainer's parts."""
    gen = torch.Generator().manual_seed(3)
    model: OrderedDict[str, torch.Tensor] = OrderedDict(
        [
            ("w", torch.randn(64, 32, generator=gen)),
            ("b", torch.randn(32, generator=gen).to(torch.float64)),
            ("mask", torch.rand(7, generator=gen) > 0.5),
            ("big", torch.randn(1000, generator=gen)),  # over the test's bucket: alone
        ]
    )
    model._metadata = OrderedDict({"": {"version": 1}})  # type: ignore[attr-defined]
    optimizer = {
        "state": {
            i: {"step": torch.tensor(float(5 + i)), "exp_avg": torch.randn(8, generator=gen)}
            for i in range(3)
        },
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2], "betas": (0.9, 0.95)}],
    }
    parts = {"data": {"position": 123, "seed": 7}, "rng": torch.arange(5, dtype=torch.uint8)}
    return {"model": model, "optimizer": optimizer, "parts": parts}


def hand_over() -> Any:
    handover.BUCKET_BYTES = 1024  # several batches from a small state
    device = torch.device("cpu")
    if torch.distributed.get_rank() == 0:
        return handover.send_state(a_state(), 1, device)
    return handover.recv_state(0, device)


def assert_same(got: Any, expected: Any) -> None:
    assert type(got) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert (got.dtype, got.shape) == (expected.dtype, expected.shape)
        assert got.device == expected.device
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected)
        for a, b in zip(got, expected, strict=True):
            assert_same(a, b)
    else:
        assert got == expected


def test_a_state_arrives_equal_tensor_by_tensor() -> None:
    sent, received = run_ranks(hand_over, 2)
    expected = a_state()
    assert_same(received, expected)
    assert received["model"]._metadata == expected["model"]._metadata
    assert sent == sum(t.numel() * t.element_size() for t in split(expected)[1])


def test_batches_pack_one_dtype_up_to_the_limit() -> None:
    def slot(index: int, dtype: torch.dtype, numel: int) -> Slot:
        return Slot(index, dtype, (numel,), True)

    f32, i64 = torch.float32, torch.int64
    specs = [
        slot(0, f32, 10),
        slot(1, f32, 10),
        slot(2, i64, 1),
        slot(3, f32, 100),
        slot(4, f32, 5),
    ]
    cut = [[s.index for s in batch] for batch in batches(specs, limit=100)]
    # 40 + 40 bytes of float32; an int64 alone (another dtype); 400 bytes alone (over the
    # limit); then what follows starts a new batch.
    assert cut == [[0, 1], [2], [3], [4]]


def test_the_skeleton_crosses_as_tagged_json_and_comes_back_the_same() -> None:
    import json
    import math

    state = OrderedDict(w=torch.ones(2), b=torch.zeros(1, dtype=torch.bfloat16))
    state._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
    nest = {
        "model": state,
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0)}},
            "groups": [{"betas": (0.9, 0.95)}],
        },
        "loss": math.inf,
        "flags": [True, None, "x"],
    }
    skeleton, _ = split(nest)
    back = handover.from_plain(json.loads(json.dumps(handover.to_plain(skeleton))), src=1)
    assert back == skeleton  # tuples, int keys, slots and dict kinds as they were
    assert type(back["model"]) is OrderedDict and back["model"]._metadata == state._metadata
    assert back["optimizer"]["groups"][0]["betas"] == (0.9, 0.95)


def test_a_skeleton_holds_plain_data_only_both_ways() -> None:
    with pytest.raises(TypeError, match="holds a set: not plain data"):
        handover.to_plain({"x": {1, 2}})
    for crafted, words in [
        ({"slot": [0, "load", [1], True]}, "not a torch dtype"),
        ({"callable": "os.system"}, "unknown part"),
        ({"dict": [[{"list": []}, 1]], "ordered": False, "meta": None}, "not hashable"),
        ({"dict": [], "ordered": False, "meta": {}}, "metadata for a plain dict"),
    ]:
        with pytest.raises(ValueError, match=words):
            handover.from_plain(crafted, src=2)
