"""Requests an S3 client makes, counted at the client (botocore's events on s3fs's own
client): by kind, with the bytes each way, and the CPU time of this process meanwhile. Exact
where the times are noise: what ``bench_s3_checkpoint.py`` prints beside them."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

# The kinds, in the order printed; a ranged GET is a GetObject with a Range.
KINDS = {
    "PutObject": "PUT",
    "CreateMultipartUpload": "MPU create",
    "UploadPart": "MPU part",
    "CompleteMultipartUpload": "MPU complete",
    "AbortMultipartUpload": "MPU abort",
    "CopyObject": "COPY",
    "GetObject": "GET",
    "HeadObject": "HEAD",
    "HeadBucket": "HEAD bucket",
    "ListObjectsV2": "LIST",
    "DeleteObject": "DELETE",
    "DeleteObjects": "DELETE",
}


@dataclass
class Tally:
    """One measured call: requests by kind, bytes sent and received, CPU seconds."""

    calls: dict[str, int] = field(default_factory=dict)
    sent: int = 0
    received: int = 0
    cpu_s: float = 0.0

    def kinds(self) -> list[tuple[str, int]]:
        """(kind, requests), in the order of :data:`KINDS`."""
        return sorted(self.calls.items(), key=_order)

    def line(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.kinds())
        return (
            f"{sum(self.calls.values())} requests ({kinds}); "
            f"{self.sent / 2**20:.1f} MiB up, {self.received / 2**20:.1f} MiB down; "
            f"CPU {self.cpu_s:.3f} s"
        )


def _order(item: tuple[str, int]) -> int:
    names = [*dict.fromkeys(KINDS.values()), "range GET"]
    return names.index(item[0]) if item[0] in names else len(names)


def _body_bytes(body: Any) -> int:
    """The bytes a request's body sends: a buffer's length, a file's rest (from where it is)."""
    if isinstance(body, (bytes, bytearray, memoryview)):
        return memoryview(body).nbytes
    if isinstance(body, io.IOBase) and body.seekable():
        at = body.tell()
        end = body.seek(0, io.SEEK_END)
        body.seek(at)
        return end - at
    return 0


class Counter:
    """Counts the requests of the s3fs file system ``fs`` while :meth:`count` is open."""

    def __init__(self, fs: Any) -> None:
        self._lock = threading.Lock()
        self._now: Tally | None = None
        events = fs.s3.meta.events
        events.register("provide-client-params.s3", self._params)
        events.register("after-call.s3", self._answer)

    def _params(self, event_name: str, params: dict[str, Any], **_: Any) -> None:
        op = event_name.rsplit(".", 1)[1]
        kind = KINDS.get(op, op)
        if op == "GetObject" and "Range" in params:
            kind = "range GET"
        size = _body_bytes(params.get("Body"))
        with self._lock:
            if self._now is not None:
                self._now.calls[kind] = self._now.calls.get(kind, 0) + 1
                self._now.sent += size

    def _answer(self, event_name: str, parsed: dict[str, Any], **_: Any) -> None:
        if event_name.endswith(".GetObject"):
            with self._lock:
                if self._now is not None:
                    self._now.received += int(parsed.get("ContentLength", 0) or 0)

    @contextmanager
    def count(self) -> Iterator[Tally]:
        tally = Tally()
        with self._lock:
            self._now = tally
        cpu = time.process_time()
        try:
            yield tally
        finally:
            tally.cpu_s = time.process_time() - cpu
            with self._lock:
                self._now = None
