"""Small structures between the ranks as JSON in a byte tensor, never as a pickle.

torch's ``*_object`` collectives (``all_gather_object``, ``gather_object``,
``broadcast_object_list``) unpickle whatever a peer sends, and a pickle runs code as it loads.
The peers are whoever joined the job's store, whose addresses nobody vouches for: one that is
not of the job, or a rank that was made to send something else, would run its code in every
rank. Here a value goes as its JSON text, UTF-8 encoded in a ``uint8`` tensor, and comes back
through ``json.loads``, which builds only dicts, lists, strings, numbers, booleans and None.

What a caller gives must be JSON-able, and comes back as JSON has it: a tuple comes back a list,
a dict's keys come back strings. A caller that compares tuples, or keys by number, converts at
its own call site. Every rank of ``group`` calls a collective at the same point, as torch's.

The tensors live where the group's backend carries them: on the CPU for gloo (or a group that
has gloo beside another backend: no copy), on this rank's current CUDA device for NCCL (the
runtime set it to the rank's device).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Collective: every rank's ``value``, in the order of the ranks of ``group``."""
    payload = _encode(value)
    device = _device(group)
    lengths = _all_lengths(len(payload), group, device)
    longest = max(lengths)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in lengths]
    dist.all_gather(gathered, _padded(payload, longest, device), group=group)
    return [_decode(data, n, rank) for rank, (data, n) in enumerate(zip(gathered, lengths))]


def gather_json(
    value: Any, dst: int = 0, group: dist.ProcessGroup | None = None
) -> list[Any] | None:
    """Collective: every rank's ``value`` in the order of the ranks of ``group``, on the rank
    ``dst`` (a global rank, as torch's ``dst``); None on the others."""
    payload = _encode(value)
    device = _device(group)
    lengths = _all_lengths(len(payload), group, device)
    longest = max(lengths)
    mine = _padded(payload, longest, device)
    if dist.get_rank() != dst:
        dist.gather(mine, None, dst=dst, group=group)
        return None
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in lengths]
    dist.gather(mine, gathered, dst=dst, group=group)
    return [_decode(data, n, rank) for rank, (data, n) in enumerate(zip(gathered, lengths))]


def broadcast_json(value: Any, src: int = 0, group: dist.ProcessGroup | None = None) -> Any:
    """Collective: the rank ``src``'s ``value`` (a global rank, as torch's ``src``) on every
    rank; the others' ``value`` is not read."""
    device = _device(group)
    here = dist.get_rank() == src
    payload = _encode(value) if here else b""
    length = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    n = int(length.item())
    data = (
        _padded(payload, n, device)
        if here
        else torch.empty(_checked(n, src), dtype=torch.uint8, device=device)
    )
    dist.broadcast(data, src=src, group=group)
    return json.loads(payload) if here else _decode(data, n, src)


def gather_tensors(
    local: dict[str, torch.Tensor], dst: int = 0
) -> list[dict[str, torch.Tensor]] | None:
    """Collective over the default group: every rank's named tensors on the rank ``dst``, in
    rank order, on the CPU; None on the others. What each rank sends is said first as JSON
    (names, shapes, dtype names); the tensors follow as raw bytes point to point, read into
    buffers of that shape and dtype -- nothing a peer sends is unpickled, unlike
    ``gather_object``."""
    device = _device(None)
    manifest = [
        [name, list(t.shape), str(t.dtype).removeprefix("torch.")] for name, t in local.items()
    ]
    manifests = gather_json(manifest, dst=dst)
    if manifests is None:
        for tensor in local.values():
            dist.send(tensor.detach().contiguous().to(device), dst=dst)
        return None
    pieces: list[dict[str, torch.Tensor]] = []
    for rank, entries in enumerate(manifests):
        if rank == dst:
            pieces.append({name: t.detach().cpu() for name, t in local.items()})
            continue
        piece = {}
        for name, shape, dtype in entries:
            buffer = torch.empty(shape, dtype=dtype_named(dtype, rank), device=device)
            dist.recv(buffer, src=rank)
            piece[str(name)] = buffer.cpu()
        pieces.append(piece)
    return pieces


def send_json(value: Any, dst: int, device: torch.device) -> None:
    """Point to point over the default group: ``value`` to rank ``dst`` (its length, then its
    JSON text); the peer calls :func:`recv_json`."""
    payload = _encode(value)
    dist.send(torch.tensor([len(payload)], dtype=torch.int64, device=device), dst=dst)
    dist.send(_padded(payload, len(payload), device), dst=dst)


def recv_json(src: int, device: torch.device) -> Any:
    """The value rank ``src`` sent with :func:`send_json`."""
    length = torch.empty(1, dtype=torch.int64, device=device)
    dist.recv(length, src=src)
    n = _checked(int(length.item()), src)
    data = torch.empty(n, dtype=torch.uint8, device=device)
    dist.recv(data, src=src)
    return _decode(data, n, src)


def dtype_named(name: Any, rank: int) -> torch.dtype:
    """The torch dtype rank ``rank`` named (``"float32"``); a ValueError for anything else."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"rank {rank} named {name!r} as a tensor's dtype: not a torch dtype")
    return dtype


def _encode(value: Any) -> bytes:
    # allow_nan (the default): a timing or a loss may be inf or NaN, which Python's json writes
    # and reads back as such. No default=: a value JSON cannot hold is the caller's bug, said
    # here on the rank that has it, before any byte is sent.
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def _decode(data: torch.Tensor, n: int, rank: int) -> Any:
    raw = bytes(data[:n].cpu().numpy().tobytes())
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"rank {rank} sent {n} bytes that are not JSON text: {exc}") from None


def _device(group: dist.ProcessGroup | None) -> torch.device:
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_lengths(n: int, group: dist.ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's payload length: one int64 each."""
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(every, mine, group=group)
    return [_checked(int(t.item()), rank) for rank, t in enumerate(every)]


def _checked(n: int, rank: int) -> int:
    if n < 0:
        raise ValueError(f"rank {rank} sent a negative length ({n}) for its JSON text")
    return n


def _padded(payload: bytes, length: int, device: torch.device) -> torch.Tensor:
    """``payload`` in a uint8 tensor of ``length`` bytes, zeros after it."""
    out = torch.zeros(length, dtype=torch.uint8)
    if payload:
        out[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return out.to(device)
