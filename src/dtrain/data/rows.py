"""One vectorized read of many samples spread over many memory-mapped shards.

A dataset's shards are separate ``.npy`` memory maps. Copying a batch shard by shard costs a
NumPy call (a few microseconds) per shard the batch touches: nothing with five shards, but a
shuffled batch of 256 samples from a dataset of thousands of shards touches ~256 of them, and
per-shard calls then cost several times the copy itself. :class:`ShardRows` reads a batch of
one fixed-size field in one call, however many shards it touches.

How: every shard's rows are addressed through one array that spans the address range of all
the maps. When each map's first row lies a whole number of rows away from the others' (it
does whenever the row size divides the page size, or the maps happen to line up), that array
is a plain C-contiguous ``(rows, row_bytes)`` grid and a batch is one ``take`` -- the same
copy as ``memmap.take`` of a single file. Otherwise it is a byte-strided view (row ``k``
starts at byte ``k``) read by fancy indexing, one call as well.

Safety: the spanning array also covers address space between the maps that belongs to nothing
of ours, so it is never handed out and never read except at rows computed here from ids that
the caller checked are in range; every map it covers is held by this object, so none is
unmapped while it exists.
"""

from __future__ import annotations

from collections.abc import Callable

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


class ShardRows:
    """Batched reads of one fixed-size field (``dtype``, ``row_shape``) across shards whose
    sample ids start at ``starts[s]`` (``starts`` has one more entry: the total).

    Shards are mapped on first use through ``open_shard(s)``, which returns the shard's
    C-contiguous ``(n_s, *row_shape)`` array; a batch that touches only mapped shards maps
    nothing, so random access still opens only the files it reads."""

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
        self._mapped = np.zeros(count, dtype=bool)
        self._complete = False  # every shard mapped: no check needed per batch
        self._address = np.zeros(count, dtype=np.int64)
        self._span: np.ndarray | None = None
        self._grid = False  # the span is a (rows, row_bytes) grid read by take
        self._offset = np.zeros(count, dtype=np.int64)  # per shard, see _build

    def read(self, ids: np.ndarray, shard_of: np.ndarray) -> np.ndarray:
        """Rows ``ids`` (int64, each in ``0 .. starts[-1] - 1``; checked by the caller) of
        shards ``shard_of``, as a new ``(len(ids), *row_shape)`` array."""
        if len(ids) == 0 or self.row_bytes == 0:
            return np.empty((len(ids), *self.row_shape), dtype=self.dtype)
        if not self._complete and not self._mapped[shard_of].all():
            self._map(np.unique(shard_of[~self._mapped[shard_of]]).tolist())
        span = self._span
        assert span is not None
        if self._grid:
            out = np.empty((len(ids), *self.row_shape), dtype=self.dtype)
            flat = out.reshape(len(ids), -1).view(np.uint8)  # the same memory, as bytes
            # "clip" skips take's bounds check, which would copy into a buffer first; the
            # ids are in range, so the rows are too.
            span.take(ids + self._offset[shard_of], 0, flat, "clip")
            return out
        rows = span[ids * self.row_bytes + self._offset[shard_of]]
        return rows.view(self.dtype).reshape(len(ids), *self.row_shape)

    def _map(self, shards: list[int]) -> None:
        for s in shards:
            values = self.open_shard(s)
            if not values.flags.c_contiguous:
                raise ValueError(f"shard {s} is not C-contiguous")
            self._maps[s] = values
            self._address[s] = values.__array_interface__["data"][0]
            self._mapped[s] = True
        self._complete = bool(self._mapped.all())
        self._build()

    def _build(self) -> None:
        """The spanning array over the mapped shards, and per shard the offset that turns a
        sample id into its row of the grid (or its byte in the strided view)."""
        mapped = np.flatnonzero(self._mapped)
        address = self._address[mapped]
        sizes = np.diff(self.starts)[mapped] * self.row_bytes
        first, end = int(address.min()), int((address + sizes).max())
        size = self.row_bytes
        if bool(np.all((address - first) % size == 0)):
            self._span = np.asarray(_Span(first, ((end - first) // size, size), None))
            self._offset[mapped] = (address - first) // size - self.starts[mapped]
            self._grid = True
        else:
            shape = (end - first - size + 1, size)
            self._span = np.asarray(_Span(first, shape, (1, 1)))
            self._offset[mapped] = address - first - self.starts[mapped] * size
            self._grid = False
