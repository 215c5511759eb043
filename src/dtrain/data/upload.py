"""``dtrain prepare SOURCE s3://bucket/data``: a dataset written into an object store
(docs/data.md, "Shards in an object store").

The shards are written as always into a local temporary folder (atomic, checked), then
uploaded, and the manifest last: a store has no rename, so the manifest is the commit, and an
overwrite takes the old manifest away before anything else. The uploaded manifest adds each
piece's SHA-256 so that a reader checks every range it fetches; the dataset's fingerprint is
the local one's, so a run can resume on the same data read from either place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dtrain.config.sections import STORE_PIECE_BYTES
from dtrain.data.format import MANIFEST
from dtrain.data.store_shards import piece_hashes
from dtrain.errors import DataError
from dtrain.storage.objects import ObjectPath, StoreError


def check_store_output(out: ObjectPath, overwrite: bool) -> None:
    """Before the source is read: the bucket exists and the prefix holds no dataset (unless
    ``overwrite``) and nothing else: one line each."""
    label = f"output {out}"
    if not out.bucket or out.url.endswith(f"://{out.bucket}"):
        raise DataError(f"{label}: give a prefix in the bucket, e.g. {out.scheme}://BUCKET/data")
    try:
        if not ObjectPath(f"{out.scheme}://{out.bucket}", out.fs).exists():
            raise DataError(
                f"{label}: the bucket {out.bucket!r} does not exist in the {out.store()}; "
                "create it, or choose another output"
            )
        has_manifest = (out / MANIFEST).exists()
        has_objects = out.is_dir()
    except StoreError as exc:
        raise DataError(f"{label}: {exc}") from None
    if has_manifest and not overwrite:
        raise DataError(f"{label} already holds a dataset; pass --overwrite to replace it")
    if has_objects and not has_manifest:
        raise DataError(
            f"{label} holds objects but no dataset (no {MANIFEST}); it was left as it is: "
            "choose another prefix, or remove them yourself"
        )


def upload_dataset(local: Path, out: ObjectPath, piece_bytes: int = STORE_PIECE_BYTES) -> None:
    """Upload the dataset folder ``local`` to ``out``, its manifest last (see the module);
    readers fetch it in pieces of ``piece_bytes`` (smaller ones: tests of the cache)."""
    manifest: dict[str, Any] = json.loads((local / MANIFEST).read_text())
    try:
        (out / MANIFEST).unlink(missing_ok=True)  # the old dataset ends here, if any
        out.remove_tree()
        manifest["piece_bytes"] = piece_bytes
        for shard in manifest["shards"]:
            for fname, info in shard["files"].items():
                info["piece_sha256"] = piece_hashes(local / fname, piece_bytes)
                with open(local / fname, "rb") as src, (out / fname).open("wb") as dst:
                    while chunk := src.read(STORE_PIECE_BYTES * 8):
                        dst.write(chunk)
        (out / MANIFEST).write_bytes(json.dumps(manifest, indent=1).encode())
    except OSError as exc:  # a StoreError names the store and its retry policy
        raise DataError(f"uploading the dataset to {out}: {exc}; run the prepare again") from None
