"""Turn raw data into a sharded dataset: text, JSONL, ``.npy`` arrays and Parquet.

Each source is an iterator of samples (dicts of arrays) fed to :func:`write_shards`, which makes
the write atomic. Text becomes byte-level tokens unless a tokenizer is given: any function from
text to ids (Python API), or a Hugging Face ``tokenizer.json`` (``--tokenizer``,
:mod:`dtrain.data.tokenizer`); ids are stored as uint16 or uint32 by the vocabulary's size.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dtrain.data.shards import (
    DEFAULT_SHARD_BYTES,
    FieldSpec,
    ShardWriter,
    to_field_array,
    write_shards,
)
from dtrain.data.upload import check_store_output, upload_dataset
from dtrain.data.writer import check_replaceable
from dtrain.errors import DataError
from dtrain.fsutil import require_output_folder, scheme_of
from dtrain.storage.objects import Location, ObjectPath

Tokenizer = Callable[[str], Sequence[int]]
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text")
FORMATS = ("auto", "text", "jsonl", "npy", "parquet")


def _token_field(tokenized: bool, vocab_size: int | None) -> FieldSpec:
    """Bytes for byte-level text; the narrowest type that holds the vocabulary for token ids
    (uint32 when the vocabulary size is not given)."""
    if not tokenized:
        return FieldSpec("uint8", None)
    if vocab_size is not None and vocab_size <= 2**16:
        return FieldSpec("uint16", None)
    return FieldSpec("uint32", None)


def _tokenize(text_or_bytes: str | bytes, tokenizer: Tokenizer | None) -> np.ndarray:
    if tokenizer is None:
        data = text_or_bytes.encode() if isinstance(text_or_bytes, str) else text_or_bytes
        return np.frombuffer(data, dtype=np.uint8)
    text = text_or_bytes.decode() if isinstance(text_or_bytes, bytes) else text_or_bytes
    return np.asarray(tokenizer(text), dtype=np.int64)


def list_text_files(
    source: Path, suffixes: Sequence[str] = TEXT_SUFFIXES, exclude_dirs: Sequence[str] = ()
) -> list[Path]:
    """A folder's text files in a stable order (sorted by relative path, part by part).

    Excluded folders are pruned during the walk, not filtered afterwards: the stdlib's
    site-packages can hold far more files than the stdlib itself."""
    if source.is_file():
        return [source]
    excluded = set(exclude_dirs)
    found: list[tuple[tuple[str, ...], Path]] = []
    for dirpath, dirnames, filenames in os.walk(source):
        dirnames[:] = [d for d in dirnames if d not in excluded]
        rel_dir = Path(dirpath).relative_to(source).parts
        for name in filenames:
            path = Path(dirpath, name)
            if path.suffix in suffixes and path.is_file():
                found.append(((*rel_dir, name), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def text_samples(
    files: Sequence[Path], tokenizer: Tokenizer | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """One sample per file: its tokens."""
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise DataError(f"cannot read {path}: {exc.strerror}") from None
        if data:
            yield {"tokens": _tokenize(data, tokenizer)}


def jsonl_samples(
    files: Sequence[Path], field: str, tokenizer: Tokenizer | None = None, dtype: str = "uint8"
) -> Iterator[dict[str, np.ndarray]]:
    """One sample per JSON line: the tokens of its ``field`` (a string), or the field itself
    when it is a list of token ids; ids that do not fit ``dtype`` are an error naming the line."""
    for path in files:
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{where}: not valid JSON ({exc})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{where}: no field {field!r} (has {keys}); choose it with --field"
                    )
                value = record[field]
                if isinstance(value, str):
                    tokens = _tokenize(value, tokenizer)
                elif isinstance(value, list) and all(
                    isinstance(v, int) and not isinstance(v, bool) for v in value
                ):
                    tokens = np.asarray(value, dtype=np.int64)
                else:
                    raise DataError(
                        f"{where}: field {field!r} is "
                        f"{type(value).__name__}, expected text or a list of ints"
                    )
                yield {"tokens": to_field_array(tokens, dtype, f"{where}, field {field!r}")}


def first_jsonl_value(files: Sequence[Path], field: str) -> Any:
    """The ``field`` of the first record, to choose the token dtype (None if there is none)."""
    for path in files:
        with path.open("rb") as fh:
            for raw in fh:
                if raw.strip():
                    try:
                        record = json.loads(raw)
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        return None  # jsonl_samples reports it with its line number
                    return record.get(field) if isinstance(record, dict) else None
    return None


def npy_arrays(source: Path) -> dict[str, np.ndarray]:
    """Named arrays with one sample per row: a single ``.npy`` file (field = its stem) or a
    folder of them (one field per file)."""
    files = [source] if source.is_file() else sorted(source.glob("*.npy"))
    if not files:
        raise DataError(f"no .npy files in {source}")
    arrays = {}
    for path in files:
        try:
            arrays[path.stem] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as exc:
            raise DataError(f"{path} is not a readable .npy array: {exc}") from None
    counts = {name: (a.shape[0] if a.ndim else 0) for name, a in arrays.items()}
    if len(set(counts.values())) != 1:
        raise DataError(f"the .npy arrays have different numbers of rows: {counts}")
    if 0 in counts.values():
        raise DataError(f"the .npy arrays in {source} hold no samples")
    return arrays


def write_npy(
    arrays: dict[str, np.ndarray],
    out: Path,
    *,
    shard_bytes: int,
    overwrite: bool,
    metadata: dict[str, Any],
    progress: Callable[[int], object],
    chunk_rows: int = 1 << 16,
) -> Path:
    """Rows of fixed-size arrays, copied a block at a time (no Python work per sample)."""
    fields = {n: FieldSpec(str(a.dtype), tuple(a.shape[1:])) for n, a in arrays.items()}
    n = next(iter(arrays.values())).shape[0]
    with ShardWriter(
        out, fields, shard_bytes=shard_bytes, overwrite=overwrite, metadata=metadata
    ) as writer:
        for begin in range(0, n, chunk_rows):
            writer.write_rows({name: a[begin : begin + chunk_rows] for name, a in arrays.items()})
            progress(min(chunk_rows, n - begin))
    return writer.out_dir


def parquet_samples(
    files: Sequence[Path],
    columns: Sequence[str] | None,
    text_field: str | None,
    tokenizer: Tokenizer | None = None,
) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(
            "Parquet sources need pyarrow: pip install -e '.[parquet]' in dtrain's clone"
        ) from None
    for path in files:
        try:
            table_file = pq.ParquetFile(path)
        except Exception as exc:
            raise DataError(f"{path} is not a readable Parquet file: {exc}") from None
        names = list(columns) if columns else table_file.schema_arrow.names
        missing = [c for c in names if c not in table_file.schema_arrow.names]
        if missing:
            raise DataError(f"{path}: no column(s) {missing} (has {table_file.schema_arrow.names})")
        row_base = 0
        for batch in table_file.iter_batches(columns=names):
            data = batch.to_pydict()
            for row in range(batch.num_rows):
                sample: dict[str, Any] = {}
                for name in names:
                    value = data[name][row]
                    if value is None:
                        raise DataError(
                            f"{path}: row {row_base + row}: column {name!r} is null; "
                            "drop or fill nulls before preparing"
                        )
                    if name == text_field and isinstance(value, (str, bytes)):
                        sample["tokens"] = _tokenize(value, tokenizer)
                    elif isinstance(value, (str, bytes)):
                        raise DataError(
                            f"{path}: column {name!r} holds text; name it with "
                            "--field to tokenize it"
                        )
                    else:
                        sample[name] = value
                yield sample
            row_base += batch.num_rows


def _source_files(source: Path, suffixes: Sequence[str], kind: str) -> list[Path]:
    files = list_text_files(source, suffixes)
    if not files:
        raise DataError(f"no {kind} files ({', '.join(suffixes)}) in {source}")
    return files


def _parquet_has_text(path: Path, text_field: str, columns: Sequence[str] | None) -> bool:
    """Whether the text column that becomes tokens is among the columns read."""
    if columns and text_field not in columns:
        return False
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pq.read_schema(path)
    except ImportError:
        return False  # parquet_samples says how to install pyarrow
    except Exception as exc:
        raise DataError(f"{path} is not a readable Parquet file: {exc}") from None
    if text_field not in schema.names:
        return False
    kind = schema.field(text_field).type
    return bool(
        pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
    )


def detect_format(source: Path) -> str:
    candidates = (
        [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    )
    suffixes = {p.suffix for p in candidates}
    return next((fmt for fmt in ("jsonl", "npy", "parquet") if f".{fmt}" in suffixes), "text")


def prepare(
    source: str | Path,
    out_dir: str | Path,
    *,
    fmt: str = "auto",
    field: str = "text",
    columns: Sequence[str] | None = None,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    overwrite: bool = False,
    show_progress: bool = True,
    metadata: dict[str, Any] | None = None,
) -> Location:
    """Write ``source`` as a dataset in ``out_dir`` (a folder, or a prefix in an object
    store: :mod:`dtrain.data.upload`); see ``dtrain prepare --help``. ``metadata``: more to
    record in the manifest (the tokenizer's file and vocabulary)."""
    src = Path(source)
    if not src.exists():
        raise DataError(f"source {src} does not exist")
    write = partial(
        _prepare,
        src,
        fmt=fmt,
        field=field,
        columns=columns,
        tokenizer=tokenizer,
        vocab_size=vocab_size,
        shard_bytes=shard_bytes,
        show_progress=show_progress,
        metadata=metadata,
    )
    if not scheme_of(str(out_dir)):
        return write(Path(out_dir), overwrite=overwrite)
    store = ObjectPath(str(out_dir))
    check_store_output(store, overwrite)  # before the source is read
    with tempfile.TemporaryDirectory(prefix="dtrain-prepare-") as scratch:  # then uploaded
        local = write(Path(scratch) / "data")
        upload_dataset(local, store)
    return store


def _prepare(
    src: Path,
    out: Path,
    *,
    fmt: str,
    field: str,
    columns: Sequence[str] | None,
    tokenizer: Tokenizer | None,
    vocab_size: int | None,
    shard_bytes: int,
    show_progress: bool,
    metadata: dict[str, Any] | None,
    overwrite: bool = False,
) -> Path:
    if out.exists() and not overwrite:
        raise DataError(f"output folder {out} already exists; pass --overwrite to replace it")
    check_replaceable(out)  # before the source is read: a refusal costs nothing
    require_output_folder(out.parent, f"output folder {out}")
    if fmt == "auto":
        fmt = detect_format(src)
    token_field = _token_field(tokenizer is not None, vocab_size)
    total: int | None = None
    if fmt == "text":
        files = _source_files(src, TEXT_SUFFIXES, "text")
        total = len(files)
        write = partial(
            write_shards, text_samples(files, tokenizer), fields={"tokens": token_field}
        )
    elif fmt == "jsonl":
        files = _source_files(src, (".jsonl", ".json"), "JSONL")
        if tokenizer is None and isinstance(first_jsonl_value(files, field), list):
            # Pre-tokenized ids: bytes would not hold them.
            token_field = _token_field(True, vocab_size)
        samples = jsonl_samples(files, field, tokenizer, token_field.dtype)
        write = partial(write_shards, samples, fields={"tokens": token_field})
    elif fmt == "npy":
        arrays = npy_arrays(src)
        total = next(iter(arrays.values())).shape[0]
        write = partial(write_npy, arrays)
    elif fmt == "parquet":
        files = _source_files(src, (".parquet",), "Parquet")
        # Text columns become variable-length tokens; other columns' types are inferred.
        fields = {"tokens": token_field} if _parquet_has_text(files[0], field, columns) else None
        write = partial(
            write_shards, parquet_samples(files, columns, field, tokenizer), fields=fields
        )
    else:
        raise DataError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    bar = tqdm(
        total=total,
        unit=" samples",
        desc=f"prepare {src.name}",
        disable=not show_progress,
        mininterval=0.5,
    )
    metadata = {"source": str(src), "format": fmt, **(metadata or {})}
    try:
        return write(
            out,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            metadata=metadata,
            progress=bar.update,
        )
    finally:
        bar.close()
