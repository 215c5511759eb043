"""A Hugging Face ``transformers`` GPT-2, trained by dtrain as it comes: no wrapper, dict
batches, the model's own weight names in checkpoints and exports.

Run it on 2 workers (from the repository root; needs ``pip install -e '.[hf]'``)::

    dtrain train examples/hf_gpt2.toml --nproc 2
    dtrain train examples/hf_gpt2.toml --nproc 2 --strategy.name=fsdp --run.dir=runs/gpt2-fsdp
    dtrain train examples/hf_gpt2.toml --nproc 2 --strategy.name=pipeline \\
        --strategy.pipeline_stages=2 --data.micro_batches=2 --run.dir=runs/gpt2-pipeline

then ``dtrain export runs/hf-gpt2 gpt2-out --format hf`` writes a folder
``GPT2LMHeadModel.from_pretrained("gpt2-out")`` loads. The model is built from a small config
here (nothing is downloaded); a pretrained one would start from its weights with
``run.init_from = "path/to/folder"``.

The samples are dicts ``{"input_ids": ...}``: the labels are the input ids, shifted inside the
loss as Hugging Face does (``dtrain.hf.causal_lm_task``), and dtrain counts the tokens that
loss counts (``labels[:, 1:]``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
from torch import nn
from torch.utils.data import Dataset

import dtrain
import dtrain.hf


class PatternTokens(Dataset[dict[str, torch.Tensor]]):
    """Token sequences with structure to learn: each token follows from the one before it,
    with a little noise."""

    def __init__(self, size: int, seq_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        ids = torch.zeros(size, seq_len, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, vocab, (size,), generator=g)
        noise = torch.randint(0, 3, (size, seq_len), generator=g)
        for t in range(1, seq_len):
            ids[:, t] = (ids[:, t - 1] * 5 + 1 + noise[:, t]) % vocab
        self.ids = ids

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index]}


@dataclass
class GPT2Options:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    vocab: int = 128
    seq_len: int = 32
    train_size: int = 4096
    val_size: int = 256
    # 0: every rank and one process draw no dropout masks, so the math is one process's.
    dropout: float = 0.0
    generate_tokens: int = 12


def build_model(opts: GPT2Options) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=opts.vocab,
        n_positions=opts.seq_len,
        n_embd=opts.n_embd,
        n_layer=opts.n_layer,
        n_head=opts.n_head,
        resid_pdrop=opts.dropout,
        embd_pdrop=opts.dropout,
        attn_pdrop=opts.dropout,
        bos_token_id=None,
        eos_token_id=None,
    )
    return GPT2LMHeadModel(config)


def continue_text(model: nn.Module, opts: GPT2Options) -> str:
    """Rank 0, after training, with the whole model (under every strategy): a greedy
    continuation of a held-out sequence's first tokens by the model's own generate(), and how
    many of its tokens follow the pattern from the token before them."""
    new = min(opts.generate_tokens, opts.seq_len - 4)
    if new <= 0:
        return ""
    prompt = PatternTokens(1, opts.seq_len, opts.vocab, seed=7).ids[:, :4]
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)  # type: ignore[operator]
    tokens = out[0, 3:].tolist()  # the prompt's last token, then the generated ones
    right = sum((after - (before * 5 + 1)) % opts.vocab < 3 for before, after in pairwise(tokens))
    return f"greedy continuation: {right}/{len(tokens) - 1} generated tokens follow the pattern"


@dtrain.task_config(GPT2Options)
def build(cfg: dtrain.Config) -> dtrain.Task:
    opts: GPT2Options = cfg.task
    return dtrain.hf.causal_lm_task(
        build_model(opts),
        train_data=PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0),
        val_data=PatternTokens(opts.val_size, opts.seq_len, opts.vocab, seed=1),
        after_training=lambda model: continue_text(model, opts),
    )
