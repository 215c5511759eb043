"""Tokenized data: ``dtrain prepare --tokenizer tokenizer.json`` (a tiny BPE trained here, no
download) writes token-id shards; :class:`TokenWindows` with a stride gives a window at every
offset, exactly once an epoch over the window starts, resumable, ids as int64; a GPT trains on
them; and the mistakes around them are one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

from dtrain.config.load import build_config
from dtrain.data.build import dataset_fingerprint
from dtrain.data.loader import RankLoader, fetch_batch
from dtrain.data.partition import OrderSpec
from dtrain.data.prepare import prepare
from dtrain.data.shards import ShardedDataset
from dtrain.data.text import TokenWindows, collate_windows
from dtrain.data.tokenizer import load_tokenizer
from dtrain.errors import DataError, UserError
from dtrain.task import split_input_target
from dtrain.tasks.gpt import GPTTaskConfig
from tests.dist_helpers import make_trainer
from tests.ranks import run_ranks
from tests.test_cli import run_cli

tokenizers = pytest.importorskip("tokenizers")

DOCS = [
    f"def function_{i}(x):\n    return x * {i} + {i % 7}  # a comment about {i}\n"
    for i in range(60)
]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A JSONL corpus and a byte-level BPE of 300 ids trained on it, saved as
    tokenizer.json."""
    root = tmp_path_factory.mktemp("tokenized")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<eos>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(DOCS, trainer)
    tok.save(str(root / "tokenizer.json"))
    for split, docs in (("train", DOCS[:50]), ("val", DOCS[50:])):
        (root / f"{split}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return {"root": root, "tokenizer": root / "tokenizer.json"}


@pytest.fixture(scope="module")
def prepared(corpus: dict[str, Path]) -> Path:
    """``dtrain prepare`` through the CLI (train), and through its Python API (val)."""
    data = corpus["root"] / "data"
    result = run_cli(
        "prepare",
        str(corpus["root"] / "train.jsonl"),
        str(data / "train"),
        "--tokenizer",
        str(corpus["tokenizer"]),
        "--eos",
        "<eos>",
        "--shard-mb",
        "0.001",  # several shards: windows cross their boundaries
    )
    assert result.returncode == 0, result.stderr[-2000:]
    tokenizer = load_tokenizer(corpus["tokenizer"], "<eos>")
    prepare(
        corpus["root"] / "val.jsonl",
        data / "val",
        tokenizer=tokenizer,
        vocab_size=tokenizer.vocab_size,
        metadata=tokenizer.metadata(),
        show_progress=False,
    )
    return data


def test_prepare_writes_the_tokenizers_ids(corpus: dict[str, Path], prepared: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(corpus["tokenizer"]))
    eos = tok.token_to_id("<eos>")
    dataset = ShardedDataset(prepared / "train")
    assert dataset.fields["tokens"].dtype == "uint16"  # 300 ids
    assert len(dataset.shard_sizes) > 2
    meta = dataset.manifest["metadata"]
    assert meta["vocab_size"] == tok.get_vocab_size() and meta["eos_id"] == eos
    for i in (0, 17, 49):
        want = [*tok.encode(DOCS[i], add_special_tokens=False).ids, eos]
        assert dataset[i]["tokens"].tolist() == want
        assert tok.decode(want[:-1]) == DOCS[i]


def test_ids_beyond_uint16_are_stored_as_uint32(tmp_path: Path) -> None:
    (tmp_path / "a.txt").write_text("abc")
    out = prepare(
        tmp_path / "a.txt",
        tmp_path / "ds",
        tokenizer=lambda text: [70_000 + ord(c) for c in text],
        vocab_size=71_000,
        show_progress=False,
    )
    dataset = ShardedDataset(out)
    assert dataset.fields["tokens"].dtype == "uint32"
    assert dataset[0]["tokens"].tolist() == [70_097, 70_098, 70_099]


def test_a_window_at_every_offset(prepared: Path) -> None:
    dataset = ShardedDataset(prepared / "train")
    stream = np.concatenate([dataset[i]["tokens"] for i in range(len(dataset))])
    windows = TokenWindows(dataset, seq_len=16, stride=1)
    assert len(windows) == len(stream) - 16
    for i in (0, 1, 2, len(windows) // 3, len(windows) - 1):
        window = windows[i]
        assert window.dtype == np.int64
        assert window.tolist() == stream[i : i + 17].tolist()
    every_4th = TokenWindows(dataset, seq_len=16, stride=4)
    assert len(every_4th) == (len(stream) - 17) // 4 + 1
    assert every_4th[5].tolist() == stream[20:37].tolist()
    # The stride is part of what a resume checks; the default keeps the old fingerprint.
    assert dataset_fingerprint(windows).endswith(":windows16stride1")
    assert dataset_fingerprint(TokenWindows(dataset, 16)).endswith(":windows16")
    inputs, targets = collate_windows([windows[3], windows[4]])
    assert inputs.dtype == torch.int64 and torch.equal(inputs[1], targets[0])
    assert targets.view(-1).tolist() == [*stream[4:20].tolist(), *stream[5:21].tolist()]
    assert inputs.is_contiguous() and targets.is_contiguous()


def loader(windows: TokenWindows, rank: int, **kw: Any) -> RankLoader:
    return RankLoader(
        windows,
        order=OrderSpec(len(windows), seed=3),
        global_batch_size=24,
        micro_batches=1,
        rank=rank,
        world_size=2,
        collate_fn=collate_windows,
        prefetch=0,
        fingerprint=dataset_fingerprint(windows),
        **kw,
    )


def test_every_window_start_once_an_epoch_and_resumable(prepared: Path) -> None:
    windows = TokenWindows(ShardedDataset(prepared / "train"), seq_len=16, stride=1)
    steps = len(windows) // 24  # one epoch's whole steps
    seen = [
        np.concatenate([np.concatenate(next(ranks).ids) for _ in range(steps)])
        for ranks in (loader(windows, 0), loader(windows, 1))
    ]
    ids = np.concatenate(seen)
    # The epoch's whole steps: all but the last < 24 starts, each once, over the two ranks.
    assert len(ids) == steps * 24 > len(windows) - 24
    assert len(np.unique(ids)) == len(ids) and ids.min() >= 0 and ids.max() < len(windows)
    # Resume after 3 steps, in a new loader: the same batches follow.
    first = loader(windows, 1)
    for _ in range(3):
        next(first)
    resumed = loader(windows, 1)
    resumed.load_state_dict(first.state_dict())
    for _ in range(2):
        a, b = next(first), next(resumed)
        assert all(torch.equal(x[0], y[0]) for x, y in zip(a.micro, b.micro))


def test_prepared_shards_in_the_default_batch_layout_are_one_line(prepared: Path) -> None:
    dataset = ShardedDataset(prepared / "train")
    with pytest.raises(DataError, match=r"\['tokens'\].*TokenWindows") as caught:
        fetch_batch(dataset, [0, 1], default_collate)
    assert "\n" not in str(caught.value)
    with pytest.raises(UserError, match=r"keys \['tokens'\]: prepared token shards"):
        split_input_target({"tokens": torch.zeros(2, 3)})


def test_a_tokenizer_file_that_does_not_load_is_one_line(
    corpus: dict[str, Path], tmp_path: Path
) -> None:
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"model": "not a tokenizer"}')
    (tmp_path / "a.txt").write_text("text")
    result = run_cli(
        "prepare", str(tmp_path / "a.txt"), str(tmp_path / "out"), "--tokenizer", str(bad)
    )
    assert result.returncode == 2, result.stderr
    assert "not a Hugging Face tokenizers file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1  # no traceback
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match="no such file"):
        load_tokenizer(tmp_path / "missing.json")
    with pytest.raises(DataError, match="'<nope>': not a token"):
        load_tokenizer(corpus["tokenizer"], "<nope>")


def train_tokenized(raw: dict[str, Any]) -> list[float]:
    trainer = make_trainer(raw)
    summary = trainer.fit()
    assert trainer.strategy.unwrapped.head.out_features == 300  # the tokenizer's vocabulary
    lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    losses = [r["loss"] for r in map(json.loads, lines) if r["kind"] == "train"]
    return [*losses, summary.val_loss]


def test_a_gpt_trains_on_windows_at_every_offset(prepared: Path, tmp_path: Path) -> None:
    raw = build_config(
        {
            "run": {"dir": str(tmp_path / "run"), "task": "dtrain.tasks.gpt:build"},
            "data": {"global_batch_size": 8, "prefetch": 0},
            "train": {"steps": 4, "log_every": 2},
            "eval": {"every": 0, "batch_size": 8},
            "checkpoint": {"every": 0},
            "task": {
                "data_dir": str(prepared),
                "seq_len": 16,
                "stride": 1,
                "n_layer": 1,
                "d_model": 32,
                "n_head": 2,
            },
        },
        GPTTaskConfig,
    ).to_dict()
    losses = run_ranks(train_tokenized, 2, raw)[0]
    assert all(np.isfinite(losses)) and losses[0] > losses[1]
