"""The baseline of ``benchmarks/peers.py``: data-parallel training written by hand on torch's
own DistributedDataParallel, as a user writes it without any library -- no checkpoints, no
NaN guard, no exact item counting (every rank holds as many items), no preemption.

    torchrun --standalone --nproc-per-node 2 benchmarks/peer_raw.py SCRATCH REPORT_PREFIX

SCRATCH is the folder ``peers.py`` prepared (the model, weights, data and the per-rank plan);
each rank writes REPORT_PREFIX-rankN.json.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

import peer_task as common


def main(scratch: str, prefix: str) -> None:
    torch.set_num_threads(1)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world_size > 1 else 0
    spec = common.load_spec(scratch)
    model = common.load_model(scratch)
    # One process: no wrapper, nothing to synchronize (dtrain does the same).
    ddp = DistributedDataParallel(model) if world_size > 1 else model
    optimizer = common.build_optimizer(model.parameters(), spec)
    train, val = common.load_data(scratch)
    batches = DataLoader(train, batch_sampler=common.PlannedBatches(scratch, rank, world_size))
    clock = common.StepClock()
    losses = []
    for inputs, targets in batches:
        loss = common.mean_loss(ddp(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    common.finish_peer(prefix, clock, losses, model, val)
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
