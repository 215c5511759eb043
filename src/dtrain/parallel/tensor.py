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

from dtrain.config import StrategyConfig
from dtrain.parallel.composed import ComposedStrategy
from dtrain.parallel.mesh import ParallelDims, fit_dims, replicas_of_shards


class TensorParallelStrategy(ComposedStrategy):
    """tensor parallel (torch.distributed.tensor.parallel), x data-parallel copies or shards"""

    name = "tensor"

    @classmethod
    def shards_model(cls, options: StrategyConfig) -> bool:
        return options.data_parallel == "fsdp"

    @classmethod
    def holds_dtensors(cls, options: StrategyConfig) -> bool:
        return True  # the cut layers' weights

    @classmethod
    def dims_of(cls, options: StrategyConfig, world_size: int) -> ParallelDims:
        tp = ("strategy.tensor_parallel", options.tensor_parallel or world_size)
        replicas = replicas_of_shards(options.data_parallel, options.dp_replicate)
        if options.data_parallel == "replicate":
            return fit_dims(world_size, "dp_replicate", tp=tp)
        return fit_dims(world_size, "dp_shard", tp=tp, dp_replicate=replicas)
