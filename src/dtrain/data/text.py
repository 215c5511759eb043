"""Language-model views over a sharded dataset of token sequences.

* :class:`TokenWindows` -- the documents end to end, cut into fixed windows of ``seq_len + 1``
  tokens (stride ``seq_len``); fixed-size samples, so batches are split by sample count.
* :class:`TokenSequences` -- one sample per document (truncated to ``max_len + 1`` tokens);
  variable-length samples, so the partitioner balances tokens across ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from dtrain.data.shards import ShardedDataset
from dtrain.task import IGNORE_INDEX


class TokenWindows:
    def __init__(self, dataset: ShardedDataset, seq_len: int, field: str = "tokens") -> None:
        if not dataset.fields[field].variable:
            raise ValueError(f"field {field!r} is not a token sequence")
        self.dataset = dataset
        self.field = field
        self.seq_len = seq_len
        shard_tokens = [
            int(dataset.field_offsets(s, field)[-1]) for s in range(len(dataset.shard_sizes))
        ]
        self._token_starts = np.concatenate([[0], np.cumsum(shard_tokens)]).astype(np.int64)
        self.num_tokens = int(self._token_starts[-1])
        self._len = max(0, (self.num_tokens - 1) // seq_len)
        # Windows per storage shard (by the shard of their first token), for the locality
        # shuffle: it then reads a few shards at a time, as it does for any other dataset.
        bounds = np.minimum(self._len, -(-self._token_starts // seq_len))
        self.shard_sizes = tuple(int(n) for n in np.diff(bounds))

    @property
    def fingerprint(self) -> str:
        return f"{self.dataset.fingerprint}:windows{self.seq_len}"

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
        if not 0 <= index < self._len:
            raise IndexError(f"window {index} is out of range for {self._len} windows")
        start = index * self.seq_len
        return self.tokens(start, start + self.seq_len + 1)

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return [self[i] for i in indices]


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
    def fingerprint(self) -> str:
        return f"{self.dataset.fingerprint}:sequences{self.max_len}"

    def __len__(self) -> int:
        return len(self.dataset)

    def sample_lengths(self) -> np.ndarray:
        return self._lengths

    def __getitem__(self, index: int) -> np.ndarray:
        return self.dataset[index][self.field][: self.max_len + 1]

    def __getitems__(self, indices: list[int]) -> list[np.ndarray]:
        return [self[i] for i in indices]


def collate_windows(samples: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length windows to ``(inputs, targets)``, targets shifted by one token."""
    block = torch.from_numpy(np.stack(samples).astype(np.int64))
    return block[:, :-1], block[:, 1:]


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
