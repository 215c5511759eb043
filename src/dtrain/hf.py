"""Hugging Face ``transformers`` models as they come: a causal LM or a sequence classifier in a
:class:`~dtrain.Task` of a few lines, no wrapper (checkpoints and exports keep the model's own
weight names; docs/models.md shows one).

A dataset yields dicts of tensors: ``labels`` are the targets (a causal LM's default to its input
ids, shifted inside the loss), the other fields go to the model as keyword arguments, and a
batch of ``input_ids`` alone goes as the one positional argument, so a pipeline's first stage
takes it. Items are counted as the loss counts them. The helpers, what they count and which
models :func:`pipeline_layers` cuts: docs/models.md.

``transformers`` is an optional extra (``pip install -e '.[hf]'``); the rest of dtrain never
imports it, and this module only when a function here needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dtrain.errors import ConfigError, UserError
from dtrain.task import IGNORE_INDEX, Task

LABELS = "labels"

# -- batches -----------------------------------------------------------------------------------


def _model_inputs(batch: Mapping[str, Any]) -> Any:
    """The fields the model takes: ``input_ids`` alone as a tensor, else a dict (keywords)."""
    inputs = {k: v for k, v in batch.items() if k != LABELS}
    if list(inputs) == ["input_ids"]:
        return inputs["input_ids"]
    return inputs


def _mapping(batch: Any) -> Mapping[str, Any]:
    if not isinstance(batch, Mapping):
        raise UserError(
            f"dtrain.hf tasks take dict batches (the model's fields and 'labels'); the "
            f"dataset gave a {type(batch).__name__}"
        )
    return batch


def split_classification_batch(batch: Any) -> tuple[Any, Any]:
    """``(model inputs, labels)`` of a dict batch that holds ``labels``."""
    batch = _mapping(batch)
    if LABELS not in batch:
        raise UserError(
            f"a sequence-classification batch needs 'labels' beside the model's fields; this "
            f"one has {sorted(batch)}"
        )
    return _model_inputs(batch), batch[LABELS]


def split_causal_lm_batch(batch: Any) -> tuple[Any, Any]:
    """``(model inputs, labels)``; without ``labels`` the labels are the input ids (padding
    is then marked by an ``attention_mask`` of 0, which makes those labels -100)."""
    batch = _mapping(batch)
    if LABELS in batch:
        return _model_inputs(batch), batch[LABELS]
    if "input_ids" not in batch:
        raise UserError(
            f"a causal-LM batch needs 'input_ids' (and optionally 'labels'); this one has "
            f"{sorted(batch)}"
        )
    labels = batch["input_ids"]
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        labels = labels.masked_fill(mask == 0, IGNORE_INDEX)
    return _model_inputs(batch), labels


# -- losses ------------------------------------------------------------------------------------


def logits_of(output: Any) -> torch.Tensor:
    """The logits of a model's output: a tensor (a pipeline's last stage gives them), a
    ``ModelOutput`` or a tuple whose first element they are."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise UserError(
        f"the model returned a {type(output).__name__} without logits; dtrain.hf's losses take "
        "a tensor of logits or an output with a .logits field"
    )


def own_loss(output: Any) -> torch.Tensor | None:
    """The model's own per-token loss, when its output carries one unreduced (a mean loss,
    as Hugging Face models compute when given labels, is not the per-item loss dtrain needs:
    the labels are not passed to the model, and its logits are used instead)."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.dim() > 0:
        return loss
    return None


def causal_lm_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy of a causal LM whose labels are aligned with its inputs
    (Hugging Face's convention: the logits at position t predict label t + 1), one value per
    position of ``labels[:, 1:]``; ignored labels (-100) give 0."""
    own = own_loss(output)
    return own if own is not None else _per_item(logits_of(output)[..., :-1, :], labels[..., 1:])


def count_causal_lm_items(labels: Any) -> int:
    """The tokens a causal LM's loss counts: ``labels[:, 1:]`` that are not -100."""
    return int((labels[..., 1:] != IGNORE_INDEX).sum())


def classification_loss(output: Any, labels: torch.Tensor) -> torch.Tensor:
    """Per-sample cross-entropy of a classifier's logits (labels of -100 give 0)."""
    own = own_loss(output)
    return own if own is not None else _per_item(logits_of(output), labels)


def _per_item(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy in float32 per label, unreduced; ignored labels give 0."""
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


# -- tasks -------------------------------------------------------------------------------------


def causal_lm_task(model: nn.Module, train_data: Any, val_data: Any = None, **fields: Any) -> Task:
    """A :class:`~dtrain.Task` training ``model`` (e.g. ``GPT2LMHeadModel``) as a causal LM
    on dict samples (see the module's docstring); ``fields`` set any other Task field."""
    defaults = dict(
        split_batch=split_causal_lm_batch,
        loss_fn=causal_lm_loss,
        count_items=count_causal_lm_items,
        item_name="tokens",
    )
    return _task(model, train_data, val_data, {**defaults, **fields})


def sequence_classification_task(
    model: nn.Module, train_data: Any, val_data: Any = None, **fields: Any
) -> Task:
    """A :class:`~dtrain.Task` training ``model`` (e.g. ``BertForSequenceClassification``)
    on dict samples with one class label each (``labels``); ``fields`` set any other Task
    field."""
    defaults = dict(
        split_batch=split_classification_batch,
        loss_fn=classification_loss,
        item_name="samples",
        items_per_sample=1,
    )
    return _task(model, train_data, val_data, {**defaults, **fields})


def _task(model: nn.Module, train_data: Any, val_data: Any, fields: dict[str, Any]) -> Task:
    # Training needs no key/value cache: a forward that keeps one only holds memory.
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
    fields = {"pipeline_layers": pipeline_layers, **fields}
    return Task(model=model, train_data=train_data, val_data=val_data, **fields)


# -- pipeline layers ---------------------------------------------------------------------------


def pipeline_layers(model: nn.Module) -> list[nn.Module]:
    """``model`` as a chain of layers over its own modules (for ``strategy.name =
    'pipeline'``): GPT-2's embeddings, blocks, final norm and head; BERT's embeddings, encoder
    layers, pooler and classifier. Each layer takes the previous one's output tensor."""
    name = type(model).__name__
    hf: Any = model  # its submodules, by the names transformers gives them
    if name == "GPT2LMHeadModel":
        gpt2: Any = hf.transformer
        return [
            _GPT2Embeddings(gpt2),
            *(_GPT2Block(block, gpt2.config) for block in gpt2.h),
            nn.Sequential(gpt2.ln_f, hf.lm_head),  # the final norm and the head
        ]
    if name == "BertForSequenceClassification":
        bert: Any = hf.bert
        if bert.pooler is None:
            raise ConfigError("strategy 'pipeline': this BERT has no pooler to classify from")
        return [
            bert.embeddings,  # takes the input ids as its first argument
            *(_BertLayer(layer, bert.config) for layer in bert.encoder.layer),
            nn.Sequential(bert.pooler, hf.dropout, hf.classifier),
        ]
    raise ConfigError(
        f"strategy.name = 'pipeline': dtrain.hf cuts GPT2LMHeadModel and "
        f"BertForSequenceClassification into stages, not {name}; give Task.pipeline_layers "
        "(the model's modules as a chain of layers, each taking the previous one's output), "
        "or use ddp, allreduce or fsdp"
    )


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


class _GPT2Embeddings(nn.Module):
    """Token and position embeddings (GPT2Model.forward's first part, without a cache)."""

    def __init__(self, gpt2: Any) -> None:
        super().__init__()
        self.wte, self.wpe, self.drop = gpt2.wte, gpt2.wpe, gpt2.drop

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.wte(input_ids)
        return self.drop(embeds + self.wpe(_positions(embeds)))


class _GPT2Block(nn.Module):
    """One block, with the causal mask its model would build for it."""

    def __init__(self, block: nn.Module, config: Any) -> None:
        from transformers.masking_utils import create_causal_mask

        super().__init__()
        self.block = block
        self.model_config = config
        self.make_mask = create_causal_mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        positions = _positions(hidden)
        mask = self.make_mask(
            config=self.model_config,
            inputs_embeds=hidden,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        return self.block(hidden, None, mask, position_ids=positions)


class _BertLayer(nn.Module):
    """One encoder layer, with the (absent: no padding) mask its model would build."""

    def __init__(self, layer: nn.Module, config: Any) -> None:
        from transformers.masking_utils import create_bidirectional_mask

        super().__init__()
        self.layer = layer
        self.model_config = config
        self.make_mask = create_bidirectional_mask

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        mask = self.make_mask(config=self.model_config, inputs_embeds=hidden, attention_mask=None)
        return self.layer(hidden, mask)
