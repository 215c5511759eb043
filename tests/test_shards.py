"""The shard format: round trips, O(1) random access, atomic writes, and every kind of damage
caught with the file named -- truncation at open, corruption by ``verify`` and the CLI."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dtrain.cli import main
from dtrain.data import shards
from dtrain.data.shards import (
    MANIFEST,
    FieldSpec,
    ShardedDataset,
    ShardWriter,
    read_manifest,
    verify_dataset,
    write_shards,
)
from dtrain.errors import USER_ERROR_EXIT_CODE, DataError
from tests.data_helpers import feature_rows, write_features


def mixed_samples(n: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    return [
        {
            "image": rng.integers(0, 255, (4, 5)).astype(np.uint8),
            "label": np.int64(i % 7),
            "score": np.float32(i / 3),
            "tokens": rng.integers(0, 50_000, int(rng.integers(0, 30))).astype(np.int64),
            "text": f"sample {i}: " + "ü" * int(rng.integers(0, 5)),
        }
        for i in range(n)
    ]


MIXED_FIELDS = {"tokens": FieldSpec("uint16", None)}


def files_of(path: Path, suffix: str = ".npy") -> list[Path]:
    return sorted(p for p in path.iterdir() if p.name.endswith(suffix))


def leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


# -- round trip ----------------------------------------------------------------------------


def test_round_trip_of_fixed_and_variable_fields(tmp_path: Path) -> None:
    samples = mixed_samples(200)
    out = write_shards(samples, tmp_path / "ds", fields=MIXED_FIELDS, shard_bytes=2000)
    dataset = ShardedDataset(out)
    assert len(dataset) == 200
    assert len(dataset.shard_sizes) > 5 and sum(dataset.shard_sizes) == 200
    assert dataset.fields == {
        "tokens": FieldSpec("uint16", None),
        "image": FieldSpec("uint8", (4, 5)),
        "label": FieldSpec("int64", ()),
        "score": FieldSpec("float32", ()),
        "text": FieldSpec("uint8", None),
    }
    for i in [*range(200)][::-1]:  # any order
        got = dataset[i]
        assert np.array_equal(got["image"], samples[i]["image"])
        assert got["label"] == samples[i]["label"] and got["score"] == samples[i]["score"]
        assert got["tokens"].tolist() == samples[i]["tokens"].tolist()
        assert bytes(got["text"]).decode() == samples[i]["text"]
    lengths = dataset.sample_lengths("tokens")
    assert lengths is not None
    assert lengths.tolist() == [len(s["tokens"]) for s in samples]
    assert dataset.sample_lengths() is not None  # the first variable field: tokens
    assert np.array_equal(
        dataset.gather("image", [5, 199, 0]), np.stack([samples[i]["image"] for i in (5, 199, 0)])
    )
    with pytest.raises(IndexError):
        dataset[200]
    with pytest.raises(IndexError):
        dataset.gather("label", [3, 200])


def test_every_file_is_a_plain_npy_and_the_manifest_lists_it(tmp_path: Path) -> None:
    out = write_shards(mixed_samples(30), tmp_path / "ds", fields=MIXED_FIELDS, shard_bytes=500)
    manifest = read_manifest(out)
    listed = {f for s in manifest["shards"] for f in s["files"]}
    assert listed == {p.name for p in files_of(out)}
    first = manifest["shards"][0]
    n = first["num_samples"]
    offsets = np.load(out / f"{first['name']}.tokens.idx.npy")
    assert offsets.shape == (n + 1,) and offsets[0] == 0
    assert np.load(out / f"{first['name']}.tokens.npy").shape == (offsets[-1],)
    assert np.load(out / f"{first['name']}.image.npy").shape == (n, 4, 5)
    assert manifest["num_samples"] == 30 and len(manifest["fingerprint"]) == 64


def test_write_rows_equals_one_sample_at_a_time(tmp_path: Path) -> None:
    rows = feature_rows(1000)
    with ShardWriter(tmp_path / "rows", shard_bytes=4096) as writer:
        writer.write_rows({k: v[:300] for k, v in rows.items()})
        writer.write_rows({k: v[300:] for k, v in rows.items()})
    one = write_features(tmp_path / "one", 1000, shard_bytes=4096)
    a, b = ShardedDataset(tmp_path / "rows"), ShardedDataset(one)
    assert a.shard_sizes == b.shard_sizes
    assert a.fingerprint == b.fingerprint  # byte for byte the same files


def test_values_that_do_not_fit_the_field_are_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"sample 1, field 'tokens': values 3\.\.300 do not fit"):
        write_shards(
            [{"tokens": [1, 2]}, {"tokens": [3, 300]}],
            tmp_path / "a",
            fields={"tokens": FieldSpec("uint8", None)},
        )
    with pytest.raises(DataError, match="float64 values cannot be stored as int64"):
        write_shards([{"x": np.int64(1)}, {"x": 2.5}], tmp_path / "b")
    with pytest.raises(DataError, match=r"sample 1, field 'x': shape \(3,\), expected \(2,\)"):
        write_shards([{"x": np.zeros(2)}, {"x": np.zeros(3)}], tmp_path / "c")
    with pytest.raises(DataError, match=r"sample 1 has fields \['y'\], expected \['x'\]"):
        write_shards([{"x": np.zeros(2)}, {"y": np.zeros(2)}], tmp_path / "d")
    assert leftovers(tmp_path) == []


def test_empty_variable_length_samples(tmp_path: Path) -> None:
    samples = [{"tokens": []}, {"tokens": [1, 2]}, {"tokens": []}]
    dataset = ShardedDataset(write_shards(samples, tmp_path / "ds"))
    assert [dataset[i]["tokens"].tolist() for i in range(3)] == [[], [1, 2], []]
    only_empty = ShardedDataset(write_shards([{"t": b""}], tmp_path / "empty"))
    assert only_empty[0]["t"].tolist() == []


# -- O(1) random access --------------------------------------------------------------------


def test_random_access_touches_only_the_files_of_its_shard(tmp_path: Path) -> None:
    out = write_features(tmp_path / "ds", 500, shard_bytes=2000)
    dataset = ShardedDataset(out)
    assert len(dataset.shard_sizes) > 10
    assert dataset._arrays == {}  # opening maps nothing: it reads the manifest and sizes
    shard, local = dataset.locate(317)
    # Scramble every other shard (same sizes, garbage bytes): the sample is still right,
    # because reading it maps its own shard's files only, and only the pages it touches.
    for path in files_of(out):
        if not path.name.startswith(f"shard-{shard:05d}."):
            path.write_bytes(b"\xff" * path.stat().st_size)
    assert dataset[317]["id"] == 317
    assert dataset.gather("x", [317, 317 - local]).shape == (2, 3, 4)
    assert {name.split(".")[0] for name in dataset._arrays} == {f"shard-{shard:05d}"}


def test_pickling_does_not_copy_the_mapped_data(tmp_path: Path) -> None:
    # DataLoader workers started by spawn/forkserver receive the dataset pickled.
    out = write_features(tmp_path / "ds", 2000, shard_bytes=40_000)
    dataset = ShardedDataset(out)
    dataset.gather("x", np.arange(2000))  # maps every file
    data_bytes = sum(p.stat().st_size for p in files_of(out))
    blob = pickle.dumps(dataset)
    assert len(blob) < data_bytes / 10
    copy = pickle.loads(blob)
    assert np.array_equal(copy.gather("x", [5, 1999]), dataset.gather("x", [5, 1999]))


# -- atomic writes -------------------------------------------------------------------------


def failing_source(n: int) -> Iterator[dict[str, Any]]:
    rows = feature_rows(n)
    for i in range(n):
        if i == n // 2:
            raise RuntimeError("source broke half-way")
        yield {k: v[i] for k, v in rows.items()}


def test_an_interrupted_write_leaves_nothing_that_looks_like_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="half-way"):
        write_shards(failing_source(400), tmp_path / "ds", shard_bytes=1000)
    assert not (tmp_path / "ds").exists()
    assert list(tmp_path.iterdir()) == []  # and no temporary folder either


def test_a_failed_overwrite_keeps_the_old_dataset(tmp_path: Path) -> None:
    out = write_features(tmp_path / "ds", 50)
    before = ShardedDataset(out).fingerprint
    with pytest.raises(RuntimeError):
        write_shards(failing_source(400), out, overwrite=True)
    assert ShardedDataset(out).fingerprint == before
    assert verify_dataset(out) == []
    write_shards([{"x": np.zeros(2)}], out, overwrite=True)
    assert len(ShardedDataset(out)) == 1
    assert leftovers(tmp_path) == []


def test_an_empty_source_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"no samples were written .* the source is empty"):
        write_shards(iter([]), tmp_path / "ds")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ds").mkdir()
    with pytest.raises(DataError, match="already exists; pass --overwrite"):
        write_shards([{"x": np.zeros(2)}], tmp_path / "ds")


# -- damage --------------------------------------------------------------------------------


@pytest.fixture
def dataset_dir(tmp_path: Path) -> Path:
    return write_features(tmp_path / "ds", 200, shard_bytes=2000)


def test_a_truncated_file_is_caught_at_open_without_reading_it(
    dataset_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = files_of(dataset_dir)[3]
    size = victim.stat().st_size
    with victim.open("r+b") as fh:
        fh.truncate(size - 100)

    def no_reading(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("opening a dataset read a shard")

    monkeypatch.setattr(shards, "sha256_file", no_reading)
    monkeypatch.setattr(shards.np, "load", no_reading)
    with pytest.raises(DataError) as info:
        ShardedDataset(dataset_dir)
    message = str(info.value)
    assert str(victim) in message
    assert f"has {size - 100} bytes, the manifest says {size}" in message
    assert "\n" not in message


def test_a_missing_file_is_caught_at_open(dataset_dir: Path) -> None:
    victim = files_of(dataset_dir)[5]
    victim.unlink()
    with pytest.raises(DataError, match=f"shard file {victim} is missing"):
        ShardedDataset(dataset_dir)
    assert [(b.path, b.problem) for b in verify_dataset(dataset_dir)] == [(victim, "missing")]


def test_a_file_whose_header_disagrees_is_caught_when_mapped(dataset_dir: Path) -> None:
    # Same byte size, other shape: only the .npy header can tell.
    victim = dataset_dir / "shard-00000.x.npy"
    arr = np.load(victim)
    np.save(victim, arr.reshape(arr.shape[0], 4, 3))
    dataset = ShardedDataset(dataset_dir)
    with pytest.raises(DataError, match=r"holds float32 \(\d+, 4, 3\), the manifest says"):
        dataset[0]


def corrupt(path: Path, at: int = -5) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_finds_corrupted_files(dataset_dir: Path) -> None:
    assert verify_dataset(dataset_dir) == []
    victims = [files_of(dataset_dir)[1], files_of(dataset_dir)[7]]
    for victim in victims:
        corrupt(victim)
    bad = verify_dataset(dataset_dir)
    assert [b.path for b in bad] == victims
    assert all("sha256" in b.problem and "expected" in b.problem for b in bad)
    ShardedDataset(dataset_dir)  # same sizes: opening cannot tell, verify can


def test_verify_finds_an_edited_manifest(dataset_dir: Path) -> None:
    manifest = json.loads((dataset_dir / MANIFEST).read_text())
    victim = files_of(dataset_dir)[2]
    corrupt(victim)
    manifest["shards"][0]["files"][victim.name]["sha256"] = shards.sha256_file(victim)
    (dataset_dir / MANIFEST).write_text(json.dumps(manifest))
    problems = [str(b) for b in verify_dataset(dataset_dir)]
    assert any("fingerprint does not match" in p for p in problems)


def test_dtrain_verify_exit_codes(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(dataset_dir)]) == 0
    assert "OK (200 samples" in capsys.readouterr().out
    victim = files_of(dataset_dir)[4]
    corrupt(victim)
    truncated = files_of(dataset_dir)[9]
    with truncated.open("r+b") as fh:
        fh.truncate(10)
    assert main(["verify", str(dataset_dir)]) == 1
    err = capsys.readouterr().err
    assert "2 bad file(s)" in err
    assert f"{victim}: sha256" in err
    assert f"{truncated}: size 10 bytes, expected" in err


# -- bad manifests -------------------------------------------------------------------------


def test_a_missing_manifest(dataset_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (dataset_dir / MANIFEST).unlink()
    with pytest.raises(DataError, match=r"manifest\.json is missing: .* is not a dtrain dataset"):
        ShardedDataset(dataset_dir)
    assert main(["verify", str(dataset_dir)]) == USER_ERROR_EXIT_CODE
    assert "manifest.json is missing" in capsys.readouterr().err
    shutil.rmtree(dataset_dir)
    with pytest.raises(DataError, match="does not exist; create it with `dtrain prepare"):
        ShardedDataset(dataset_dir)


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda m: "{not json", "malformed: Expecting property name"),
        (lambda m: json.dumps([1, 2]), "not a JSON object"),
        (lambda m: json.dumps(m | {"format": "other"}), "format is 'other'"),
        (lambda m: json.dumps(m | {"version": 9}), "version 9 is not supported"),
        (lambda m: json.dumps({k: v for k, v in m.items() if k != "shards"}), "key 'shards'"),
        (lambda m: json.dumps(m | {"num_samples": 7}), "do not add up to num_samples"),
        (
            lambda m: json.dumps(m | {"fields": m["fields"] | {"x": {"dtype": "nope"}}}),
            "field 'x': needs dtype and shape",
        ),
        (
            lambda m: json.dumps(m | {"fields": m["fields"] | {"z": {"dtype": "f4", "shape": []}}}),
            r"does not list \['shard-00000.z.npy'\]",
        ),
        (lambda m: json.dumps(m | {"shards": [1]}), "lacks name, num_samples or files"),
    ],
)
def test_a_malformed_manifest(dataset_dir: Path, edit: Any, problem: str) -> None:
    path = dataset_dir / MANIFEST
    path.write_text(edit(json.loads(path.read_text())))
    with pytest.raises(DataError, match=problem) as info:
        ShardedDataset(dataset_dir)
    assert str(path) in str(info.value)
