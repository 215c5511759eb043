"""A Hugging Face ``transformers`` GPT-2, as it comes, in a loop of your own: dtrain wraps it for
the run's strategy and streams its data; the loss is Hugging Face's shifted causal-LM loss, per
token, so the step's gradient is the mean over every token of the global batch (padding
excluded) whatever each rank holds (docs/own-loop.md).

Run it from the repository root (``pip install -e '.[hf]'``); the model's sizes and data are
``examples/hf_gpt2.toml``'s ``[task]`` (``run.task = "examples.hf_gpt2:build"``, whose loop this
replaces), or ``hf_gpt2.GPT2Options``'s defaults under a config that names another task::

    dtrain train examples/hf_gpt2.toml --run.script=examples/own_loop_hf.py --nproc 2 \
        --run.dir=runs/own-loop-hf
    torchrun --nproc-per-node 2 -m examples.own_loop_hf examples/hf_gpt2.toml --run.dir=...
    python -m examples.own_loop_hf examples/hf_gpt2.toml --train.steps=50 --run.dir=...

(a run folder of its own: ``hf_gpt2.toml``'s is dtrain's loop's, which it would resume). On 2
ranks under ddp, fsdp and tensor (``--strategy.name=tensor``: GPT-2's attention cut by head)
it equals one process within 1e-5
(``tests/test_hf.py::test_the_hf_gpt2_own_loop_equals_one_process_under_ddp_fsdp_and_tensor``).
"""

from __future__ import annotations

import dtrain
from dtrain.hf import causal_lm_loss, count_causal_lm_items, split_causal_lm_batch
from examples.hf_gpt2 import GPT2Options, PatternTokens, build_model


def main(run: dtrain.Run) -> None:
    opts = run.config.task if isinstance(run.config.task, GPT2Options) else GPT2Options()
    model = build_model(opts)  # GPT2LMHeadModel(GPT2Config(...)): nothing downloaded
    model.config.use_cache = False  # training keeps no key/value cache
    model, _optimizer = run.prepare(
        model,
        PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0),  # {"input_ids": ...}
        split_batch=split_causal_lm_batch,  # (input_ids, labels = input_ids)
        count_items=count_causal_lm_items,  # the tokens the shifted loss counts
        item_name="tokens",
    )
    for batch in run.batches():
        for input_ids, labels in batch:
            run.backward(causal_lm_loss(model(input_ids), labels))  # per token
        if run.step():
            break


if __name__ == "__main__":
    dtrain.run_main(main)
