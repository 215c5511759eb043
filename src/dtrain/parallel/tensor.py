"""``tensor``: tensor parallelism with ``torch.distributed.tensor.parallel`` -- each layer's
weight matrices cut across ranks, Megatron-style (column-wise into a block, row-wise out of
it, so a block costs one all-reduce in forward and one in backward).

The model names what to cut (:mod:`dtrain.parallel.tensor_plan`). The cut weights become
``DTensor`` shards; activations between the cut layers stay plain tensors, as does every other
parameter, replicated on every rank of the group. With more ranks than the degree
(``strategy.tensor_parallel``), ``world / degree`` data-parallel copies train beside it: whole
replicas (``strategy.data_parallel = 'replicate'``, gradients averaged) or FSDP shards
(``'fsdp'``: the same mesh as ``fsdp`` with ``strategy.tensor_parallel``). One mesh
(:mod:`dtrain.parallel.composed`), the ranks of one tensor-parallel group consecutive.

Checkpoints are sharded (DCP), by the full model's names: resharded on load, so a run saved at
one degree resumes at another.
"""

from __future__ import annotations

from dtrain.parallel.composed import ComposedStrategy


class TensorParallelStrategy(ComposedStrategy):
    """tensor parallel (torch.distributed.tensor.parallel), x data-parallel copies or shards"""

    name = "tensor"
