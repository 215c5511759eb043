"""An own loop's early stop (``run.stop(reason)``): one rank's wish becomes every rank's stop
after the same step, carried by the step's agreement (:class:`dtrain.comm.agreement.
StepAgreement`, its own value beside preemption's flag): no collective of its own per step.

A wish rides in the agreement of the first step whose forward has not begun when it is made:
made before a batch's first micro-batch, every rank stops after that step; made after
``run.step()`` of step k, every rank runs step k + 1 and stops after it (the agreement of
step k was summed in its gradient sync, before the loop could wish). The run then ends as a
completed one -- its final checkpoint, status ``completed`` -- with the reasons in its summary.
"""

from __future__ import annotations

import torch.distributed as dist


def agreed_reasons(mine: str) -> str:
    """Every rank's reason for the stop they agreed on, in rank order, each said once (one
    gather, once per run: every rank calls it at the step the agreement stopped)."""
    reasons = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[str] = [""] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        reasons = gathered
    said: list[str] = []
    for reason in reasons:
        if reason and reason not in said:
            said.append(reason)
    return "; ".join(said)
