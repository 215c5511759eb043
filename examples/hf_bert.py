"""A Hugging Face ``transformers`` BERT sequence classifier, trained by dtrain as it comes: no
wrapper, dict batches, the model's own weight names in checkpoints and exports.

Run it on 2 workers (from the repository root; needs ``pip install -e '.[hf]'``)::

    dtrain train examples/hf_bert.toml --nproc 2
    dtrain train examples/hf_bert.toml --nproc 2 --strategy.name=fsdp --run.dir=runs/bert-fsdp

then ``dtrain export runs/hf-bert bert-out --format hf`` writes a folder
``BertForSequenceClassification.from_pretrained("bert-out")`` loads. The model is built from a
small config here (nothing is downloaded).

The samples are dicts ``{"input_ids": ..., "labels": ...}`` (add ``attention_mask`` for padded
sequences: every field but ``labels`` goes to the model as a keyword argument;
``strategy.name = 'pipeline'`` takes ``input_ids`` alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import Dataset

import dtrain
import dtrain.hf


class PatternClasses(Dataset[dict[str, torch.Tensor]]):
    """Sequences made by one of ``classes`` rules (token t+1 = token t * (class + 2) + 1, with
    noise); the label is the rule."""

    def __init__(self, size: int, seq_len: int, vocab: int, classes: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, classes, (size,), generator=g)
        ids = torch.zeros(size, seq_len, dtype=torch.int64)
        ids[:, 0] = torch.randint(0, vocab, (size,), generator=g)
        noise = torch.randint(0, 2, (size, seq_len), generator=g)
        for t in range(1, seq_len):
            ids[:, t] = (ids[:, t - 1] * (labels + 2) + 1 + noise[:, t]) % vocab
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.labels[index]}


@dataclass
class BertOptions:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    vocab: int = 64
    classes: int = 3
    seq_len: int = 16
    train_size: int = 4096
    val_size: int = 512
    # 0: every rank and one process draw no dropout masks, so the math is one process's.
    dropout: float = 0.0


def build_model(opts: BertOptions) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=opts.vocab,
        hidden_size=opts.hidden,
        num_hidden_layers=opts.layers,
        num_attention_heads=opts.heads,
        intermediate_size=4 * opts.hidden,
        max_position_embeddings=opts.seq_len,
        num_labels=opts.classes,
        hidden_dropout_prob=opts.dropout,
        attention_probs_dropout_prob=opts.dropout,
        classifier_dropout=opts.dropout,
    )
    return BertForSequenceClassification(config)


def accuracy(model: nn.Module, opts: BertOptions) -> str:
    """Rank 0, after training, with the whole model (under every strategy)."""
    data = PatternClasses(opts.val_size, opts.seq_len, opts.vocab, opts.classes, seed=1)
    with torch.no_grad():
        predicted = model(input_ids=data.ids).logits.argmax(-1)
    return f"validation accuracy: {(predicted == data.labels).float().mean():.1%}"


@dtrain.task_config(BertOptions)
def build(cfg: dtrain.Config) -> dtrain.Task:
    opts: BertOptions = cfg.task
    sizes = (opts.seq_len, opts.vocab, opts.classes)
    return dtrain.hf.sequence_classification_task(
        build_model(opts),
        train_data=PatternClasses(opts.train_size, *sizes, seed=0),
        val_data=PatternClasses(opts.val_size, *sizes, seed=1),
        after_training=lambda model: accuracy(model, opts),
    )
