"""A training state handed from one rank to another in memory, tensor by tensor
(``fault.recovery = 'inplace'``: a joiner heals from a peer).

A state is a nest of dicts, lists and tuples around tensors and plain values (a model's and an
optimizer's ``state_dict()``, the trainer's small parts). Only its skeleton crosses pickled:
the nest with each tensor replaced by a :class:`Slot` (dtype, shape, whether it lived on the
CPU). The tensors follow by point-to-point ``send``/``recv`` on the process group's device,
in the skeleton's order, so a model of billions of parameters never becomes one pickled
object (which would hold the whole state twice on the sender and once more as bytes).

Small tensors of one dtype travel together (an optimizer's per-parameter step counters would
otherwise cost a round trip each): consecutive tensors of the same dtype are packed into one
flat buffer of at most ``BUCKET_BYTES``; a larger tensor goes alone, without a copy. Both
sides cut the same batches from the skeleton. The receiver's tensors are views of the
buffers it received into; a tensor that lived on the CPU on the sender is returned on the CPU.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

BUCKET_BYTES = 32 * 1024 * 1024


@dataclass(frozen=True)
class Slot:
    """Where a tensor was in the nest."""

    index: int  # its place in the order the tensors travel
    dtype: torch.dtype
    shape: tuple[int, ...]
    on_cpu: bool

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def split(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """``state``'s skeleton (each tensor replaced by its :class:`Slot`) and its tensors, in
    the skeleton's order."""
    tensors: list[torch.Tensor] = []

    def walk(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            tensors.append(tensor)
            return Slot(len(tensors) - 1, tensor.dtype, tuple(tensor.shape), tensor.is_cpu)
        return _rebuild(value, walk)

    return walk(state), tensors


def _rebuild(value: Any, each: Callable[[Any], Any]) -> Any:
    """``value`` with ``each`` applied to every item if it is a dict (of any kind: a copy keeps
    an OrderedDict's ``_metadata``, which a model's ``load_state_dict`` reads), list or tuple;
    else ``value`` itself (plain data, pickled with the skeleton)."""
    if isinstance(value, dict):
        out = copy.copy(value)
        for key in out:
            out[key] = each(out[key])
        return out
    if type(value) in (list, tuple):
        return type(value)(each(item) for item in value)
    return value


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The nest of ``skeleton`` with each slot replaced by its tensor."""
    if isinstance(skeleton, Slot):
        return tensors[skeleton.index]
    return _rebuild(skeleton, lambda item: join(item, tensors))


def slots(skeleton: Any) -> list[Slot]:
    """The skeleton's slots in the order their tensors travel."""
    found: list[Slot] = []

    def walk(value: Any) -> None:
        if isinstance(value, Slot):
            found.append(value)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item)
        elif type(value) in (list, tuple):
            for item in value:
                walk(item)

    walk(skeleton)
    found.sort(key=lambda slot: slot.index)
    return found


def batches(specs: list[Slot], limit: int) -> Iterator[list[Slot]]:
    """Consecutive slots of one dtype, at most ``limit`` bytes together; a slot larger than
    that alone."""
    batch: list[Slot] = []
    size = 0
    for slot in specs:
        if batch and (slot.dtype != batch[0].dtype or size + slot.nbytes > limit):
            yield batch
            batch, size = [], 0
        batch.append(slot)
        size += slot.nbytes
    if batch:
        yield batch


def send_state(state: Any, dst: int, device: torch.device) -> int:
    """Send ``state`` to rank ``dst`` of the default group; the bytes of its tensors."""
    skeleton, tensors = split(state)
    dist.send_object_list([skeleton], dst=dst, device=device)
    sent = 0
    for batch in batches(slots(skeleton), BUCKET_BYTES):
        if len(batch) == 1:
            flat = tensors[batch[0].index].reshape(-1).to(device).contiguous()
        else:
            flat = torch.cat([tensors[s.index].reshape(-1).to(device) for s in batch])
        dist.send(flat, dst=dst)
        sent += flat.numel() * flat.element_size()
    return sent


def recv_state(src: int, device: torch.device) -> Any:
    """Receive the state rank ``src`` sends with :func:`send_state`."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, device=device)
    skeleton = box[0]
    specs = slots(skeleton)
    tensors: list[torch.Tensor] = [torch.empty(0)] * len(specs)
    for batch in batches(specs, BUCKET_BYTES):
        flat = torch.empty(sum(s.numel for s in batch), dtype=batch[0].dtype, device=device)
        dist.recv(flat, src=src)
        offset = 0
        for slot in batch:
            piece = flat[offset : offset + slot.numel].view(slot.shape)
            tensors[slot.index] = piece.cpu() if slot.on_cpu else piece
            offset += slot.numel
    return join(skeleton, tensors)
