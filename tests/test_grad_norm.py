"""The measured gradient norm (``train.grad_clip = 0``) against torch's ``get_total_norm``."""

from __future__ import annotations

import torch

from dtrain.parallel.grad_norm import gradient_norm

SHAPES = [(256, 64), (256,), (256, 256), (256,), (10, 256), (10,)]


def grads(dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=generator).to(dtype) for shape in SHAPES]


def test_one_dtype_is_bit_identical_to_get_total_norm() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        tensors = grads(dtype)
        assert torch.equal(gradient_norm(tensors), torch.nn.utils.get_total_norm(tensors))


def test_mixed_dtypes_and_no_gradients_take_get_total_norm() -> None:
    mixed = grads()
    mixed[1] = mixed[1].double()
    assert torch.equal(gradient_norm(mixed), torch.nn.utils.get_total_norm(mixed))
    assert torch.equal(gradient_norm([]), torch.nn.utils.get_total_norm([]))
    # A non-finite gradient gives a non-finite norm (what the NaN guard reads).
    broken = grads()
    broken[2][3, 4] = float("nan")
    assert not torch.isfinite(gradient_norm(broken))
    broken[2][3, 4] = float("inf")
    assert not torch.isfinite(gradient_norm(broken))
