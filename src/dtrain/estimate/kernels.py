"""What a CPU keeps for the bfloat16 matrix products of a step: not tensors, but oneDNN's
compiled kernels (the measurement: docs/strategies.md, "How much memory a rank needs").

Under ``bf16-mixed`` on a CPU oneDNN compiles a kernel for each distinct problem (shapes,
strides) the first time it meets it and keeps it for the life of the process, so from the
first step on every step's peak stands on them; float32 products and float16 ones on a CPU
without float16 arithmetic keep nothing of the kind. The bytes per problem are measured
(torch 2.13, oneDNN 3.12, AVX512-BF16: about 584 KiB whatever its size; about half stays with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0``, the kernels' code outliving the cache). The problems are
counted on the fake pass (:class:`.probe.LiveBytes`): each distinct matrix product on bfloat16
inputs.
"""

from __future__ import annotations

from typing import Any

import torch

from dtrain.compute.precision import Precision

BYTES_PER_BF16_PRODUCT = 584 * 1024

_aten = torch.ops.aten
MATRIX_PRODUCTS = frozenset(
    {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}
)

Signature = tuple[str, tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]]


def product_signature(func: Any, args: Any) -> Signature | None:
    """The problem a matrix product on bfloat16 inputs poses oneDNN (None: not one)."""
    if func not in MATRIX_PRODUCTS:
        return None
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not any(t.dtype == torch.bfloat16 for t in tensors):
        return None
    return str(func), tuple((tuple(t.shape), tuple(t.stride())) for t in tensors)


def kernel_bytes(products: int, precision: Precision) -> int:
    """What oneDNN keeps for ``products`` distinct bfloat16 matrix products, on a CPU with
    oneDNN (0 elsewhere: a GPU's libraries keep no per-shape kernels in host memory)."""
    mixed_bf16 = precision.dtype == torch.bfloat16 and precision.device_type == "cpu"
    if not mixed_bf16 or not torch.backends.mkldnn.is_available():
        return 0
    return products * BYTES_PER_BF16_PRODUCT
