"""``dtrain estimate``: the memory one rank needs to train a config, known before anything runs.

The model is built on the meta device (:mod:`.probe`); what each rank holds follows from the
shapes and the strategy's layout (:mod:`.layout`); a micro-batch's passes are measured on fake
tensors (:mod:`.passes`); they add up per phase for the rank that holds the most
(:mod:`.memory`, the entry; :mod:`.flat` and :mod:`.pipeline`, the strategies; :mod:`.job`,
what they share) into a :class:`~.result.MemoryEstimate`, which :mod:`.report` prints. What is
counted and what is not: docs/strategies.md, "How much memory a rank needs".
"""

from dtrain.estimate.memory import estimate_memory
from dtrain.estimate.result import MemoryEstimate

__all__ = ["MemoryEstimate", "estimate_memory"]
