"""The default task: a byte-level GPT on the Python standard library's own sources."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.config import Config
from dtrain.config.fields import option
from dtrain.data.corpus import prepare_stdlib_corpus
from dtrain.data.shards import ShardedDataset
from dtrain.data.text import TokenSequences, TokenWindows, collate_padded, collate_windows
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.storage.objects import location
from dtrain.task import IGNORE_INDEX, Task, task_config

PROMPTS = ("def ", "class ", "import ")


@dataclass
class GPTTaskConfig:
    seq_len: int = option(128, "tokens per sample (the context length)", min=1)
    n_layer: int = option(3, "transformer blocks", min=1)
    n_head: int = option(4, "attention heads per block; must divide d_model", min=1)
    d_model: int = option(192, "width of the residual stream", min=1)
    dropout: float = option(0.0, "dropout rate", min=0, max=1)
    # A prepared dataset with train/ and val/ (a folder, or s3://BUCKET/PREFIX); empty = the
    # stdlib corpus.
    data_dir: str = ""
    samples: Literal["windows", "documents"] = "windows"  # documents: one file per sample
    generate_tokens: int = option(160, "printed after training, per prompt (0 = none)", min=0)
    # windows: a window starts every `stride` tokens (0 = seq_len: no overlap; 1: at every
    # offset, as nanoGPT samples). An epoch visits every start once.
    stride: int = option(0, "tokens between window starts (0 = seq_len)", min=0)
    # Build the model on the meta device: each rank makes only the part it holds (fsdp,
    # pipeline, tensor), for models larger than one rank's memory.
    meta_init: bool = False

    def dataset_paths(self) -> list[str]:
        """The datasets this task reads (``dtrain train`` checks those in a store before any
        worker starts)."""
        root = self.data_dir.rstrip("/")
        return [f"{root}/train", f"{root}/val"] if root else []

    def __post_init__(self) -> None:
        # Checked with the rest of the config, before any worker starts: the heads split the
        # width evenly, or the attention's reshape fails in every worker.
        if self.d_model % self.n_head:
            raise ConfigError(
                f"task.n_head = {self.n_head} does not divide task.d_model = {self.d_model}: "
                "each head gets d_model / n_head of the width; pick an n_head that divides it "
                f"(e.g. {_nearest_divisor(self.d_model, self.n_head)})"
            )


def _nearest_divisor(number: int, near: int) -> int:
    return min((d for d in range(1, number + 1) if number % d == 0), key=lambda d: abs(d - near))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross entropy, unreduced; padding targets contribute 0 and are not counted."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


def generate_samples(model: nn.Module, new_tokens: int, seed: int = 0) -> str:
    if new_tokens <= 0 or not isinstance(model, GPT):
        return ""
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    # What to expect, said before the text: a small byte-level model writes Python's shape.
    lines = [
        f"samples from the trained model ({millions:.1f} M parameters, byte by byte after each "
        "prompt):",
        "expect Python's shape (indentation, keywords, plausible names and calls), not working "
        "code; more steps and a larger model (task.n_layer, task.d_model) get closer",
    ]
    for prompt in PROMPTS:
        idx = torch.tensor([list(prompt.encode())], dtype=torch.int64, device=device)
        out = model.generate(idx, new_tokens, generator=generator)[0].tolist()
        text = bytes(out).decode("utf-8", errors="replace")
        lines += ["-" * 60, text]
    return "\n".join(lines)


@task_config(GPTTaskConfig)
def build(cfg: Config) -> Task:
    opts: GPTTaskConfig = cfg.task
    root = location(opts.data_dir) if opts.data_dir else prepare_stdlib_corpus()
    # A dataset in an object store is read through a cache of pieces (data.cache_*).
    train, val = (
        ShardedDataset(root / part, cfg.data.cache_dir, cfg.data.cache_bytes)
        for part in ("train", "val")
    )
    # Bytes, or the vocabulary of the tokenizer `dtrain prepare --tokenizer` recorded.
    vocab_size = int(train.manifest.get("metadata", {}).get("vocab_size") or 256)
    gpt_config = GPTConfig(
        vocab_size=vocab_size,
        seq_len=opts.seq_len,
        n_layer=opts.n_layer,
        n_head=opts.n_head,
        d_model=opts.d_model,
        dropout=opts.dropout,
    )
    with torch.device("meta") if opts.meta_init else contextlib.nullcontext():
        model = GPT(gpt_config)
    if opts.samples == "documents":
        train_data: TokenSequences | TokenWindows = TokenSequences(train, opts.seq_len)
        val_data: TokenSequences | TokenWindows = TokenSequences(val, opts.seq_len)
        collate = collate_padded
    else:
        stride = opts.stride or None
        train_data = TokenWindows(train, opts.seq_len, stride=stride)
        val_data = TokenWindows(val, opts.seq_len)  # each token predicted once
        collate = collate_windows
    seed = cfg.run.seed
    # Samples are printed as text for byte-level data only (token ids need their tokenizer).
    tokens = opts.generate_tokens if vocab_size == 256 else 0
    return Task(
        model=model,
        train_data=train_data,
        val_data=val_data,
        loss_fn=lm_loss,
        collate_fn=collate,
        item_name="tokens",
        # Samples need the whole trained model on rank 0, gathered from every rank's part:
        # asked for none, the task gathers none (a model too big for one rank trains to
        # the end).
        after_training=(lambda m: generate_samples(m, tokens, seed)) if tokens else None,
        init_weights=GPT.init_weights if opts.meta_init else None,
        # Windows hold seq_len targets each, none of them padding: the ranks need not count.
        items_per_sample=opts.seq_len if opts.samples == "windows" else None,
    )
