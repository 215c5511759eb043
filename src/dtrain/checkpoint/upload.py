"""A checkpoint file's upload to an object store, its parts sent while the next ones are written.

``torch.save`` hands its writer one record after another; a multipart upload sent part by part
in step with it (what an fsspec file opened ``"wb"`` does) leaves the link idle while each part
is serialized, and the serializer idle while each part is sent. Here each full part goes out
on the store's own event loop (s3fs's, the one its requests run on) and the writer goes on
with the next; at most :data:`PARTS_IN_FLIGHT` parts are in flight, so a file of any size holds
about ``(PARTS_IN_FLIGHT + 1) * PART_BYTES`` bytes beside its state (80 MiB). A file of at
most :data:`ONE_REQUEST_BYTES` (100 MiB) is held whole and sent as one ``put_object``: a
multipart upload costs two requests more, and a store assembles its parts (moto's server, a
96 MiB DCP file: 0.21 s of this process's CPU as one request against 0.28 s as 7 parts). The
files before it still upload meanwhile, up to :class:`Uploads`' budget.

What it keeps of the file protocol it replaces: the object is complete and visible only once
:meth:`PartUpload.complete` returns (it waits for every request, then completes a multipart
upload), which :meth:`~PartUpload.close` calls -- or, in a save, :class:`Uploads`, once later
files need its room, and before the rank reports its files written; a file sent as one
``put_object`` is whole or absent; a failure aborts the upload (nothing partial stays behind,
and the store frees the parts) and is a :class:`~dtrain.storage.objects.StoreError` naming the
store, the key and the retry policy. S3's API only (s3fs): another fsspec store's file is
fsspec's own.
"""

from __future__ import annotations

import asyncio
import io
from collections import deque
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from contextlib import suppress
from typing import Any

from dtrain.storage.objects import PART_BYTES, ObjectPath

# Parts sent at once per file (each PART_BYTES): s3fs's own put sends up to 10; 4 keep a
# loopback or a LAN store's link busy with 64 MiB in flight.
PARTS_IN_FLIGHT = 4
# The largest file sent as one request, held whole meanwhile: where fsspec's own upload
# (s3fs's put_file) makes one too -- under two of its 50 MiB chunks -- so that a save asks
# the store for what a plain transfer of its files would.
ONE_REQUEST_BYTES = 100 * 2**20


class PartUpload:
    """A write-only stream of bytes into the object ``path`` (see the module's text)."""

    def __init__(
        self,
        path: ObjectPath,
        part_bytes: int | None = None,
        in_flight: int | None = None,
        uploads: Uploads | None = None,
        one_request: int | None = None,
        digest: Callable[[memoryview | bytes], None] | None = None,
    ) -> None:
        self.path = path
        # What every byte is fed to, once and in order, as it is sent (a file's piece hashes):
        # a part just before its request (the next is written meanwhile), a file sent as one
        # request just after its request starts (see close). From this upload's own copy,
        # never the writer's buffers, which may be gone by then: a tensor's memory
        # torch.save hands over is only valid while its write() lasts.
        self._digest = digest
        self._uploads = uploads  # completes this upload later (None: close completes it)
        self.part_bytes = part_bytes or PART_BYTES  # read now: tests make them small
        self.in_flight = in_flight or PARTS_IN_FLIGHT
        # The most a file may be to go as one request (at least what its parts would hold).
        self.one_request = max(
            one_request or ONE_REQUEST_BYTES, (self.in_flight + 1) * self.part_bytes
        )
        self._bucket, self._key = path.bucket_and_key
        # What is written is copied once, into a buffer that goes out as it is (a request
        # owns its buffer; what follows gets a fresh one): the whole file while it may still
        # be one request, then each part. A BytesIO, not a bytearray: botocore passes a file
        # on as it is, which aiohttp sends 256 KiB at a time, whereas a bytearray body (not
        # wrapped as bytes are) is joined to the request's headers and the unsent rest copied
        # into the transport's buffer -- two copies of the body on the store's event loop.
        self._part = io.BytesIO()
        self._upload_id: str | None = None
        self._pending: deque[tuple[int, Future[Any]]] = deque()  # (part number, its request)
        self._parts: list[dict[str, Any]] = []
        self._last: Future[Any] | None = None  # a one-request file's put_object
        self._closed = False  # no more writes (its last requests may be in flight)
        self._done = False  # complete, or aborted
        self.holds = 0  # once closed: about the bytes its requests in flight hold

    # -- requests ------------------------------------------------------------------------

    def _start(self, method: str, **kwargs: Any) -> Future[Any]:
        """One request on the store's event loop, not waited for."""
        fs = self.path.fs
        call = fs._call_s3(method, Bucket=self._bucket, Key=self._key, **kwargs)
        return asyncio.run_coroutine_threadsafe(call, fs.loop)

    def _wait(self, future: Future[Any]) -> Any:
        return self.path._call("write", future.result)

    def _send(self, part: io.BytesIO) -> None:
        if self._upload_id is None:
            self._upload_id = self._wait(self._start("create_multipart_upload"))["UploadId"]
        while len(self._pending) >= self.in_flight:  # the bound on memory and connections
            self._finish_oldest()
        number = len(self._parts) + len(self._pending) + 1
        part.seek(0)
        future = self._start("upload_part", PartNumber=number, UploadId=self._upload_id, Body=part)
        self._pending.append((number, future))

    def _finish_oldest(self) -> None:
        number, future = self._pending.popleft()
        out = self._wait(future)
        header = {"PartNumber": number, "ETag": out["ETag"]}
        if "ChecksumSHA256" in out:  # as s3fs's own file does
            header["ChecksumSHA256"] = out["ChecksumSHA256"]
        self._parts.append(header)

    # -- the stream ----------------------------------------------------------------------

    def write(self, data: Any) -> int:
        if self._closed:
            raise ValueError(f"write to {self.path}, which is closed")
        view = memoryview(data).cast("B")
        try:
            while len(view):
                # Until the file outgrows what one request may carry, it is held (a small
                # file is one put_object); then it goes out part by part.
                limit = self.part_bytes if self._upload_id is not None else self.one_request
                held = self._part.tell()  # bytes in the buffer (it is only appended to)
                if held >= limit:  # full, and more is coming
                    whole, self._part = self._part, io.BytesIO()
                    if self._upload_id is not None:  # a part
                        self._send(self._fed(whole))
                    else:  # the file held so far, cut into parts (copied once more)
                        with whole.getbuffer() as buffer:
                            self._feed(buffer)
                            for at in range(0, held, self.part_bytes):
                                self._send(io.BytesIO(buffer[at : at + self.part_bytes]))
                    continue
                take = view[: limit - held]
                self._part.write(take)
                view = view[len(take) :]
        except BaseException:
            self.abort()
            raise
        return memoryview(data).nbytes

    def _feed(self, data: memoryview | bytes) -> None:
        if self._digest is not None:
            self._digest(data)

    def _fed(self, part: io.BytesIO) -> io.BytesIO:
        """``part``, its bytes fed to the digest (before its request reads it)."""
        with part.getbuffer() as buffer:
            self._feed(buffer)
        return part

    def flush(self) -> None:
        """Nothing: a part goes out once full, the rest at :meth:`close`."""

    def fileno(self) -> int:
        raise io.UnsupportedOperation(f"{self.path} is an object in a store, not a file")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Send what is left; then, unless a save's :class:`Uploads` waits for it later, wait
        for every part and complete the upload: the object exists (whole) once
        :meth:`complete` returns."""
        if self._closed:
            return
        try:
            if self._upload_id is None:  # no larger than one_request: one request
                # Sent first and hashed while it goes out: the store starts on the file's
                # request before its digest is done (12 MB: ~6 ms of SHA-256 sooner). The hash
                # reads the BytesIO's buffer through an export, which keeps it from being
                # resized while the request reads it (reads are all either side does; nothing
                # closes it meanwhile: aiobotocore gives aiohttp an IOBase body behind a
                # wrapper whose close does nothing, and a close refused would fail the
                # request, named, never send other bytes). The body stays the BytesIO, which
                # aiohttp streams: given bytes, it wrote them to the socket at once and copied
                # the unsent rest into its transport's buffer (64 MiB, moto: 4.7 s against
                # 0.75 s); given bytes sharing the BytesIO's buffer (getvalue), it copied the
                # whole (its getbuffer unshares it).
                self.holds = self._part.tell()
                self._part.seek(0)
                self._last = self._start("put_object", Body=self._part)
                with self._part.getbuffer() as held:
                    self._feed(held)
            else:
                if self._part.tell():
                    self._send(self._fed(self._part))
                self.holds = len(self._pending) * self.part_bytes
            self._closed = True
            self._part = io.BytesIO()
        except BaseException:
            self.abort()
            raise
        if self._uploads is not None:
            self._uploads.add(self)
        else:
            self.complete()

    def complete(self) -> None:
        """Wait for what is in flight, and complete a multipart upload."""
        if self._done:
            return
        try:
            if self._last is not None:
                self._wait(self._last)
            else:
                while self._pending:
                    self._finish_oldest()
                done = self._start(
                    "complete_multipart_upload",
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": self._parts},
                )
                self._wait(done)
            self._done = True
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Give the upload up: no object, the parts sent freed (a failed abort leaves them to
        the store's lifecycle rules; the failure that led here is what the caller sees)."""
        if self._done:
            return
        self._closed = self._done = True
        self._part = io.BytesIO()
        futures = [future for _, future in self._pending]
        if self._last is not None:
            futures.append(self._last)
        for future in futures:
            future.cancel()
        for future in futures:
            with suppress(Exception, CancelledError):
                future.result()
        self._pending.clear()
        if self._upload_id is not None:
            with suppress(Exception):
                self._start("abort_multipart_upload", UploadId=self._upload_id).result()


class Uploads:
    """The files of one save whose last requests are still in flight once they are closed, so
    that the next file is serialized and sent meanwhile: as many as hold ``budget`` bytes
    together, the oldest completed first. The default is what one file may hold as one
    request, :data:`ONE_REQUEST_BYTES`, and one part more: a large file's upload goes on
    while the next is written, and the small ones after it (``meta.json``, DCP's ``.metadata``)
    need not wait for it. Each is completed by :meth:`wait` at the latest -- which the save
    calls before it reports its files written (the marker comes after that)."""

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget if budget is not None else ONE_REQUEST_BYTES + PART_BYTES
        self._open: deque[PartUpload] = deque()

    @property
    def in_flight(self) -> int:
        """Files closed whose upload is not complete yet."""
        return len(self._open)

    def add(self, upload: PartUpload) -> None:
        while self._open and sum(u.holds for u in self._open) + upload.holds > self.budget:
            self._open.popleft().complete()
        self._open.append(upload)

    def wait(self) -> None:
        """Complete every upload (the first failure raised, the others aborted)."""
        try:
            while self._open:
                self._open[0].complete()
                self._open.popleft()
        finally:
            self.abort()

    def abort(self) -> None:
        while self._open:
            self._open.popleft().abort()
