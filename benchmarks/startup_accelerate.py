"""The Hugging Face Accelerate side of ``benchmarks/startup.py``: the job of
``dtrain train examples/hf_gpt2.toml --train.steps=60 --eval.every=0``, written as an
Accelerate user writes it -- the same GPT-2 (``examples.hf_gpt2.build_model``), the same data
(``PatternTokens``), AdamW at the same settings, the same global batch and steps, then what
dtrain does at the end of a run: the validation loss, the greedy continuation on rank 0 and the
model saved.

    torchrun --standalone --nproc-per-node 2 benchmarks/startup_accelerate.py OUT STEPS

Rank 0 writes ``OUT/first_step.json``: the wall-clock time (``time.time()``) its first
optimizer step ended, the same moment dtrain's ``first_step`` event records.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from examples.hf_gpt2 import GPT2Options, PatternTokens, build_model, continue_text
from torch.utils.data import DataLoader

GLOBAL_BATCH = 32  # examples/hf_gpt2.toml's data.global_batch_size
LR = 0.003  # its optim.lr (dtrain's default AdamW betas and weight decay below)


def main(out: str, steps: int) -> None:
    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)  # dtrain's default dist.threads on a 2-core machine
    torch.manual_seed(0)
    opts = GPT2Options()
    model = build_model(opts)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    train = PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0)
    val = PatternTokens(opts.val_size, opts.seq_len, opts.vocab, seed=1)
    per_rank = GLOBAL_BATCH // accelerator.num_processes
    loader = DataLoader(train, batch_size=per_rank, shuffle=True, drop_last=True)
    val_loader = DataLoader(val, batch_size=per_rank)
    model, optimizer, loader, val_loader = accelerator.prepare(model, optimizer, loader, val_loader)
    model.train()
    done = 0
    while done < steps:
        for batch in loader:
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
            if done == 1 and accelerator.is_main_process:
                Path(out, "first_step.json").write_text(json.dumps({"time": time.time()}))
            if done == steps:
                break
    model.eval()
    losses = []
    with torch.no_grad():
        for batch in val_loader:
            out_loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            losses.append(accelerator.gather(out_loss.reshape(1)))
    if accelerator.is_main_process:
        print(f"val loss {torch.cat(losses).mean().item():.4f}", flush=True)
        print(continue_text(accelerator.unwrap_model(model), opts), flush=True)
    accelerator.wait_for_everyone()
    accelerator.save_model(model, str(Path(out, "model")))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
