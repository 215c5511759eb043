"""Tensor-parallel plans of Hugging Face ``transformers`` models, which carry no
``tensor_parallel_plan(degree)`` of dtrain's: known by their modules, never by importing
``transformers`` (an optional extra).

- GPT-2 (any model holding ``GPT2Attention`` and ``GPT2MLP`` blocks: ``GPT2LMHeadModel``,
  ``GPT2Model``, ``GPT2ForSequenceClassification``, ...): its ``Conv1D`` layers are transposed
  linear maps and its attention projects q, k and v in one fused ``c_attn``, which
  :mod:`dtrain.parallel.transposed` cuts by head; the MLP's ``c_fc`` column-wise and
  ``c_proj`` row-wise. Embeddings, layer norms and the (tied) head stay whole.
- A model whose config carries ``base_model_tp_plan`` (``transformers``' own plan: Llama,
  Qwen2, ...) of ``"colwise"`` and ``"rowwise"`` ``nn.Linear`` layers only: that plan, read as
  dtrain's (docs/models.md has what each family needs).

Any other model is refused by :func:`dtrain.parallel.tensor_plan.model_plan` in one line.
"""

from __future__ import annotations

import re
from typing import Any

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from dtrain.parallel.transposed import FusedHeadsAttention, TransposedParallel

KNOWN = "GPT-2 (GPT2Attention and GPT2MLP blocks) and models whose config has a base_model_tp_plan"
# How a plan names torch's styles of an nn.Linear (dtrain's plans and transformers' alike).
STYLES: dict[str, type[ParallelStyle]] = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}


def knows(model: nn.Module) -> bool:
    """Whether the model is one of the kinds :func:`hf_plan` cuts."""
    if any(type(m).__name__ in ("GPT2Attention", "GPT2MLP") for m in model.modules()):
        return True
    patterns = getattr(getattr(model, "config", None), "base_model_tp_plan", None)
    return isinstance(patterns, dict) and bool(patterns)


def hf_plan(model: nn.Module, degree: int) -> dict[str, ParallelStyle] | None:
    """The styles of the layers to cut at ``degree`` (raises ValueError where the shapes do not
    divide), or None when the model is none of the known kinds."""
    return _gpt2_plan(model, degree) or _config_plan(model, degree)  # a plan is never empty


def _gpt2_plan(model: nn.Module, degree: int) -> dict[str, ParallelStyle] | None:
    plan: dict[str, ParallelStyle] = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        found: Any = module
        if kind == "GPT2Attention":
            if found.is_cross_attention:
                raise ValueError(f"{name} is a cross-attention, which no plan cuts")
            if found.num_heads % degree:
                raise ValueError(
                    f"{name} has {found.num_heads} heads, not a multiple of the degree {degree}"
                )
            plan[name] = FusedHeadsAttention()
        elif kind == "GPT2MLP":
            if found.c_fc.nf % degree:
                raise ValueError(
                    f"{name}.c_fc has {found.c_fc.nf} outputs, not a multiple of the degree "
                    f"{degree}"
                )
            plan[f"{name}.c_fc"] = TransposedParallel("colwise")
            plan[f"{name}.c_proj"] = TransposedParallel("rowwise")
    return plan or None


def _config_plan(model: nn.Module, degree: int) -> dict[str, ParallelStyle] | None:
    config = getattr(model, "config", None)
    patterns = getattr(config, "base_model_tp_plan", None)
    if not isinstance(patterns, dict) or not patterns:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else None
    if not isinstance(base, nn.Module):
        base, prefix = model, ""
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, key, None)
        if isinstance(heads, int) and heads % degree:
            raise ValueError(f"config.{key} = {heads} is not a multiple of the degree {degree}")
    plan: dict[str, ParallelStyle] = {}
    for pattern, style in patterns.items():
        if style not in STYLES:
            raise ValueError(
                f"its base_model_tp_plan cuts {pattern} {style!r}; dtrain takes 'colwise' and "
                "'rowwise' nn.Linear layers only"
            )
        regex = re.compile(re.escape(pattern).replace(r"\*", r"\d+") + "$")
        for name, module in base.named_modules():
            if regex.match(name):
                if not isinstance(module, nn.Linear):
                    raise ValueError(f"its base_model_tp_plan cuts {name}, not an nn.Linear")
                plan[f"{prefix}.{name}" if prefix else name] = STYLES[style]()
    return plan or None
