"""``dtrain estimate``: the memory one rank needs to train a config, known before anything runs.

The task's model is built on the meta device (:mod:`.probe`): no tensor of its size is ever
allocated. What each rank holds of its state follows from the shapes and the strategy's
layout (:mod:`.layout`); what a micro-batch's forward keeps for backward, and the peak of its
forward and backward, are measured by running them on fake tensors (:mod:`.passes`); the two
add up per phase of a step for the rank that holds the most (:mod:`.memory`, the entry;
:mod:`.flat` and :mod:`.pipeline`, the strategies; :mod:`.job`, what they share) into a
:class:`~.result.MemoryEstimate`, which :mod:`.report` prints.

Counted: parameters, buffers, gradients, optimizer state, activations (with and without
activation checkpointing), the forward/backward and optimizer-step temporaries, and what the
strategy adds (ddp's and allreduce's buckets, fsdp's gathered units, a pipeline's micro-batches
in flight and receive buffers); on a CPU under bf16-mixed, oneDNN's kernels for the step's
bfloat16 matrix products (:mod:`.kernels`). Not counted: the runtime's own memory (torch and its
libraries, the process group, a GPU's CUDA context and kernels), the data and its loader,
checkpoint snapshots, evaluation, and allocator slack (freed blocks a caching allocator or
malloc keeps).
"""

from dtrain.estimate.memory import estimate_memory
from dtrain.estimate.result import MemoryEstimate

__all__ = ["MemoryEstimate", "estimate_memory"]
