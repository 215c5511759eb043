"""One vectorized read of many samples spread over many memory-mapped shards.

A dataset's shards are separate ``.npy`` memory maps. Copying a batch shard by shard costs a
NumPy call (a few microseconds) per shard the batch touches: nothing with five shards, but a
shuffled batch of 256 samples from a dataset of thousands of shards touches ~256 of them, and
per-shard calls then cost several times the copy itself. :class:`ShardRows` reads a batch of
one fixed-size field in one call, however many shards it touches.

How: every shard's rows are addressed through one array that spans the address range of all
the maps. When each map's first row lies a whole number of rows away from the others' (as
it does when the row size divides the page size and the files' ``.npy`` headers have the same
length, the usual case: maps start on page boundaries, the rows after the header), that array
is a plain C-contiguous ``(rows, row_bytes)`` grid and a batch is one ``take`` -- the same
copy as ``memmap.take`` of a single file. Otherwise it is a byte-strided view (row ``k``
starts at byte ``k``) read by fancy indexing, one call as well.

Safety: the spanning array also covers address space between the maps that belongs to nothing
of ours, so it is never handed out and never read except at rows computed here from ids that
the caller checked are in range; every map it covers is held by this object, so none is
unmapped while it exists.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class _Span:
    """Exposes a read-only address range to NumPy through the array interface."""

    def __init__(self, address: int, shape: tuple[int, int], strides: tuple[int, int] | None):
        self.__array_interface__ = {
            "data": (address, True),
            "shape": shape,
            "strides": strides,
            "typestr": "|u1",
            "version": 3,
        }


@dataclass(frozen=True)
class _Layout:
    """The spanning array over some mapped shards, and per shard the offset that turns a sample
    id into its row of the grid (or its first byte in the strided view). Never changed once
    built: a reader takes one and uses it whole, while another thread may build the next."""

    span: np.ndarray
    offset: np.ndarray
    grid: bool  # the span is a (rows, row_bytes) grid read by take
    mapped: np.ndarray  # bool per shard: the shards this layout covers
    complete: bool  # every shard is covered: no check needed per batch


class ShardRows:
    """Batched reads of one fixed-size field (``dtype``, ``row_shape``) across shards whose
    sample ids start at ``starts[s]`` (``starts`` has one more entry: the total).

    Shards are mapped on first use through ``open_shard(s)``, which returns the shard's
    C-contiguous ``(n_s, *row_shape)`` array; a batch that touches only mapped shards maps
    nothing, so random access still opens only the files it reads. Safe to call from several
    threads (a prefetch thread and the training thread)."""

    def __init__(
        self,
        open_shard: Callable[[int], np.ndarray],
        starts: np.ndarray,
        dtype: np.dtype,
        row_shape: tuple[int, ...],
    ) -> None:
        self.open_shard = open_shard
        self.starts = starts
        self.dtype = np.dtype(dtype)
        self.row_shape = row_shape
        self.row_bytes = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        count = len(starts) - 1
        self._maps: list[np.ndarray | None] = [None] * count  # holds every mapped shard
        self._address = np.zeros(count, dtype=np.int64)
        self._layout: _Layout | None = None
        self._lock = threading.Lock()  # one thread maps shards and builds a layout at a time

    def read(self, ids: np.ndarray, shard_of: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int64, each in ``0 .. starts[-1] - 1``; checked by the caller) of
        shards ``shard_of``, as a new ``(len(ids), *row_shape)`` array."""
        if len(ids) == 0 or self.row_bytes == 0:
            return np.empty((len(ids), *self.row_shape), dtype=self.dtype)
        layout = self._layout
        if layout is None or (not layout.complete and not layout.mapped[shard_of].all()):
            layout = self._extend(shard_of)
        if layout.grid:
            out = np.empty((len(ids), *self.row_shape), dtype=self.dtype)
            flat = out.reshape(len(ids), -1).view(np.uint8)  # the same memory, as bytes
            # "clip" skips take's bounds check, which would copy into a buffer first; the
            # ids are in range, so the rows are too.
            layout.span.take(ids + layout.offset[shard_of], 0, flat, "clip")
            return out
        rows = layout.span[ids * self.row_bytes + layout.offset[shard_of]]
        return rows.view(self.dtype).reshape(len(ids), *self.row_shape)

    def _extend(self, shard_of: np.ndarray) -> _Layout:
        """A layout that also covers the shards in ``shard_of``, mapping those not mapped."""
        with self._lock:
            layout = self._layout  # another thread may have extended it meanwhile
            mapped = np.zeros(len(self._maps), bool) if layout is None else layout.mapped.copy()
            for s in np.unique(shard_of[~mapped[shard_of]]).tolist():
                if self._maps[s] is None:
                    values = self.open_shard(s)
                    if not values.flags.c_contiguous:
                        raise ValueError(f"shard {s} is not C-contiguous")
                    self._address[s] = values.__array_interface__["data"][0]
                    self._maps[s] = values
                mapped[s] = True
            layout = self._layout = self._build(mapped)
            return layout

    def _build(self, mapped: np.ndarray) -> _Layout:
        shards = np.flatnonzero(mapped)
        address = self._address[shards]
        size = self.row_bytes
        first = int(address.min())
        end = int((address + np.diff(self.starts)[shards] * size).max())
        offset = np.zeros(len(mapped), dtype=np.int64)
        grid = bool(np.all((address - first) % size == 0))
        if grid:
            span = np.asarray(_Span(first, ((end - first) // size, size), None))
            offset[shards] = (address - first) // size - self.starts[shards]
        else:
            span = np.asarray(_Span(first, (end - first - size + 1, size), (1, 1)))
            offset[shards] = address - first - self.starts[shards] * size
        return _Layout(span, offset, grid, mapped, bool(mapped.all()))
