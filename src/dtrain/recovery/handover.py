"""A training state handed from one rank to another in memory, tensor by tensor
(``fault.recovery = 'inplace'``: a joiner heals from a peer).

A state is a nest of dicts, lists and tuples around tensors and plain values (a model's and an
optimizer's ``state_dict()``, the trainer's small parts). Its skeleton -- the nest with each
tensor replaced by a :class:`Slot` (dtype, shape, whether it lived on the CPU) -- crosses as
JSON with its kinds tagged (:func:`to_plain`, :func:`from_plain`), never as a pickle: a peer's
bytes build only dicts, lists, tuples, strings, numbers, booleans, None and slots. The tensors
follow by point-to-point ``send``/``recv`` on the process group's device,
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
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dtrain.comm.plain import dtype_named, recv_json, send_json

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
        return math.prod(self.shape)

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
    else ``value`` itself (plain data, sent with the skeleton)."""
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

    def walk(value: Any) -> Any:
        if isinstance(value, Slot):
            found.append(value)
            return value
        return _rebuild(value, walk)  # the nest walked as split walks it (a copy, no tensors)

    walk(skeleton)
    found.sort(key=lambda slot: slot.index)
    return found


def to_plain(skeleton: Any) -> Any:
    """``skeleton`` as JSON can hold it: each container tagged with its kind, so that
    :func:`from_plain` gives back tuples, non-string keys, an OrderedDict and its
    ``_metadata`` (which a model's ``load_state_dict`` reads). A value of another type is the
    sender's error, said before any byte is sent."""
    if isinstance(skeleton, Slot):
        dtype = str(skeleton.dtype).removeprefix("torch.")
        return {"slot": [skeleton.index, dtype, list(skeleton.shape), skeleton.on_cpu]}
    if type(skeleton) in (dict, OrderedDict):
        items = [[to_plain(key), to_plain(value)] for key, value in skeleton.items()]
        meta = getattr(skeleton, "_metadata", None)
        return {
            "dict": items,
            "ordered": type(skeleton) is OrderedDict,
            "meta": None if meta is None else to_plain(meta),
        }
    if type(skeleton) in (list, tuple):
        return {type(skeleton).__name__: [to_plain(item) for item in skeleton]}
    if skeleton is None or type(skeleton) in (bool, int, float, str):
        return skeleton
    raise TypeError(f"a state to hand over holds a {type(skeleton).__name__}: not plain data")


def from_plain(value: Any, src: int) -> Any:
    """The skeleton :func:`to_plain` gave, as rank ``src`` sent it."""
    if not isinstance(value, dict):
        return value  # None, a boolean, a number or a string
    if "slot" in value:
        index, dtype, shape, on_cpu = value["slot"]
        return Slot(int(index), dtype_named(dtype, src), tuple(int(n) for n in shape), bool(on_cpu))
    if "dict" in value:
        out: dict[Any, Any] = OrderedDict() if value["ordered"] else {}
        for key, item in value["dict"]:
            out[_hashable(from_plain(key, src), src)] = from_plain(item, src)
        if value["meta"] is not None:
            if not isinstance(out, OrderedDict):
                raise ValueError(f"rank {src} sent metadata for a plain dict")
            out._metadata = from_plain(value["meta"], src)  # type: ignore[attr-defined]
        return out
    if "tuple" in value:
        return tuple(from_plain(item, src) for item in value["tuple"])
    if "list" in value:
        return [from_plain(item, src) for item in value["list"]]
    raise ValueError(f"rank {src} sent a state skeleton with an unknown part: {sorted(value)}")


def _hashable(key: Any, src: int) -> Any:
    try:
        hash(key)
    except TypeError:
        raise ValueError(f"rank {src} sent a dict key that is not hashable: {key!r}") from None
    return key


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
    send_json(to_plain(skeleton), dst=dst, device=device)
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
    skeleton = from_plain(recv_json(src=src, device=device), src)
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
