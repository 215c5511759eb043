"""A Hugging Face ``tokenizers`` file (``tokenizer.json``) as ``dtrain prepare --tokenizer``
uses it: text in, token ids out, and the vocabulary size that picks the shards' id type
(uint16 up to 65,536 ids, else uint32). ``tokenizers`` is an optional extra
(``pip install -e '.[tokenizers]'``); nothing else imports it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtrain.errors import DataError, UserError


@dataclass
class FileTokenizer:
    """Encodes text with the tokenizer in ``path``; ``eos_id`` (when set) ends every
    document, as GPT-2's ``<|endoftext|>`` does in nanoGPT's prepared data, so that a window
    across two documents sees where one ends."""

    path: Path
    tokenizer: Any  # tokenizers.Tokenizer
    vocab_size: int
    eos_id: int | None = None

    def __call__(self, text: str) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.eos_id is not None:
            ids.append(self.eos_id)
        return ids

    def metadata(self) -> dict[str, Any]:
        """What the dataset's manifest records of it."""
        return {"tokenizer": str(self.path), "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def load_tokenizer(path: str | Path, eos: str | None = None) -> FileTokenizer:
    """The tokenizer in ``path``; ``eos``: a token of its vocabulary to end every document
    with. A file that does not load, or a token it does not have, is one line."""
    path = Path(path)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(
            f"--tokenizer {path}: needs the tokenizers package: pip install -e '.[tokenizers]' "
            "in dtrain's clone"
        ) from None
    if not path.is_file():
        raise DataError(f"--tokenizer {path}: no such file (a Hugging Face tokenizer.json)")
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the library raises plain Exceptions with its parser's message
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DataError(
            f"--tokenizer {path}: not a Hugging Face tokenizers file ({reason}); save one with "
            "tokenizer.save('tokenizer.json')"
        ) from None
    eos_id = None
    if eos is not None:
        eos_id = tokenizer.token_to_id(eos)
        if eos_id is None:
            raise DataError(f"--eos {eos!r}: not a token of {path}'s vocabulary")
    return FileTokenizer(path, tokenizer, tokenizer.get_vocab_size(with_added_tokens=True), eos_id)
