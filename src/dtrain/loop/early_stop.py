"""An own loop's early stop (``run.stop(reason)``): one rank's wish becomes every rank's stop
after the same step, carried by the step's agreement -- the stop flag that carries preemption
(:class:`dtrain.comm.agreement.StepAgreement`) -- so no step pays a collective for it.

A wish rides in the agreement of the first step whose forward has not begun when it is made:
made before a batch's first micro-batch, every rank stops after that step; made after
``run.step()`` of step k, every rank runs step k + 1 and stops after it (the agreement of
step k was summed in its gradient sync, before the loop could wish).

The flag says only that some rank asked to stop, not why. At a step whose agreement stops the
run -- once per run -- the ranks gather why (:func:`stop_causes`): a signal on any rank makes
it a preemption, as in dtrain's loop (saved, to be resumed; a wish made meanwhile is not kept);
wishes alone end the run as a completed one, its final checkpoint saved, the reasons in its
summary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from dtrain.comm.plain import all_gather_json


@dataclass(frozen=True)
class StopCauses:
    signals: list[str]  # the preemption signals' names, of the ranks that received one
    reasons: list[str]  # the wishes' reasons, in rank order, each once

    @property
    def preempted(self) -> bool:
        return bool(self.signals)


def stop_causes(signal: str, reason: str) -> StopCauses:
    """Every rank's cause for the stop they agreed on: this rank's preemption ``signal``
    ("" if none) and wish's ``reason`` ("" if none). Collective, once: every rank calls it at
    the step whose agreement stopped the run."""
    causes = [(signal, reason)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        # Plain JSON, never pickles: nothing a peer sends is unpickled (comm/plain.py).
        causes = [(str(s), str(r)) for s, r in all_gather_json([signal, reason])]
    reasons = list(dict.fromkeys(wish for _, wish in causes if wish))  # each once, in order
    return StopCauses([s for s, _ in causes if s], reasons)
