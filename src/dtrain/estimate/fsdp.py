"""What torch's FSDP2 (``fully_shard``) holds beyond a rank's shards while a step runs, as
dtrain's fsdp strategy configures it (each block a unit, then the root;
``strategy.reshard_after_forward``; ``strategy.backward_prefetch``; no mixed-precision policy).

The schedule is read from ``torch/distributed/fsdp/_fully_shard`` (torch 2.13) and counted on
a real run by ``tests/fsdp_census.py``; it is laid out unit by unit in docs/strategies.md,
"FSDP's peak": four blocks in flight in backward (three with two blocks, three without
prefetch) against two in forward. A unit's *flat buffer* is the all-gather's output, the size
of its gathered parameters. The sharded gradients the reduce-scatters have made by a moment
count too, and the activations still held then (:mod:`.flat` adds them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    """One FSDP unit's bytes on one rank."""

    params: int  # its parameters gathered whole (and its flat all-gather buffer: the same)
    grads: int  # its gradients unsharded (the trainable parameters')
    shard_grads: int  # the rank's shard of them, once reduce-scattered


@dataclass(frozen=True)
class Moment:
    """What FSDP holds beyond the rank's shards at one moment of a step."""

    backward: bool  # in the forward or the backward of ...
    block: int  # ... this block (counted from 0 in forward order; -1: no blocks)
    unsharded: int  # gathered parameters, unsharded gradients, flat and reduce-scatter buffers
    sharded_grads: int  # the sharded gradients the reduce-scatters have made by then

    @property
    def total(self) -> int:
        return self.unsharded + self.sharded_grads

    @property
    def where(self) -> str:
        return f"{'backward' if self.backward else 'forward'} of block {self.block}"


def fsdp_moments(
    blocks: Sequence[Unit],
    root: Unit,
    reshard_after_forward: bool,
    accumulating: bool,
    backward_prefetch: bool = True,
) -> list[Moment]:
    """Each block's forward and backward in a step (the last micro-batch's, ``accumulating``:
    after earlier ones whose unsharded gradients it holds, counted here), at the most FSDP
    holds in each."""
    count = len(blocks)
    params = [b.params for b in blocks]
    # Unsharded gradients from earlier micro-batches of the step: every unit's, until the
    # last micro-batch's backward reduce-scatters the unit.
    earlier = [b.grads if accumulating else 0 for b in blocks]
    root_earlier = root.grads if accumulating else 0
    moments = []
    for i in range(count):  # forward
        # Unit i's parameters and flat buffer; before, while it gathers, unit i-1's flat
        # buffer and its own. Without resharding, every unit before it stays gathered.
        before = 0 if reshard_after_forward else sum(params[:i])
        gathered = before + params[i] + max(params[i], params[i - 1] if i else 0)
        held = root.params + root_earlier + sum(earlier) + gathered
        moments.append(Moment(False, i, held, 0))
    for i in reversed(range(count)):  # backward
        gathered = params[i] if reshard_after_forward else sum(params[: i + 1])
        if i > 0 and reshard_after_forward and backward_prefetch:
            gathered += params[i - 1]  # prefetched: its flat buffer
        # Unit i's gradients, those of the units backward has not reached, and unit i+1's
        # reduce-scatter input (the size of its unsharded gradients, now freed).
        grads = max(blocks[i].grads, earlier[i]) + sum(earlier[:i])
        if i + 1 < count:
            grads += blocks[i + 1].grads
        root_held = root.params + max(root.grads, root_earlier)
        done = sum(b.shard_grads for b in blocks[i + 1 :])
        moments.append(Moment(True, i, root_held + gathered + grads, done))
    if not moments:  # no blocks: the root alone, gathered with its gradients
        moments.append(Moment(True, -1, root.params + root.grads, 0))
    return moments
