"""``dtrain prepare`` from every source (text, a folder of text, JSONL, .npy, Parquet), the
tokenizer hook of the Python API, and clear errors for bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dtrain.cli import main
from dtrain.data.prepare import prepare
from dtrain.data.shards import FieldSpec, ShardedDataset, read_manifest, verify_dataset
from dtrain.errors import USER_ERROR_EXIT_CODE, DataError


def tokens(dataset: ShardedDataset, field: str = "tokens") -> list[list[int]]:
    return [dataset[i][field].tolist() for i in range(len(dataset))]


def no_leftovers(parent: Path) -> bool:
    return not [p for p in parent.iterdir() if ".tmp-" in p.name]


def word_tokenizer(text: str) -> list[int]:
    """A toy tokenizer: one id per word, ids above 255 so bytes would not hold them."""
    return [1000 + len(word) for word in text.split()]


# -- text ----------------------------------------------------------------------------------


def test_a_text_file_becomes_one_sample_of_byte_tokens(tmp_path: Path) -> None:
    src = tmp_path / "book.txt"
    src.write_text("héllo\nworld\n")
    dataset = ShardedDataset(prepare(src, tmp_path / "out", show_progress=False))
    assert dataset.fields == {"tokens": FieldSpec("uint8", None)}
    assert tokens(dataset) == [list("héllo\nworld\n".encode())]
    assert read_manifest(tmp_path / "out")["metadata"]["format"] == "text"


def test_a_folder_of_text_files(tmp_path: Path) -> None:
    src = tmp_path / "corpus"
    (src / "sub").mkdir(parents=True)
    (src / "b.txt").write_text("bee")
    (src / "a.md").write_text("# a")
    (src / "sub" / "c.py").write_text("print(1)")
    (src / "empty.txt").write_text("")  # no sample for an empty file
    (src / "image.png").write_bytes(b"\x89PNG")  # not text: skipped
    dataset = ShardedDataset(prepare(src, tmp_path / "out", show_progress=False))
    # Sorted relative paths: a.md, b.txt, sub/c.py.
    assert [bytes(t).decode() for t in tokens(dataset)] == ["# a", "bee", "print(1)"]


def test_the_tokenizer_hook(tmp_path: Path) -> None:
    src = tmp_path / "t.txt"
    src.write_text("a bb ccc")
    out = prepare(src, tmp_path / "out", tokenizer=word_tokenizer, show_progress=False)
    dataset = ShardedDataset(out)
    assert dataset.fields["tokens"] == FieldSpec("uint32", None)
    assert tokens(dataset) == [[1001, 1002, 1003]]
    small = prepare(
        src, tmp_path / "small", tokenizer=word_tokenizer, vocab_size=5000, show_progress=False
    )
    assert ShardedDataset(small).fields["tokens"] == FieldSpec("uint16", None)
    with pytest.raises(DataError, match="do not fit uint16"):
        prepare(
            src,
            tmp_path / "bad",
            tokenizer=lambda s: [70_000],
            vocab_size=5000,
            show_progress=False,
        )
    assert no_leftovers(tmp_path)


def test_an_empty_text_source(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no text files"):
        prepare(tmp_path / "empty", tmp_path / "out", show_progress=False)
    (tmp_path / "empty" / "a.txt").write_text("")
    with pytest.raises(DataError, match="the source is empty"):
        prepare(tmp_path / "empty", tmp_path / "out", show_progress=False)
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        prepare(tmp_path / "nowhere", tmp_path / "out", show_progress=False)


# -- JSONL ---------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_jsonl_with_a_chosen_field(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"body": "one", "id": 1}, {"body": "two words"}])
    dataset = ShardedDataset(prepare(src, tmp_path / "out", field="body", show_progress=False))
    assert [bytes(t).decode() for t in tokens(dataset)] == ["one", "two words"]
    with_tok = prepare(
        src, tmp_path / "tok", field="body", tokenizer=word_tokenizer, show_progress=False
    )
    assert tokens(ShardedDataset(with_tok)) == [[1003], [1003, 1005]]


def test_jsonl_of_token_ids(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "ids.jsonl", [{"text": [5, 300, 70_000]}, {"text": [1]}])
    dataset = ShardedDataset(prepare(src, tmp_path / "out", show_progress=False))
    assert dataset.fields["tokens"] == FieldSpec("uint32", None)  # not uint8: ids > 255
    assert tokens(dataset) == [[5, 300, 70_000], [1]]
    bad = write_jsonl(tmp_path / "neg.jsonl", [{"text": [1]}, {"text": [-4]}])
    with pytest.raises(DataError, match=r"neg\.jsonl:2, field 'text': values -4\.\.-4"):
        prepare(bad, tmp_path / "neg", show_progress=False)


def test_a_jsonl_line_that_is_not_json(tmp_path: Path) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text('{"text": "ok"}\n\n{"text": "ok"}\n{"text": oops}\n{"text": "never"}\n')
    with pytest.raises(DataError) as info:
        prepare(src, tmp_path / "out", show_progress=False)
    assert str(info.value).startswith(f"{src}:4: not valid JSON")
    assert not (tmp_path / "out").exists() and no_leftovers(tmp_path)


def test_a_jsonl_line_without_the_field(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"text": "a"}, {"body": "b"}, {"text": 3}])
    with pytest.raises(DataError, match=r"d\.jsonl:2: no field 'text' \(has \['body'\]\)"):
        prepare(src, tmp_path / "out", show_progress=False)
    src = write_jsonl(tmp_path / "e.jsonl", [{"text": "a"}, {"text": 3}])
    with pytest.raises(DataError, match=r"e\.jsonl:2: field 'text' is int, expected text"):
        prepare(src, tmp_path / "out", show_progress=False)
    (tmp_path / "none").mkdir()
    with pytest.raises(DataError, match="no JSONL files"):
        prepare(tmp_path / "none", tmp_path / "out", fmt="jsonl", show_progress=False)


# -- .npy ----------------------------------------------------------------------------------


def test_a_npy_file_of_fixed_size_samples(tmp_path: Path) -> None:
    features = np.random.default_rng(0).standard_normal((50, 3, 2)).astype(np.float32)
    np.save(tmp_path / "features.npy", features)
    out = prepare(tmp_path / "features.npy", tmp_path / "out", show_progress=False)
    dataset = ShardedDataset(out)
    assert dataset.fields == {"features": FieldSpec("float32", (3, 2))}
    assert np.array_equal(dataset.gather("features", np.arange(50)), features)


def test_a_folder_of_npy_is_one_field_per_file(tmp_path: Path) -> None:
    src = tmp_path / "arrays"
    src.mkdir()
    rng = np.random.default_rng(1)
    features = rng.standard_normal((3000, 8)).astype(np.float32)
    labels = rng.integers(0, 10, 3000).astype(np.int64)
    np.save(src / "features.npy", features)
    np.save(src / "labels.npy", labels)
    out = prepare(src, tmp_path / "out", shard_bytes=20_000, show_progress=False)
    dataset = ShardedDataset(out)
    assert dataset.fields == {
        "features": FieldSpec("float32", (8,)),
        "labels": FieldSpec("int64", ()),
    }
    assert len(dataset.shard_sizes) > 1
    ids = rng.permutation(3000)[:100]
    assert np.array_equal(dataset.gather("features", ids), features[ids])
    assert np.array_equal(dataset.gather("labels", ids), labels[ids])
    assert verify_dataset(out) == []


def test_npy_arrays_that_disagree(tmp_path: Path) -> None:
    src = tmp_path / "arrays"
    src.mkdir()
    np.save(src / "a.npy", np.zeros((5, 2)))
    np.save(src / "b.npy", np.zeros(4))
    with pytest.raises(DataError, match="different numbers of rows"):
        prepare(src, tmp_path / "out", show_progress=False)
    (src / "a.npy").write_bytes(b"not an array")
    with pytest.raises(DataError, match=r"a\.npy is not a readable \.npy array"):
        prepare(src, tmp_path / "out", show_progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    np.save(empty / "x.npy", np.zeros((0, 3)))
    with pytest.raises(DataError, match="hold no samples"):
        prepare(empty, tmp_path / "out", show_progress=False)


# -- Parquet -------------------------------------------------------------------------------


def test_parquet_with_text_and_numbers(tmp_path: Path) -> None:
    table = pa.table(
        {
            "text": ["first doc", "second", "3rd"],
            "label": [1, 0, 1],
            "ids": [[1, 2, 3], [4], []],
        }
    )
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=2)
    dataset = ShardedDataset(prepare(tmp_path / "d.parquet", tmp_path / "out", show_progress=False))
    assert dataset.fields == {
        "tokens": FieldSpec("uint8", None),
        "label": FieldSpec("int64", ()),
        "ids": FieldSpec("int64", None),
    }
    assert [bytes(t).decode() for t in tokens(dataset)] == ["first doc", "second", "3rd"]
    assert [int(dataset[i]["label"]) for i in range(3)] == [1, 0, 1]
    assert tokens(dataset, "ids") == [[1, 2, 3], [4], []]
    only = prepare(
        tmp_path / "d.parquet", tmp_path / "only", columns=["label"], show_progress=False
    )
    assert ShardedDataset(only).fields == {"label": FieldSpec("int64", ())}
    tok = prepare(
        tmp_path / "d.parquet",
        tmp_path / "tok",
        columns=["text"],
        tokenizer=word_tokenizer,
        show_progress=False,
    )
    assert tokens(ShardedDataset(tok)) == [[1005, 1003], [1006], [1003]]


def test_parquet_errors(tmp_path: Path) -> None:
    pq.write_table(pa.table({"label": [1, None]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match=r"n\.parquet: row 1: column 'label' is null"):
        prepare(tmp_path / "n.parquet", tmp_path / "out", show_progress=False)
    pq.write_table(pa.table({"title": ["a"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match="column 'title' holds text; name it with --field"):
        prepare(tmp_path / "t.parquet", tmp_path / "out", show_progress=False)
    with pytest.raises(DataError, match=r"no column\(s\) \['nope'\]"):
        prepare(tmp_path / "t.parquet", tmp_path / "out", columns=["nope"], show_progress=False)
    assert no_leftovers(tmp_path)


# -- the command ---------------------------------------------------------------------------


def test_dtrain_prepare_and_an_existing_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write_jsonl(tmp_path / "d.jsonl", [{"body": "x" * 100}] * 20)
    out = tmp_path / "out"
    assert main(["prepare", str(src), str(out), "--field", "body"]) == 0
    assert "wrote 20 samples in 1 shard(s)" in capsys.readouterr().out
    before = read_manifest(out)["fingerprint"]
    assert main(["prepare", str(src), str(out), "--field", "body"]) == USER_ERROR_EXIT_CODE
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert read_manifest(out)["fingerprint"] == before  # untouched
    write_jsonl(src, [{"body": "y"}] * 3)
    args = ["prepare", str(src), str(out), "--field", "body", "--overwrite", "--shard-mb", "1"]
    assert main(args) == 0
    assert len(ShardedDataset(out)) == 3
    assert main(["prepare", str(src), str(tmp_path / "x"), "--field", "nope"]) == 2
    assert "no field 'nope'" in capsys.readouterr().err


def test_overwrite_replaces_a_dataset_and_nothing_else(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--overwrite deletes what it replaces: only a folder dtrain's writer made (its manifest
    and the files listed there) is; a folder of the user's, a plain file, a dataset with a
    file of the user's added, are one line, exit 2, and left exactly as they were."""
    src = write_jsonl(tmp_path / "d.jsonl", [{"body": "abc"}] * 4)
    dataset = tmp_path / "dataset"
    assert main(["prepare", str(src), str(dataset), "--field", "body"]) == 0
    write_jsonl(src, [{"body": "xy"}] * 7)
    assert main(["prepare", str(src), str(dataset), "--field", "body", "--overwrite"]) == 0
    assert len(ShardedDataset(dataset)) == 7
    capsys.readouterr()

    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "holiday.jpg").write_bytes(b"\xff\xd8 precious")
    plain = tmp_path / "notes.txt"
    plain.write_text("keep me")
    added = tmp_path / "dataset-plus"
    assert main(["prepare", str(src), str(added), "--field", "body"]) == 0
    (added / "README.md").write_text("mine")
    capsys.readouterr()
    for out, why in (
        (folder, "it holds no readable manifest.json"),
        (plain, "a file, not a folder"),
        (added, "it holds 'README.md', which its manifest.json does not list"),
    ):
        before = {p: p.read_bytes() for p in [out, *out.rglob("*")] if p.is_file()}
        args = ["prepare", str(src), str(out), "--field", "body", "--overwrite"]
        assert main(args) == USER_ERROR_EXIT_CODE
        err = capsys.readouterr().err
        assert f"{out} is not one ({why}" in err and err.count("\n") == 1, err
        after = {p: p.read_bytes() for p in [out, *out.rglob("*")] if p.is_file()}
        assert after == before, out
    assert no_leftovers(tmp_path)


def test_a_full_disk_is_one_line_and_leaves_no_temporary_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """6 MB of text into a 2 MB disk, shards of 0.5 MB: the disk fills after some shards were
    written. It was a 30-line OSError traceback leaving the hidden temporary folder behind."""
    from tests.test_run_folder import small_disk

    src = tmp_path / "src"
    src.mkdir()
    for i in range(30):
        (src / f"f{i:02d}.txt").write_text(f"line {i}\n" * 25_000)  # 200 kB each
    with small_disk(tmp_path / "disk", "2m") as disk:
        out = disk / "data"
        assert main(["prepare", str(src), str(out), "--shard-mb", "0.5"]) == USER_ERROR_EXIT_CODE
        err = capsys.readouterr().err
        last = err.strip().splitlines()[-1]  # after the progress bar's line
        assert last.startswith(
            f"dtrain: error: no space left on the disk of {disk} for the dataset data: it "
            "needs more than "
        ), err
        assert last.endswith(
            "is free with its partial copy removed; free some space there or choose another "
            "output folder"
        ), err
        taken = float(last.split("more than ")[1].split(" MB")[0])
        free = float(last.split(") and ")[1].split(" MB")[0])
        assert 2.1 <= taken <= 3.0, last  # more than the 2 MiB disk holds, far less than 6 MB
        assert free == 2.1, last  # the whole disk again
        assert "Traceback" not in err
        assert list(disk.iterdir()) == []  # no dataset, no temporary folder
