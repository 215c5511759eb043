"""The own-loop library API, in every worker: a training loop the user writes (``main(run)``),
with dtrain's strategies, data stream, loss contract, checkpoints and preemption
(:class:`~dtrain.loop.run.Run`; docs/own-loop.md)."""

from dtrain.loop.batch import Batch
from dtrain.loop.run import Run

__all__ = ["Batch", "Run"]
