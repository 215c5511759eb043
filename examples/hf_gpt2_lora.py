"""LoRA on a Hugging Face GPT-2 through PEFT: the model wrapped by ``peft.get_peft_model``
trains through ``dtrain.hf.causal_lm_task`` as it comes, under ddp and fsdp; only the adapters
get gradients, travel between ranks and go into checkpoints (the base is frozen, and the task
builds it again on every start).

Run it on 2 workers (needs ``pip install -e '.[hf,peft]'``)::

    dtrain train examples/hf_gpt2_lora.toml --nproc 2
    dtrain export runs/hf-gpt2-lora lora-adapter --format hf   # the adapter, as PEFT saves it

``PeftModel.from_pretrained(base, "lora-adapter")`` loads it. The base here is built from a
small config with the seed (nothing is downloaded); a pretrained one comes in through
``run.init_from = "path/to/gpt2"`` (its weights go into the frozen base), and then
``dtrain export RUN_DIR merged --format hf --merge`` writes the base with the adapter merged
in, a folder ``GPT2LMHeadModel.from_pretrained`` loads. A trained adapter comes in through
``run.init_adapter``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

import dtrain
import dtrain.hf
from examples.hf_gpt2 import GPT2Options, PatternTokens, build_model


@dataclass
class LoraOptions(GPT2Options):
    lora_r: int = 8
    lora_alpha: int = 16
    lora_targets: list[str] = field(default_factory=lambda: ["c_attn", "c_proj"])
    # false: the same model without adapters, every weight trained (a full fine-tune).
    lora: bool = True
    generate_tokens: int = 0


def build_lora_model(opts: LoraOptions) -> nn.Module:
    """The GPT-2 of ``opts`` with LoRA adapters on ``lora_targets`` (the rest frozen)."""
    model = build_model(opts)
    if not opts.lora:
        return model
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=opts.lora_r,
        lora_alpha=opts.lora_alpha,
        target_modules=list(opts.lora_targets),
        lora_dropout=0.0,  # as the example's dropout: the math of one process on every rank
        fan_in_fan_out=True,  # GPT-2's Conv1D keeps its weight transposed
    )
    return get_peft_model(model, config)  # type: ignore[arg-type]


@dtrain.task_config(LoraOptions)
def build(cfg: dtrain.Config) -> dtrain.Task:
    opts: LoraOptions = cfg.task
    return dtrain.hf.causal_lm_task(
        build_lora_model(opts),
        train_data=PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0),
        val_data=PatternTokens(opts.val_size, opts.seq_len, opts.vocab, seed=1),
    )
