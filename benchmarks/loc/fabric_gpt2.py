"""The 60-step GPT-2 job of benchmarks/loc/ written with Lightning Fabric, as its docs show
(``python benchmarks/loc/fabric_gpt2.py``: Fabric launches its 2 processes). Not run by the
tests: Lightning is not a dependency of dtrain. Counted by benchmarks/loc/count.py."""

import os

import torch
from examples.hf_gpt2 import GPT2Options, PatternTokens, build_model
from lightning.fabric import Fabric
from torch.utils.data import DataLoader
from transformers import get_cosine_schedule_with_warmup

STEPS, BATCH, LOG_EVERY, SAVE_EVERY, CKPT = 60, 32, 10, 20, "runs/loc-gpt2-fabric.ckpt"


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    fabric.seed_everything(0)
    opts = GPT2Options()
    model = build_model(opts)
    data = PatternTokens(opts.train_size, opts.seq_len, opts.vocab, seed=0)
    loader = DataLoader(data, batch_size=BATCH // fabric.world_size, shuffle=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
    schedule = get_cosine_schedule_with_warmup(optimizer, 6, STEPS)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    state = {"model": model, "optimizer": optimizer, "schedule": schedule, "step": 0}
    if os.path.exists(CKPT):  # resume: model, optimizer, schedule; the data by skipping
        fabric.load(CKPT, state)
    while state["step"] < STEPS:
        skip = state["step"] % len(loader)
        for index, batch in enumerate(loader):
            if index < skip:
                continue
            loss = model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            schedule.step()
            optimizer.zero_grad()
            state["step"] += 1
            if state["step"] % LOG_EVERY == 0:
                mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
                fabric.print(f"step {state['step']} loss {mean.item():.4f}")
            if state["step"] % SAVE_EVERY == 0 or state["step"] == STEPS:
                fabric.save(CKPT, state)
            if state["step"] == STEPS:
                break


if __name__ == "__main__":
    main()
