"""Language-model views over a sharded dataset of token sequences (docs/data.md, "Training on
token shards").

* :class:`TokenWindows` -- the documents end to end, cut into windows of ``seq_len + 1`` tokens,
  one starting every ``stride`` tokens; each window start is one sample id, read from the
  shards only when fetched. Fixed-size samples: batches are split by sample count.
* :class:`TokenSequences` -- one sample per document (truncated to ``max_len + 1`` tokens);
  variable-length samples, so the partitioner balances tokens across ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from dtrain.data.shards import ShardedDataset
from dtrain.data.store_shards import StoreShards
from dtrain.errors import DataError
from dtrain.task import IGNORE_INDEX


class TokenWindows:
    def __init__(
        self,
        dataset: ShardedDataset,
        seq_len: int,
        field: str = "tokens",
        stride: int | None = None,
    ) -> None:
        if field not in dataset.fields or not dataset.fields[field].variable:
            raise DataError(
                f"{dataset.path}: field {field!r} is not a token sequence (the dataset's "
                f"fields: {sorted(dataset.fields)}); prepare text with `dtrain prepare`"
            )
        stride = seq_len if stride is None else stride
        if seq_len < 1 or stride < 1:
            raise DataError(f"TokenWindows: seq_len {seq_len} and stride {stride} must be >= 1")
        self.dataset = dataset
        self.field = field
        self.seq_len = seq_len
        self.stride = stride
        shard_tokens = [
            int(dataset.field_offsets(s, field)[-1]) for s in range(len(dataset.shard_sizes))
        ]
        self._token_starts = np.concatenate([[0], np.cumsum(shard_tokens)]).astype(np.int64)
        self.num_tokens = int(self._token_starts[-1])
        # Window i holds tokens i*stride .. i*stride + seq_len: every start that has
        # seq_len + 1 tokens from it on.
        span = self.num_tokens - seq_len - 1
        self._len = span // stride + 1 if span >= 0 else 0
        # Windows per storage shard (by the shard of their first token), for the locality
        # shuffle: it then reads a few shards at a time, as it does for any other dataset.
        bounds = np.minimum(self._len, -(-self._token_starts // stride))
        self.shard_sizes = tuple(int(n) for n in np.diff(bounds))

    @property
    def store(self) -> StoreShards | None:
        return self.dataset.store

    def pieces(self, ids: np.ndarray) -> np.ndarray:
        """The store's pieces that windows ``ids`` read (shards in an object store)."""
        ids = np.asarray(ids, dtype=np.int64)
        start = ids * self.stride
        stop = start + self.seq_len + 1
        first = np.searchsorted(self._token_starts, start, side="right") - 1
        last = np.searchsorted(self._token_starts, stop - 1, side="right") - 1
        # A window that crosses shards is cut at their bounds: one range per shard it reads.
        spans = last - first + 1
        shard = np.repeat(first, spans) + (
            np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)
        )
        begin = self._token_starts[shard]
        lo = np.maximum(np.repeat(start, spans), begin) - begin
        hi = np.minimum(np.repeat(stop, spans), self._token_starts[shard + 1]) - begin
        return self.dataset.value_pieces(self.field, shard, lo, hi)

    @property
    def fingerprint(self) -> str:
        step = "" if self.stride == self.seq_len else f"stride{self.stride}"
        return f"{self.dataset.fingerprint}:windows{self.seq_len}{step}"

    def __len__(self) -> int:
        return self._len

    def tokens(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``start .. stop-1`` of the whole stream, across shard boundaries."""
        parts = []
        pos = start
        while pos < stop:
            shard = int(np.searchsorted(self._token_starts, pos, side="right")) - 1
            values = self.dataset.field_values(shard, self.field)
            local = pos - int(self._token_starts[shard])
            take = min(stop - pos, len(values) - local)
            parts.append(values[local : local + take])
            pos += take
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, index: int) -> np.ndarray:
        """Window ``index``: ``seq_len + 1`` token ids as int64."""
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} is out of range for {self._len} windows")
        start = index * self.stride
        if self.dataset.store is None:
            return self.tokens(start, start + self.seq_len + 1).astype(np.int64)
        with self.dataset.store.hold(self.pieces(np.array([index]))):
            return self.tokens(start, start + self.seq_len + 1).astype(np.int64)  # a copy


class TokenSequences:
    def __init__(self, dataset: ShardedDataset, max_len: int, field: str = "tokens") -> None:
        self.dataset = dataset
        self.field = field
        self.max_len = max_len
        raw = dataset.sample_lengths(field)
        assert raw is not None
        # Target tokens per sample: a sequence of n tokens predicts n - 1 of them.
        self._lengths = np.clip(raw, 1, max_len + 1) - 1
        self.shard_sizes = dataset.shard_sizes  # one sample per document, in storage order

    @property
    def store(self) -> StoreShards | None:
        return self.dataset.store

    def pieces(self, ids: np.ndarray) -> np.ndarray:
        return self.dataset.pieces(ids)

    @property
    def fingerprint(self) -> str:
        return f"{self.dataset.fingerprint}:sequences{self.max_len}"

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_lengths(self) -> np.ndarray:
        return self._lengths

    def __getitem__(self, index: int) -> np.ndarray:
        return self.dataset[index][self.field][: self.max_len + 1]


def collate_windows(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length windows to ``(inputs, targets)``, targets shifted by one token; each its
    own contiguous tensor (slices of one block were not: a model's ``targets.view(-1)``
    failed)."""
    block = torch.from_numpy(np.stack(samples).astype(np.int64))
    return block[:, :-1].contiguous(), block[:, 1:].contiguous()


def collate_padded(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Variable-length sequences, right-padded; padded targets are ``IGNORE_INDEX`` so the loss
    neither sees nor counts them."""
    width = max(1, max(len(s) for s in samples) - 1)
    inputs = torch.zeros((len(samples), width), dtype=torch.int64)
    targets = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.int64)
    for row, seq in enumerate(samples):
        tokens = torch.from_numpy(np.asarray(seq, dtype=np.int64))
        n = len(tokens) - 1
        if n > 0:
            inputs[row, :n] = tokens[:-1]
            targets[row, :n] = tokens[1:]
    return inputs, targets
