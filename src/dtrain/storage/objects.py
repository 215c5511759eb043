"""A key (or a prefix) in an object store through fsspec, as the run folder's checkpoints and
the shards of a dataset both reach it: :class:`ObjectPath` (the part of :class:`pathlib.Path`'s
interface that dtrain uses), :data:`Location` (a local path or one), :func:`location` (which of
them a string names). Every request runs under :data:`RETRY_POLICY`; a store that stops
answering is a :class:`StoreError` naming the store, the key and that policy, never a hang.

Credentials and the endpoint come from where botocore looks (``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE`` and the AWS config files, ``AWS_ENDPOINT_URL_S3``
or ``AWS_ENDPOINT_URL`` for an S3-compatible store); nothing here writes any of them down.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from dtrain.errors import UserError
from dtrain.fsutil import scheme_of

# Each request: botocore's standard retries (3 attempts, backing off), 5 s to connect and 30 s
# to read, so that a store that stops answering fails a save in minutes, named, before the
# checkpointer's collective limit; the words every such failure carries.
CONNECT_TIMEOUT_S = 5
READ_TIMEOUT_S = 30
ATTEMPTS = 3
RETRY_POLICY = (
    f"{ATTEMPTS} attempts per request, {CONNECT_TIMEOUT_S} s to connect, {READ_TIMEOUT_S} s to read"
)
# The part size of a multipart upload (S3's smallest is 5 MiB): a file streams out in parts of
# this size as torch.save writes it, never held whole in memory.
PART_BYTES = 16 * 2**20
# Objects a listing request asks for at most (S3's own most).
LIST_PAGE = 1000


class StoreError(OSError):
    """An object store failed a request after its retries (the message names the store, the
    key and the retry policy)."""


class NoConditionalWrites(StoreError):
    """The store refuses conditional writes (``If-None-Match``, ``If-Match``) as not
    implemented: OpenStack Swift's S3 API, older S3-compatible stores."""


def endpoint() -> str:
    """The S3 endpoint botocore will use, in words (the variables it honours, in its order)."""
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"


def file_system(scheme: str) -> Any:
    """fsspec's file system for ``scheme`` (fsspec keeps the instance), its
    listings never cached (another rank or machine changes them); a user error when the
    package it needs is missing."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with torch
        raise UserError(f"{scheme}:// needs fsspec: pip install -e '.[s3]'") from None
    if scheme != "s3":
        try:
            return fsspec.filesystem(scheme, use_listings_cache=False)
        except (ImportError, ValueError) as exc:
            raise UserError(f"{scheme}:// cannot be opened through fsspec: {exc}") from None
    try:
        import s3fs
    except ImportError:
        raise UserError(
            "s3:// needs the s3fs package, which is not installed: pip install -e '.[s3]'"
        ) from None
    # The endpoint passed, not left to botocore: fsspec keeps one instance per set of
    # arguments, so a process whose endpoint variable changes (a notebook, a test) gets a
    # client of the new store instead of the first one's.
    url = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
    fs = s3fs.S3FileSystem(
        endpoint_url=url,
        use_listings_cache=False,
        config_kwargs={
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": ATTEMPTS, "mode": "standard"},
        },
    )
    fs.retries = 1  # botocore retries each request (above); s3fs's own would multiply them
    return fs


def _raise(exc: BaseException) -> None:
    raise exc


@dataclass(frozen=True)
class _Stat:
    st_size: int


class ObjectPath:
    """A key (or a prefix of keys) in an object store, with the part of :class:`pathlib.Path`'s
    interface that the checkpoint code uses. A "folder" is a prefix: it exists while an object
    under it does, and making one does nothing."""

    def __init__(self, url: str, fs: Any = None) -> None:
        self.url = url.rstrip("/")
        self.scheme = scheme_of(self.url)
        self.fs = fs if fs is not None else file_system(self.scheme)

    # -- names ---------------------------------------------------------------------------

    def __truediv__(self, name: str) -> ObjectPath:
        return ObjectPath(f"{self.url}/{name}", self.fs)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"ObjectPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    @property
    def name(self) -> str:
        return self.url.rpartition("/")[2]

    @property
    def bucket_and_key(self) -> tuple[str, str]:
        """The bucket and the key (or prefix) in it, as S3's own requests name them."""
        bucket, _, key = self.url.split("://", 1)[1].partition("/")
        return bucket, key

    @property
    def parent(self) -> ObjectPath:
        head = self.url.rpartition("/")[0]
        return ObjectPath(head, self.fs) if not head.endswith(":/") else self

    def with_name(self, name: str) -> ObjectPath:
        return self.parent / name

    def resolve(self) -> ObjectPath:
        return self

    @property
    def bucket(self) -> str:
        return self.url.split("://", 1)[1].split("/", 1)[0]

    def store(self) -> str:
        """The store, in words, for errors."""
        url = getattr(self.fs, "endpoint_url", None) or endpoint()
        where = f", endpoint {url}" if self.scheme == "s3" else ""
        return f"object store {self.scheme}://{self.bucket}{where}"

    # -- requests ------------------------------------------------------------------------

    def _call(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except (FileNotFoundError, FileExistsError, IsADirectoryError):
            raise
        except Exception as exc:
            raise StoreError(
                f"the {self.store()} failed to {what} {self.url} ({RETRY_POLICY}): "
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            ) from None

    def exists(self) -> bool:
        return bool(self._call("look up", lambda: self.fs.exists(self.url)))

    def is_dir(self) -> bool:
        return bool(self._call("list", lambda: self.fs.isdir(self.url)))

    def is_file(self) -> bool:
        return bool(self._call("look up", lambda: self.fs.isfile(self.url)))

    def iterdir(self) -> Iterator[ObjectPath]:
        try:
            names = self._call("list", lambda: self.fs.ls(self.url, detail=False))
        except FileNotFoundError:
            names = []
        for name in names:
            child = self / str(name).rstrip("/").rpartition("/")[2]
            if child.url != self.url:
                yield child

    def sizes(self) -> dict[str, int]:
        """Every object under this prefix, by its name below it (``a/b`` for a nested one), with
        its size: one flat listing (a request per object otherwise); empty where none is."""
        if self.scheme == "s3":
            return dict(self._call("list", self._s3_sizes))
        try:
            found = self._call("list", lambda: self.fs.find(self.url, detail=True))
        except FileNotFoundError:
            return {}
        head = self.url.split("://", 1)[1] + "/"
        return {str(key).removeprefix(head): int(info["size"]) for key, info in found.items()}

    def _s3_sizes(self) -> dict[str, int]:
        """:meth:`sizes` in S3: one ListObjectsV2 request a :data:`LIST_PAGE` objects, and
        none more where there are none (s3fs's ``find`` then asks for a HEAD and another
        listing, to tell whether the prefix is an object itself, which a prefix of checkpoints
        or shards never is)."""
        bucket, key = self.bucket_and_key
        prefix = f"{key}/" if key else ""
        found: dict[str, int] = {}
        asked: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "MaxKeys": LIST_PAGE}
        while True:
            try:
                page = self.fs.call_s3("list_objects_v2", **asked)
            except FileNotFoundError:  # no such bucket: nothing under the prefix
                return found
            for item in page.get("Contents", []):
                name = str(item["Key"])[len(prefix) :]
                if name and not name.endswith("/"):  # a folder's placeholder is no object
                    found[name] = int(item["Size"])
            if not page.get("IsTruncated"):
                return found
            asked["ContinuationToken"] = page["NextContinuationToken"]

    def glob(self, pattern: str) -> Iterator[ObjectPath]:
        for name in self._call("list", lambda: self.fs.glob(f"{self.url}/{pattern}")):
            yield self / str(name).rpartition("/")[2]

    def stat(self) -> _Stat:
        return _Stat(int(self._call("look up", lambda: self.fs.size(self.url))))

    def read_bytes(self) -> bytes:
        return bytes(self._call("read", lambda: self.fs.cat_file(self.url)))

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes ``start`` to ``end`` (exclusive) of the object: one ranged request."""
        return bytes(self._call("read", lambda: self.fs.cat_file(self.url, start=start, end=end)))

    def read_text(self, errors: str = "strict") -> str:
        return self.read_bytes().decode(errors=errors)

    def open(self, mode: str = "rb") -> IO[Any]:
        options = {"block_size": PART_BYTES} if "w" in mode else {}
        return self._call("open", lambda: self.fs.open(self.url, mode, **options))

    def write_bytes(self, data: bytes) -> None:
        self._call("write", lambda: self.fs.pipe_file(self.url, data))

    def create(self, data: bytes) -> None:
        """Write the object only where none exists (a conditional write, ``If-None-Match``):
        FileExistsError otherwise; :class:`NoConditionalWrites` where the store has none."""
        try:
            self.fs.pipe_file(self.url, data, mode="create")
        except FileExistsError:
            raise
        except Exception as exc:
            self._refused(exc)

    def etag(self) -> str:
        """The object's version as the store names it (FileNotFoundError: none)."""
        info = self._call("look up", lambda: self.fs.info(self.url))
        return str(info.get("ETag") or info.get("etag") or "")

    def replace_if(self, data: bytes, etag: str) -> bool:
        """Overwrite the object only while it is still the version ``etag`` (a conditional
        write, ``If-Match``); False when it changed (or was removed) meanwhile."""
        bucket, key = self.bucket_and_key
        try:
            self.fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfMatch=etag)
        except FileNotFoundError:
            return False
        except Exception as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EINVAL:  # 412: another version
                return False
            self._refused(exc)
        return True

    def _refused(self, exc: Exception) -> None:
        """A conditional write's failure, in words: the store has none (501, which s3fs gives
        as ENOSYS), or another failure of the store."""
        if isinstance(exc, OSError) and exc.errno == errno.ENOSYS:
            raise NoConditionalWrites(
                f"the {self.store()} does not implement conditional writes ({exc})"
            ) from None
        self._call("write", lambda: _raise(exc))

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self._call("delete", lambda: self.fs.rm_file(self.url))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """A prefix needs no making."""

    def remove_tree(self) -> None:
        """Delete every object under this prefix, one request each: a multi-object delete
        needs a Content-MD5 header that botocore no longer sends, which stores such as
        OpenStack Swift's S3 API require (a checkpoint's folder holds a few files a rank)."""
        try:
            keys = self._call("list", lambda: self.fs.find(self.url))
        except FileNotFoundError:
            return
        for key in keys:
            (ObjectPath(f"{self.scheme}://{key}", self.fs)).unlink(missing_ok=True)


Location = Path | ObjectPath


def store_refusal(label: str, where: ObjectPath, exc: StoreError, doing: str = "") -> UserError:
    """A store's failure to answer for ``label`` (the config key and its value) as a user's
    mistake in one line: no credentials, an endpoint that does not answer, or else ``doing``
    and the store's own words."""
    text = str(exc)
    if "NoCredentialsError" in text or "PartialCredentials" in text:
        return UserError(
            f"{label}: no credentials for the {where.store()}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE with ~/.aws/credentials"
        )
    if "EndpointConnectionError" in text or "ConnectTimeout" in text:
        return UserError(
            f"{label}: the {where.store()} does not answer; check AWS_ENDPOINT_URL_S3 "
            "(or AWS_ENDPOINT_URL) and that the store runs"
        )
    return UserError(f"{label}: {doing}{text}")


def location(text: str | Location) -> Location:
    """What a run folder, a checkpoint's folder or a file in one is: an :class:`ObjectPath` for
    a URL (``s3://bucket/key``), else a local path."""
    if isinstance(text, (Path, ObjectPath)):
        return text
    return ObjectPath(text) if scheme_of(text) else Path(text)
