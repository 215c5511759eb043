"""The 60-step GPT-2 job of benchmarks/loc/ written with Hugging Face Accelerate, as its docs
show (``accelerate launch --num_processes 2 benchmarks/loc/accelerate_gpt2.py``). Not run by
the tests: Accelerate is not a dependency of dtrain. Counted by benchmarks/loc/count.py."""

from pathlib import Path

import torch
from accelerate import Accelerator
from examples.hf_gpt2 import GPT2Options, PatternTokens, build_model
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

STEPS, BATCH, LOG_EVERY, SAVE_EVERY, CKPT = 60, 32, 10, 20, "runs/loc-gpt2-accelerate"


def main() -> None:
    accelerator = Accelerator()
    torch.manual_seed(0)
    opts = GPT2Options()
    model = build_model(opts)
    data = PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0)
    loader = DataLoader(data, batch_size=BATCH // accelerator.num_processes, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    schedule = get_cosine_schedule_with_warmup(optimizer, 6, STEPS)
    model, optimizer, loader, schedule = accelerator.prepare(model, optimizer, loader, schedule)
    step = 0
    if Path(CKPT).is_dir():  # resume: model, optimizer, schedule, RNG; the data by skipping
        accelerator.load_state(CKPT)
        step = int(Path(CKPT, "step.txt").read_text())
    while step < STEPS:
        epoch_loader = loader
        if step % len(loader):
            epoch_loader = accelerator.skip_first_batches(loader, step % len(loader))
        for batch in epoch_loader:
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            step += 1
            if step % LOG_EVERY == 0:
                mean = accelerator.reduce(loss.detach(), reduction="mean")
                accelerator.print(f"step {step} loss {mean.item():.4f}")
            if step % SAVE_EVERY == 0 or step == STEPS:
                accelerator.save_state(CKPT)
                if accelerator.is_main_process:
                    Path(CKPT, "step.txt").write_text(str(step))
            if step == STEPS:
                break
    accelerator.end_training()


if __name__ == "__main__":
    main()
