"""dtrain.recovery.handover: a training state from one rank to another, tensor by tensor: every
tensor arrives equal (dtype, shape, values), plain values and the nest's kinds as they were,
small tensors of one dtype packed together and a large one alone."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

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
