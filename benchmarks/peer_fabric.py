"""The Lightning Fabric runner of ``benchmarks/peers.py``: the raw loop's model, data and plan,
with Fabric setting up the model (its ``ddp`` strategy on CPU: gloo) and the optimizer and
running backward.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_fabric.py SCRATCH REPORT_PREFIX

Under torchrun Fabric joins the launcher's processes instead of starting its own. The
DataLoader is not set up through Fabric (which would add a DistributedSampler): each rank
already reads its own ids of the shared plan (the same ones dtrain hands it).
"""

from __future__ import annotations

import os
import sys

import torch
from lightning.fabric import Fabric
from torch.utils.data import DataLoader

import peer_task as common


def main(scratch: str, prefix: str) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = "ddp" if world_size > 1 else "auto"
    fabric = Fabric(accelerator="cpu", devices=world_size, strategy=strategy, precision="32-true")
    fabric.launch()
    torch.set_num_threads(1)
    spec = common.load_spec(scratch)
    model = common.load_model(scratch)
    optimizer = common.build_optimizer(model.parameters(), spec)
    ddp, optimizer = fabric.setup(model, optimizer)
    train, val = common.load_data(scratch)
    plan = common.PlannedBatches(scratch, fabric.global_rank, fabric.world_size)
    clock = common.StepClock()
    losses = []
    for inputs, targets in DataLoader(train, batch_sampler=plan):
        loss = common.mean_loss(ddp(inputs), targets)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    common.finish_peer(prefix, clock, losses, model, val)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
