"""What a CPU keeps for the bfloat16 matrix products of a step: not tensors, but oneDNN's
compiled kernels.

Under ``bf16-mixed`` on a CPU torch runs each bfloat16 matrix product through oneDNN, which
compiles a kernel (a ``brg_matmul`` primitive, on AVX512-BF16) for each distinct problem --
shapes, strides -- the first time it meets it, and keeps it for the life of the process (its
primitive cache and the kernels' code); a step's forward and backward reach their problems
in the first step, so from then on every step's peak stands on them. float32 products (MKL,
no per-shape kernels) and float16 ones on a CPU without float16 arithmetic keep nothing of
the kind (measured: nothing grows with the shapes).

The bytes per problem are measured (torch 2.13, oneDNN 3.12, AVX512-BF16; one process, one
forward and backward of the tests' GPT at a new micro-batch size, resident size kept after
it): each new set of the GPT's 15 distinct products (4 ``addmm``, 11 ``mm``, with its 2
GELU kernels; its output projection then still ran in bfloat16, now it is 12) kept 8.37,
8.59 and 8.70 MiB, the same at d_model 96, 192 and 384 (8.66, 8.53, 8.44 MiB): about 584 KiB
per problem, whatever its size. About half stays with
``ONEDNN_PRIMITIVE_CACHE_CAPACITY=0`` (the kernels' code outlives the cache). The problems
are counted on the fake pass (:class:`.probe.LiveBytes`): each distinct matrix product on
bfloat16 inputs.
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
