"""Summing all-reduce between the ranks of one machine through a shared-memory segment: the
opt-in transport ``comm.transport = 'shm'`` (and ``'auto'``), plugged in through
:mod:`dtrain.comm.transport`. Each rank copies its tensor into its own slot of a file every rank
has mapped, marks its arrival, waits for every rank, and adds the slots in rank order: every
rank ends with the same bits, and with two ranks gloo's bits. When to use it, what it saves,
how it waits and fails: docs/communication.md, "Between the ranks of one machine".

Layout: a header page (a token that proves every rank mapped the same file; then one arrival
counter per rank, each on its own cache line), then two sets of slots, one per rank each, used
in turn. With two sets one arrival per call is enough: a rank writes set ``k mod 2`` in call
``k`` only after every rank arrived at call ``k - 1``, so none is still reading that set from
call ``k - 2``. A tensor larger than a slot goes through in slot-sized chunks, one call each.

The counters are plain 8-byte stores and loads: on x86-64, stores become visible to other cores
in program order, so a rank that sees a peer's counter sees the slot written before it. Other
architectures do not promise that, so the segment is offered only on x86-64. The file is
removed as soon as every rank has mapped it, so a rank killed outright leaves nothing in
``/dev/shm``; a rank's byte count is its payload, written once into the segment.
"""

from __future__ import annotations

import contextlib
import datetime
import mmap
import os
import platform
import secrets
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from dtrain.comm.mean import divide_into
from dtrain.comm.plain import all_gather_json, broadcast_json
from dtrain.config import CommConfig, Config
from dtrain.console import say_line
from dtrain.dist.runtime import env_int
from dtrain.errors import ConfigError, UserError
from dtrain.process_exit import process_alive

_TOKEN_BYTES = 16
_LINE = 64  # bytes: one arrival counter per cache line
_PAGE = 4096
_MAX_SLOT = 8 * 1024 * 1024  # bytes per rank and set: a larger tensor goes in chunks
_PREFIX = "dtrain-allreduce-"
# How long a wait polls (yielding the core) before it starts to sleep between polls, and the
# longest sleep: a rank whose peer is a whole backward pass behind should not burn a core.
_POLL_S = 0.002
_MAX_SLEEP_S = 0.001
_LIVENESS_EVERY_S = 0.1
# A segment file older than this whose maker is gone was left by a killed rank 0.
_STALE_S = 60.0


def check_config(cfg: Config, sums_only: bool) -> None:
    """The parent's checks of ``comm.transport = 'shm'`` ('auto' goes through the backend
    wherever shm cannot be used)."""
    if cfg.comm.transport != "shm":
        return
    if not sums_only:
        raise ConfigError(
            f"comm.transport = 'shm' does not work with comm.compression = "
            f"{cfg.comm.compression!r}: a shared-memory segment carries summing all-reduces only "
            "(compression none, fp16, bf16 or powersgd); use comm.transport = 'backend'"
        )
    if cfg.dist.device == "cuda":
        raise ConfigError(
            "comm.transport = 'shm' does not work with dist.device = 'cuda': it sums tensors "
            "in host memory; use comm.transport = 'backend' (NCCL has its own)"
        )


def check_machines(comm: CommConfig, max_nodes: int, nnodes: str) -> None:
    if comm.transport == "shm" and max_nodes > 1:
        raise UserError(
            f"comm.transport = 'shm' needs every rank on one machine, but --nnodes {nnodes} "
            "allows more; use comm.transport = 'auto' (shared memory where it can be used)"
        )


def build(
    comm: CommConfig,
    timeout: datetime.timedelta,
    sums_only: bool,
    group: dist.ProcessGroup | None,
    device: torch.device,
    capacity: int,
) -> SharedMemoryAllReduce | None:
    """The segment ``comm.transport`` asks for, made by every rank of ``group`` at once; None
    where the process group's own collectives are to carry the sums. ``sums_only``: the hook
    sends nothing but summing all-reduces; ``capacity``: its largest tensor in bytes.

    Every input is the same on every rank of the group, so all of them decide alike."""
    transport = comm.transport  # 'shm' or 'auto' (dtrain.comm.transport handles 'backend')
    reason = unavailable_reason(
        device,
        dist.get_world_size(group),
        local_world_size=env_int("LOCAL_WORLD_SIZE", 1),
        world_size=dist.get_world_size(),
    )
    if reason is None and not sums_only:
        reason = f"comm.compression = {comm.compression!r} sends more than sums"
    if reason is not None:
        if transport == "shm":
            raise RuntimeError(f"comm.transport = 'shm' cannot be used: {reason}")
        return None
    try:
        return SharedMemoryAllReduce(group, capacity, timeout.total_seconds())
    except SegmentUnavailable as error:
        if transport == "shm":
            raise
        if dist.get_rank(group) == 0:
            say_line(
                f"dtrain: warning: comm.transport = 'auto': {error}; gradients are summed "
                f"through {dist.get_backend(group)} instead"
            )
        return None


class SegmentUnavailable(RuntimeError):
    """The ranks could not share a segment; raised on every rank of the group alike."""


def unavailable_reason(
    device: torch.device, group_size: int, *, local_world_size: int, world_size: int
) -> str | None:
    """Why a shared segment cannot carry this group's all-reduce (None: it can)."""
    if device.type != "cpu":
        return f"tensors live on {device.type}, not in host memory"
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"it needs x86-64's store ordering; this machine is {platform.machine()}"
    if group_size < 2:
        return "the group has one rank"
    if local_world_size != world_size:
        return f"not every rank is on this machine ({local_world_size} of {world_size} ranks here)"
    return None


class SharedMemoryAllReduce:
    """Sum equal-shaped tensors across ``group`` (every rank on this machine) in place.

    Made by every rank of the group at once (it runs two collectives of ``group`` to agree on
    the segment). ``capacity`` is the largest tensor in bytes that goes through in one call; a
    larger one is split into chunks of that size."""

    def __init__(self, group: dist.ProcessGroup | None, capacity: int, timeout_s: float) -> None:
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.global_ranks = [
            dist.get_global_rank(group, r) if group is not None else r for r in range(self.size)
        ]
        self.timeout_s = timeout_s
        self.slot_bytes = _round_up(max(64, min(capacity, _MAX_SLOT)), _LINE)
        # The token's line, then one counter line per rank, rounded up to whole pages.
        self.header_bytes = _round_up(_LINE * (self.size + 1), _PAGE)
        segment_size = self.header_bytes + 2 * self.size * self.slot_bytes
        made = _create(segment_size) if self.rank == 0 else ""
        word = broadcast_json(made, src=self.global_ranks[0], group=group)
        if isinstance(word, str):
            raise SegmentUnavailable(
                f"shared-memory all-reduce: rank 0 could not make its segment: {word}"
            )
        path = str(word["path"])
        mapped, problem = _open(path, bytes.fromhex(word["token"]), int(word["size"]))
        gathered = all_gather_json([problem, os.getpid()], group=group)
        answers = [(None if p is None else str(p), int(pid)) for p, pid in gathered]
        if self.rank == 0:
            Path(path).unlink(missing_ok=True)  # every rank has it mapped (or has given up on it)
        problems = [(r, p) for r, (p, _) in enumerate(answers) if p]
        if problems or mapped is None:
            if mapped is not None:
                mapped.close()
            rank, problem = problems[0]
            raise SegmentUnavailable(
                f"shared-memory all-reduce: rank {self.global_ranks[rank]} cannot share "
                f"{path} with rank {self.global_ranks[0]}: {problem}"
            )
        self.pids = [pid for _, pid in answers]
        self._map = mapped
        words = np.frombuffer(mapped, dtype=np.int64, count=self.header_bytes // 8)
        per_line = _LINE // 8
        self._arrivals = words[per_line : per_line * (self.size + 1) : per_line]
        data = torch.frombuffer(mapped, dtype=torch.uint8, offset=self.header_bytes)
        self._sets = data.view(2, self.size, self.slot_bytes)
        # Each rank's slot for a call, by (set, bytes, dtype): a bucket has the same size every
        # step, and each view made afresh is a call into torch's dispatcher on the hot path.
        self._slot_views: dict[tuple[int, int, torch.dtype], list[torch.Tensor]] = {}
        self._calls = 0

    def bytes_sent(self, payload: int) -> int:
        """Each rank writes its payload into the segment once and reads its peers' there."""
        return payload if self.size > 1 else 0

    def all_reduce_(self, tensor: torch.Tensor, divisor: int = 1) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place (contiguous, on the CPU); returns it.
        ``divisor``: each rank's tensor is divided by it first (``tensor / divisor`` bit for
        bit), in the same pass as its copy into the segment, so a mean costs no pass of its
        own over the tensor."""
        if not tensor.is_contiguous():
            raise ValueError("shared-memory all-reduce takes contiguous tensors only")
        flat = tensor if tensor.dim() == 1 else tensor.view(-1)  # a bucket is flat already
        per_chunk = self.slot_bytes // tensor.element_size()
        if flat.numel() <= per_chunk:
            self._reduce_chunk(flat, divisor)
            return tensor
        for start in range(0, flat.numel(), per_chunk):
            self._reduce_chunk(flat[start : start + per_chunk], divisor)
        return tensor

    def _reduce_chunk(self, chunk: torch.Tensor, divisor: int) -> None:
        key = (self._calls % 2, chunk.numel() * chunk.element_size(), chunk.dtype)
        slots = self._slot_views.get(key)
        if slots is None:
            slots = list(self._sets[key[0], :, : key[1]].view(chunk.dtype).unbind(0))
            self._slot_views[key] = slots
        self._calls += 1
        divide_into(chunk, divisor, out=slots[self.rank])
        self._arrive_and_wait(self._calls)
        if self.size == 2:
            torch.add(slots[0], slots[1], out=chunk)
            return
        chunk.copy_(slots[0])
        for peer in slots[1:]:
            chunk.add_(peer)

    def _arrive_and_wait(self, call: int) -> None:
        arrivals = self._arrivals
        arrivals[self.rank] = call
        if arrivals.min() >= call:
            return
        started = time.monotonic()
        next_check = started + _LIVENESS_EVERY_S
        sleep = 0.00005
        while arrivals.min() < call:
            now = time.monotonic()
            if now - started < _POLL_S:
                os.sched_yield()
                continue
            time.sleep(sleep)
            sleep = min(sleep * 2, _MAX_SLEEP_S)
            if now >= next_check:
                next_check = now + _LIVENESS_EVERY_S
                self._check_peers(call, now - started)

    def _check_peers(self, call: int, waited: float) -> None:
        late = [r for r in range(self.size) if self._arrivals[r] < call]
        for r in late:
            if not process_alive(self.pids[r]):
                raise RuntimeError(
                    f"shared-memory all-reduce: peer rank {self.global_ranks[r]} (pid "
                    f"{self.pids[r]}) exited while rank {self.global_ranks[self.rank]} waited "
                    "for it"
                )
        if waited >= self.timeout_s:
            names = ", ".join(str(self.global_ranks[r]) for r in late)
            raise RuntimeError(
                f"shared-memory all-reduce timed out after {self.timeout_s:g}s (dist.timeout_s): "
                f"rank {self.global_ranks[self.rank]} waited for peer rank(s) {names}"
            )

    def close(self) -> None:
        self._sets = torch.empty(0, dtype=torch.uint8)
        self._slot_views.clear()
        self._arrivals = np.empty(0, dtype=np.int64)
        with contextlib.suppress(BufferError):  # a tensor still views it: goes with the process
            self._map.close()


def _segment_dir() -> str:
    """Shared memory when the machine has it (never written back to a disk), else the temp
    folder (its pages still stay in the page cache)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and os.access(shm, os.W_OK | os.X_OK):
        return shm
    return tempfile.gettempdir()


def _create(size: int) -> dict[str, Any] | str:
    """A new zeroed segment of ``size`` bytes with its pages reserved (a full ``/dev/shm``
    fails here, not with SIGBUS at the first write): its path, token (hex) and size as JSON,
    or what went wrong."""
    folder = _segment_dir()
    _sweep(folder)
    path = os.path.join(folder, f"{_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
    token = secrets.token_bytes(_TOKEN_BYTES)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        return f"cannot create {path}: {error.strerror}"
    try:
        os.posix_fallocate(fd, 0, size)
        os.pwrite(fd, token, 0)
    except OSError as error:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
        return f"cannot reserve {size} bytes in {folder}: {error.strerror}"
    os.close(fd)
    return {"path": path, "token": token.hex(), "size": size}


def _sweep(folder: str) -> None:
    """Remove segments left by a rank 0 killed between making its segment and removing it
    (a second or so at set-up): its process is gone and the file is older than any set-up."""
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_PREFIX)]
    except OSError:
        return
    now = time.time()
    for name in names:
        pid_text = name[len(_PREFIX) :].split("-", 1)[0]
        path = os.path.join(folder, name)
        try:
            stale = now - os.stat(path).st_mtime > _STALE_S
        except OSError:
            continue
        if pid_text.isdigit() and stale and not process_alive(int(pid_text)):
            Path(path).unlink(missing_ok=True)


def _open(path: str, token: bytes, size: int) -> tuple[mmap.mmap | None, str | None]:
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as error:
        return None, f"cannot open it: {error.strerror} (is this rank on another machine?)"
    try:
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if mapped[:_TOKEN_BYTES] != token:
        mapped.close()
        return None, "its file there is another one (is this rank on another machine?)"
    return mapped, None


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
