"""The Hugging Face Accelerate runner of ``benchmarks/peers.py``: the raw loop's model, data and
plan, with Accelerate's ``Accelerator`` preparing the model (DDP on CPU: gloo) and the optimizer
and running backward.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_accelerate.py SCRATCH REPORT_PREFIX

The DataLoader is not prepared: Accelerate would shard it again across the processes, while each
rank already reads its own ids of the shared plan (the same ones dtrain hands it).
"""

from __future__ import annotations

import sys

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

import peer_task as common


def main(scratch: str, prefix: str) -> None:
    accelerator = Accelerator(cpu=True)
    torch.set_num_threads(1)
    spec = common.load_spec(scratch)
    model = common.load_model(scratch)
    optimizer = common.build_optimizer(model.parameters(), spec)
    ddp, optimizer = accelerator.prepare(model, optimizer)
    train, val = common.load_data(scratch)
    plan = common.PlannedBatches(scratch, accelerator.process_index, accelerator.num_processes)
    clock = common.StepClock()
    losses = []
    for inputs, targets in DataLoader(train, batch_sampler=plan):
        loss = common.mean_loss(ddp(inputs), targets)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    common.finish_peer(prefix, clock, losses, accelerator.unwrap_model(ddp), val)
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
