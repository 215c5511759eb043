"""Turn raw data into a sharded dataset: text, JSONL, ``.npy`` arrays and Parquet.

Each source is an iterator of samples (dicts of arrays) fed to :func:`write_shards`, which makes
the write atomic. Text becomes byte-level tokens unless a tokenizer is given (Python API).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from dtrain.data.shards import DEFAULT_SHARD_BYTES, FieldSpec, write_shards
from dtrain.errors import DataError

Tokenizer = Callable[[str], Sequence[int]]
TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".text")
FORMATS = ("auto", "text", "jsonl", "npy", "parquet")


def byte_tokens(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _token_field(tokenizer: Tokenizer | None, vocab_size: int | None) -> FieldSpec:
    if tokenizer is None:
        return FieldSpec("uint8", None)
    if vocab_size is not None and vocab_size <= 2**16:
        return FieldSpec("uint16", None)
    return FieldSpec("uint32", None)


def _tokenize(text_or_bytes: str | bytes, tokenizer: Tokenizer | None) -> np.ndarray:
    if tokenizer is None:
        data = text_or_bytes.encode() if isinstance(text_or_bytes, str) else text_or_bytes
        return byte_tokens(data)
    text = text_or_bytes.decode() if isinstance(text_or_bytes, bytes) else text_or_bytes
    return np.asarray(tokenizer(text), dtype=np.int64)


def list_text_files(
    source: Path, suffixes: Sequence[str] = TEXT_SUFFIXES, exclude_dirs: Sequence[str] = ()
) -> list[Path]:
    """A folder's text files in a stable order (sorted relative paths)."""
    if source.is_file():
        return [source]
    files = []
    for path in sorted(source.rglob("*")):
        rel = path.relative_to(source).parts
        if any(part in exclude_dirs for part in rel[:-1]):
            continue
        if path.is_file() and path.suffix in suffixes:
            files.append(path)
    return files


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
    files: Sequence[Path], field: str, tokenizer: Tokenizer | None = None
) -> Iterator[dict[str, np.ndarray]]:
    """One sample per JSON line: the tokens of its ``field`` (a string), or the field itself
    when it is a list of token ids."""
    for path in files:
        with path.open("rb") as fh:
            for lineno, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({exc})") from None
                if not isinstance(record, dict) or field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise DataError(
                        f"{path}:{lineno}: no field {field!r} (has {keys}); choose it with --field"
                    )
                value = record[field]
                if isinstance(value, str):
                    yield {"tokens": _tokenize(value, tokenizer)}
                elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                    yield {"tokens": np.asarray(value, dtype=np.int64)}
                else:
                    raise DataError(
                        f"{path}:{lineno}: field {field!r} is "
                        f"{type(value).__name__}, expected text or a list of ints"
                    )


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


def npy_samples(arrays: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    n = next(iter(arrays.values())).shape[0]
    for i in range(n):
        yield {name: np.asarray(a[i]) for name, a in arrays.items()}


def parquet_samples(
    files: Sequence[Path],
    columns: Sequence[str] | None,
    text_field: str | None,
    tokenizer: Tokenizer | None = None,
) -> Iterator[dict[str, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError("Parquet sources need pyarrow: pip install 'dtrain[parquet]'") from None
    for path in files:
        try:
            table_file = pq.ParquetFile(path)
        except Exception as exc:
            raise DataError(f"{path} is not a readable Parquet file: {exc}") from None
        names = list(columns) if columns else table_file.schema_arrow.names
        missing = [c for c in names if c not in table_file.schema_arrow.names]
        if missing:
            raise DataError(f"{path}: no column(s) {missing} (has {table_file.schema_arrow.names})")
        for batch in table_file.iter_batches(columns=names):
            data = batch.to_pydict()
            for row in range(batch.num_rows):
                sample: dict[str, Any] = {}
                for name in names:
                    value = data[name][row]
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


def detect_format(source: Path) -> str:
    candidates = (
        [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    )
    suffixes = {p.suffix for p in candidates}
    for fmt, suffix in (("jsonl", ".jsonl"), ("npy", ".npy"), ("parquet", ".parquet")):
        if suffix in suffixes:
            return fmt
    return "text"


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
) -> Path:
    """Write ``source`` as a dataset in ``out_dir``; see ``dtrain prepare --help``."""
    src = Path(source)
    if not src.exists():
        raise DataError(f"source {src} does not exist")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise DataError(f"output folder {out} already exists; pass --overwrite to replace it")
    if fmt == "auto":
        fmt = detect_format(src)
    fields: dict[str, FieldSpec] | None = None
    samples: Iterator[dict[str, Any]]
    total: int | None = None
    if fmt == "text":
        files = list_text_files(src)
        if not files:
            raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES)}) in {src}")
        samples, total = text_samples(files, tokenizer), len(files)
        fields = {"tokens": _token_field(tokenizer, vocab_size)}
    elif fmt == "jsonl":
        files = list_text_files(src, (".jsonl", ".json"))
        samples = jsonl_samples(files, field, tokenizer)
        fields = {"tokens": _token_field(tokenizer, vocab_size)} if tokenizer is None else None
    elif fmt == "npy":
        arrays = npy_arrays(src)
        total = next(iter(arrays.values())).shape[0]
        fields = {n: FieldSpec(str(a.dtype), tuple(a.shape[1:])) for n, a in arrays.items()}
        samples = npy_samples(arrays)
    elif fmt == "parquet":
        files = list_text_files(src, (".parquet",))
        samples = parquet_samples(files, columns, field, tokenizer)
    else:
        raise DataError(f"unknown format {fmt!r}: expected one of {', '.join(FORMATS)}")
    bar = tqdm(
        total=total,
        unit=" samples",
        desc=f"prepare {src.name}",
        disable=not show_progress,
        mininterval=0.5,
    )
    try:
        return write_shards(
            samples,
            out,
            fields=fields,
            shard_bytes=shard_bytes,
            overwrite=overwrite,
            metadata={"source": str(src), "format": fmt},
            progress=lambda n: bar.update(n),
        )
    finally:
        bar.close()
