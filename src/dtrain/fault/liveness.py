"""A rank's liveness: one record, in one small memory-mapped file per rank in the run folder.

``RUN_DIR/liveness/rankN``: who the rank is, where it is (step, phase, progress inside the
phase), when its watchdog's thread last stamped it alive, and its speed. The hang check, the
diagnosis of a failed peer (the file's pages outlive a killed process, so its machine reads
the exact step), the store's mirror (:meth:`Liveness.to_dict`) and ``dtrain status`` all read
this one record (docs/fault-tolerance.md, "Hangs and failures name the rank"). The training
thread writes with plain stores into the mapping, no system call, cheap enough for every phase
change; the watchdog's thread writes the rest into a separate part and syncs the file about
every second. A restart attempt replaces the file whole, so a reader checks the pid.

Layout: a header written once (magic, pid, rank, world size, attempt, host), then two slots
for the training thread's record and two for the watchdog thread's, each pair used in turn.
A record is written as sequence number ``2n - 1`` (odd: being written), the body, then ``2n``
(even: complete). A process killed in the middle of a write leaves an odd number in one slot
and the previous record, complete, in the other: a torn write is recognised and never read as
a record. A progress mark rewrites only the progress count and its time, in place, in the
current slot (a kill between the two leaves a count one ahead of its time, nothing worse).

This module imports nothing of torch: ``dtrain status`` reads it.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import struct
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

LIVENESS_DIR = "liveness"

_MAGIC = b"dtrlive1"
# Native layout ("@"): the file is written and read as memory on one machine (readers elsewhere
# are the same kind of machine in one job), and a native 8-byte field at an 8-byte-aligned
# offset is stored with one instruction, so a sequence number itself is never torn.
_HEADER = struct.Struct("@8sqqqq64s")  # magic, pid, rank, world size, attempt, host
_SEQ = struct.Struct("@Q")
# The training thread's: step, phase entered at, progress count, last progress at, phase.
_PHASE_BODY = struct.Struct("@qdqd48p")
_PROGRESS = struct.Struct("@qd")  # progress count, last progress at: what a mark rewrites
_PROGRESS_AT = _SEQ.size + 16  # their offset in a slot (after seq, step, phase entered at)
_PHASE_SLOTS = (128, 256)
# The watchdog thread's: alive at, steps/s, step s, items/s, memory bytes (NaN: unknown),
# item name.
_ALIVE_BODY = struct.Struct("@ddddd32p")
_ALIVE_SLOTS = (384, 512)
_SIZE = 640
_TEXT = 47  # longest phase name kept (a 48p field holds 47 bytes)


@dataclass(frozen=True)
class Speed:
    """A rank's own speed and memory, as its watchdog's thread last measured them."""

    item_name: str = ""  # what items_per_s counts (tokens, samples)
    items_per_s: float | None = None  # items of its last step over its data + compute time
    step_s: float | None = None  # its last step's time
    memory_bytes: float | None = None
    steps_per_s: float | None = None  # steps since the watchdog's previous measurement


@dataclass(frozen=True)
class Liveness:
    """A rank's liveness record. Times are ``time.time()``; ``alive_at`` is 0.0 until the
    watchdog's thread first stamps it."""

    rank: int
    host: str
    pid: int
    attempt: int
    world_size: int
    step: int
    phase: str
    phase_since: float  # when it entered the phase
    progress: int  # progress marks since it entered the phase
    progress_at: float  # its last progress: the last mark, or entering the phase
    alive_at: float  # the watchdog's thread's last stamp
    item_name: str = ""
    items_per_s: float | None = None
    step_s: float | None = None
    memory_bytes: float | None = None
    steps_per_s: float | None = None
    # Read from a file whose next record was begun and never finished: the rank died while
    # it changed phase, so it was just leaving this one.
    interrupted: bool = False

    @property
    def seen_at(self) -> float:
        """The last time anything of the rank wrote the record."""
        return max(self.alive_at, self.progress_at)

    @property
    def motion(self) -> tuple[int, str, float, int]:
        """What changes when the rank moves on: step, phase, phase entered at, progress."""
        return (self.step, self.phase, self.phase_since, self.progress)

    def where(self) -> str:
        if self.interrupted:
            return f"at step {self.step}, as it left {self.phase}"
        return f"at step {self.step} in {self.phase}"

    @classmethod
    def from_dict(cls, record: Any) -> Liveness | None:
        """The record ``asdict`` made (from the store), or None for anything else (a
        field missing or of another type: it is read by a rank that must not fail on it)."""
        if not isinstance(record, dict):
            return None
        known = [f for f in fields(cls) if f.name in record]
        if not all(isinstance(record[f.name], _KINDS[str(f.type)]) for f in known):
            return None
        values = {f.name: record[f.name] for f in known}
        try:
            return cls(**values)
        except TypeError:  # a required field is missing
            return None


# A field's type (its annotation, as a string) -> what a record read back from JSON may hold.
_KINDS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "float": (int, float),
    "float | None": (int, float, type(None)),
    "bool": (bool,),
}


def liveness_path(run_dir: Path | str, rank: int) -> Path:
    return Path(run_dir) / LIVENESS_DIR / f"rank{rank}"


class LivenessFile:
    """This rank's record, for writing (see the module's docstring). :meth:`set_phase` and
    :meth:`mark_progress` belong to the training thread; :meth:`stamp` and :meth:`sync` to the
    watchdog's thread (and to its stopper, once it has ended): each part has one writer."""

    def __init__(
        self, path: Path | None, *, rank: int, world_size: int, attempt: int, host: str, pid: int
    ) -> None:
        """``path``: where the record goes; None keeps it in memory only. So does a path that
        cannot be mapped (``error`` then says why): the hang check and the store's copy work
        from memory alike, only readers of the file (``dtrain status``, the ranks of this
        machine after this one is killed) go without it."""
        self.path: Path | None = None
        self.error = ""
        self._fd = -1
        header = _HEADER.pack(_MAGIC, pid, rank, world_size, attempt, host.encode()[:64])
        header += bytes(_SIZE - _HEADER.size)
        self._map: mmap.mmap | None = None
        if path is not None:
            try:
                self._map, self._fd = _map_new_file(path, header)
                self.path = path
            except (OSError, ValueError) as exc:
                self.error = f"cannot map {path}: {getattr(exc, 'strerror', None) or exc}"
        if self._map is None:
            self._map = mmap.mmap(-1, _SIZE)
            self._map[:] = header
        self.moves = 0  # phase changes and progress marks so far: the hang check's clock
        self._count = 0  # records written to the phase slots
        self._slot = _PHASE_SLOTS[0]
        self._progress = 0
        self._alive_count = 0
        self._encoded: dict[str, bytes] = {}
        self.set_phase("start", 0, time.time())

    # -- the training thread -------------------------------------------------------------

    def set_phase(self, phase: str, step: int, now: float) -> None:
        """Record a phase change (``now``: ``time.time()``): three stores, no system call."""
        buf = self._map
        if buf is None:
            return
        encoded = self._encoded.get(phase)
        if encoded is None:  # phases are a handful of names: encode each once
            encoded = phase.encode()[:_TEXT]
            if len(self._encoded) < 256:  # (a caller that makes up names must not grow it)
                self._encoded[phase] = encoded
        self.moves += 1
        self._count = n = self._count + 1
        self._slot = slot = _PHASE_SLOTS[n & 1]
        self._progress = 0
        _SEQ.pack_into(buf, slot, 2 * n - 1)
        _PHASE_BODY.pack_into(buf, slot + _SEQ.size, step, now, 0, now, encoded)
        _SEQ.pack_into(buf, slot, 2 * n)

    def mark_progress(self, now: float) -> None:
        """A piece of the current phase is done: one store into the current record."""
        buf = self._map
        if buf is None:
            return
        self.moves += 1
        self._progress += 1
        _PROGRESS.pack_into(buf, self._slot + _PROGRESS_AT, self._progress, now)

    # -- the watchdog's thread -----------------------------------------------------------

    def stamp(self, now: float, speed: Speed) -> None:
        """Stamp "alive at ``now``" with the rank's latest speed."""
        buf = self._map
        if buf is None:
            return
        self._alive_count = n = self._alive_count + 1
        slot = _ALIVE_SLOTS[n & 1]
        _SEQ.pack_into(buf, slot, 2 * n - 1)
        _ALIVE_BODY.pack_into(
            buf,
            slot + _SEQ.size,
            now,
            _nan(speed.steps_per_s),
            _nan(speed.step_s),
            _nan(speed.items_per_s),
            _nan(speed.memory_bytes),
            speed.item_name.encode()[:31],
        )
        _SEQ.pack_into(buf, slot, 2 * n)

    def sync(self) -> None:
        """Write the file through to its storage, for readers on other machines. Never
        raises: a storage that fails now is tried again at the next sync."""
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.fdatasync(self._fd)  # (mmap.flush would hold the interpreter meanwhile)

    # -- any thread ----------------------------------------------------------------------

    def record(self) -> Liveness:
        """The record as it stands. One copy of the mapping is taken at once (it holds the
        interpreter); a phase change another thread of this process is in the middle of
        leaves the record before it, complete, as a reader elsewhere would see it."""
        buf = self._map
        assert buf is not None, "the liveness record was read after it was closed"
        data = buf[:]
        settled, record = _decode(data, data)
        assert settled and record is not None
        # This process is alive: a write begun is under way, not cut short.
        return replace(record, interrupted=False)

    def close(self) -> None:
        """Stop writing; the file stays, with the last record, for ``dtrain status``. Only
        once no other thread can write (the watchdog's has ended)."""
        buf, self._map = self._map, None
        if buf is not None:
            buf.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _map_new_file(path: Path, header: bytes) -> tuple[mmap.mmap, int]:
    """A new file at ``path`` holding ``header``, mapped; it replaces the one there (an
    earlier attempt's) whole, once mapped, so a reader sees the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, header, 0)
        # Its blocks are allocated now: a store into the mapping later never asks the
        # filesystem for space (on a full disk, it would be a SIGBUS).
        os.fdatasync(fd)
        mapped = mmap.mmap(fd, _SIZE)
        os.replace(tmp, path)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return mapped, fd


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def read_liveness(path: Path | str, pid: int | None = None) -> Liveness | None:
    """The last complete record in ``path`` (of process ``pid`` when given); None when it is
    missing, unreadable, someone else's or no record. Safe while the writer runs: the file
    is read twice, and counts only when both reads agree."""
    for _attempt in range(5):
        try:
            with open(path, "rb") as fh:
                first = fh.read(_SIZE)
                fh.seek(0)
                second = fh.read(_SIZE)
        except OSError:
            return None
        if len(first) < _SIZE or len(second) < _SIZE:
            return None
        if first[: _HEADER.size] != second[: _HEADER.size] or first[:8] != _MAGIC:
            return None
        settled, record = _decode(first, second)
        if not settled:
            time.sleep(0.001)  # a live writer rewrote a slot between the two reads
            continue
        if record is None or (pid is not None and record.pid != pid):
            return None
        return record
    return None


def read_run_liveness(run_dir: Path) -> dict[int, Liveness]:
    """Every rank's record in the run folder, by rank (unreadable files are left out)."""
    out: dict[int, Liveness] = {}
    for path in (run_dir / LIVENESS_DIR).glob("rank*"):  # none where the folder is missing
        record = read_liveness(path)
        if record is not None and path.name == f"rank{record.rank}":
            out[record.rank] = record
    return dict(sorted(out.items()))


def _decode(first: bytes, second: bytes) -> tuple[bool, Liveness | None]:
    """The newest complete record of two reads of a file, and whether the reads agree (if
    not, a live writer was busy between them: read again)."""
    if first[_PHASE_SLOTS[0] :] != second[_PHASE_SLOTS[0] :]:
        return False, None
    phase_seq, newest, phase = _newest(first, _PHASE_SLOTS, _PHASE_BODY)
    if phase is None:
        return True, None
    _alive_seq, _newest_alive, alive = _newest(first, _ALIVE_SLOTS, _ALIVE_BODY)
    if alive is None:  # never stamped
        alive = (0.0, math.nan, math.nan, math.nan, math.nan, b"")
    _magic, pid, rank, world_size, attempt, host = _HEADER.unpack_from(first)
    step, since, progress, progress_at, raw_phase = phase
    alive_at, steps_per_s, step_s, items_per_s, memory, item = alive
    record = Liveness(
        rank=rank,
        host=host.rstrip(b"\0").decode(errors="replace"),
        pid=pid,
        attempt=attempt,
        world_size=world_size,
        step=step,
        phase=raw_phase.decode(errors="replace"),
        phase_since=since,
        progress=progress,
        progress_at=progress_at,
        alive_at=alive_at,
        item_name=item.decode(errors="replace"),
        items_per_s=_number(items_per_s),
        step_s=_number(step_s),
        memory_bytes=_number(memory),
        steps_per_s=_number(steps_per_s),
        interrupted=newest > phase_seq,  # the next record was begun and never finished
    )
    return True, record


def _newest(
    data: bytes, slots: tuple[int, int], body: struct.Struct
) -> tuple[int, int, tuple[Any, ...] | None]:
    """Of a pair of slots: the sequence number of the newest complete record, the newest
    sequence number written (higher, and odd, if a write was begun after it and never
    finished), and that record's fields."""
    best_seq, best = 0, None
    newest_seq = 0
    for slot in slots:
        (seq,) = _SEQ.unpack_from(data, slot)
        newest_seq = max(newest_seq, seq)
        if seq == 0 or seq % 2 or seq < best_seq:  # never written, torn, or older
            continue
        best_seq, best = seq, body.unpack_from(data, slot + _SEQ.size)
    return best_seq, newest_seq, best
