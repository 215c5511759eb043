"""What torch's FSDP2 (``fully_shard``) holds beyond a rank's shards while a step runs, as
dtrain's fsdp strategy configures it: each block a unit, then the root (what no block holds:
embeddings, final norm, head), ``strategy.reshard_after_forward`` on every unit, torch's
default prefetching or none in backward (``strategy.backward_prefetch``), no mixed-precision
policy (autocast casts; the parameters and their gradients stay fp32).

The schedule, read from ``torch/distributed/fsdp/_fully_shard`` (torch 2.13) and counted on a
real run by ``tests/fsdp_census.py``; a unit's *flat buffer* is the all-gather's output, the
size of its gathered parameters::

    forward, unit i     its gathered parameters, and its flat buffer, kept until the next
                        unit's parameters are copied out of theirs (to overlap that copy with
                        the next all-gather); the root's parameters until forward ends
    backward, unit i    its gathered parameters and their unsharded gradients; unit i-1's
                        flat buffer (prefetched when unit i's backward begins, copied out
                        when unit i-1's does); unit i+1's reduce-scatter input (torch keeps
                        one until the next reduce-scatter, so that the buffer is not reused
                        while the collective may still read it); the root's parameters and
                        its gradients (its weights are used at both ends of the model)

so four blocks in flight in backward (three with two blocks) against two in forward. With
``backward_prefetch = false`` nothing is prefetched: unit i-1 is gathered when its own
backward begins (its flat buffer freed as its parameters are copied out), three blocks in
backward. With ``reshard_after_forward = false`` a unit's parameters stay gathered from its
forward until its backward ends: every block at the end of forward. While a step
accumulates over micro-batches every unit's gradients stay unsharded (and whole) until the
last micro-batch's backward reduce-scatters their sum. The sharded gradients the
reduce-scatters have made by a moment count too, and the activations still held then
(:mod:`.flat` adds them): with activation checkpointing the peak is late in backward, without
it nearer its start.
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
