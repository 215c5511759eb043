"""``fsdp``: fully sharded data parallel with torch's FSDP2 (``fully_shard``).

Each block of the model, then the root, becomes a sharding unit: a rank keeps 1/N of every
parameter, gradient and optimizer state, all-gathers a block's parameters just before using it
and reduce-scatters its gradients right after -- the order torchtitan documents (blocks first,
so that the root's unit holds only what is left: embeddings, final norm, head). The math is
data parallelism's: gradients are averaged over ranks, and the trainer's loss scaling makes them
the gradient of the global mean.

Two more dimensions compose with it on one mesh (:mod:`dtrain.parallel.composed`):
``strategy.dp_replicate = R`` keeps R copies of a model sharded over world / R ranks (hybrid
sharding: the gradients reduce-scatter inside a copy, then all-reduce across copies -- for
machines with fast links inside and slow ones between), and ``strategy.tensor_parallel = T``
cuts each layer over T ranks inside each shard (FSDP x tensor parallelism).

Checkpoints are sharded (:class:`~dtrain.parallel.sharded.MeshStrategy`): one DCP file set
per rank, resharded on load, so a run saved on 4 ranks resumes on 2 or on 1, and at another
layout of the mesh.
"""

from __future__ import annotations

from dtrain.parallel.composed import ComposedStrategy


class FSDPStrategy(ComposedStrategy):
    """fully sharded data parallel (FSDP2): parameters, gradients and optimizer state 1/N each"""

    name = "fsdp"
