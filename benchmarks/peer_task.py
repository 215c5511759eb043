"""What every runner of ``benchmarks/peers.py`` shares, so that all of them train the same thing.

``peers.py`` (the parent) writes a scratch folder once per model; every runner reads it:

    spec.json     the model, the optimizer, steps, global batch, world size
    data.pt       the training and validation samples, in memory (inputs, targets)
    init.pt       the initial weights: one state dict, loaded by every runner
    plan-wN.pt    the sample ids of every (step, rank) at N ranks: dtrain's own partition of
                  its seeded global stream (dtrain.data.partition), which the other runners
                  follow by an explicit batch sampler

A runner reports, per rank, the end time of every optimizer step (a global post-hook on
``torch.optim.Optimizer.step``, the same measure for every runner) and its peak resident memory
(``ru_maxrss``); the raw loop, Accelerate and Fabric also report the loss of every step and the
final validation loss, which dtrain writes into its ``metrics.jsonl``.

dtrain's side is :func:`build`, an ordinary task factory (``--run.task=peer_task:build``) over an
ordinary map-style ``Dataset``, as a user writes one.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import resource
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.data import Dataset, Sampler, default_collate

import dtrain
from dtrain.models.gpt import GPT, GPTConfig

SPEC = "spec.json"
DATA = "data.pt"
INIT = "init.pt"


def plan_file(world_size: int) -> str:
    return f"plan-w{world_size}.pt"


def load_spec(scratch: str | Path) -> dict[str, Any]:
    return json.loads((Path(scratch) / SPEC).read_text())


# -- the models ----------------------------------------------------------------------------


class MLP(nn.Module):
    """A small classifier: ``depth`` hidden layers of ``width`` with GELU."""

    def __init__(self, inputs: int, width: int, depth: int, classes: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        size = inputs
        for _ in range(depth):
            layers += [nn.Linear(size, width), nn.GELU()]
            size = width
        layers.append(nn.Linear(size, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class Block(nn.Module):
    """One pre-norm transformer block of :class:`ByteGPT`: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ByteGPT(nn.Module):
    """The README's own-model task: a byte-level GPT as a user writes it for themselves (not
    dtrain's :class:`~dtrain.models.gpt.GPT`), returning logits."""

    def __init__(self, seq_len: int, n_layer: int, n_head: int, d_model: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(256, d_model)
        self.positions = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, 256, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.tokens(x) + self.positions(torch.arange(x.size(1), device=x.device))
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model, with random weights (every runner then loads ``init.pt``)."""
    model = spec["model"]
    if model["kind"] == "gpt":
        return GPT(GPTConfig(**model["gpt"]))
    if model["kind"] == "readme":
        return ByteGPT(**model["gpt"])
    return MLP(model["inputs"], model["width"], model["depth"], model["classes"])


def load_model(scratch: str | Path) -> nn.Module:
    """The model with the weights every runner starts from."""
    model = build_model(load_spec(scratch))
    model.load_state_dict(torch.load(Path(scratch) / INIT, weights_only=True))
    return model


def build_optimizer(params: Any, spec: dict[str, Any]) -> torch.optim.Optimizer:
    """The optimizer of the raw loop, Accelerate and Fabric: what dtrain builds from the config
    ``peers.py`` gives it (AdamW with foreach kernels, no weight decay, constant LR)."""
    optim = spec["optim"]
    return torch.optim.AdamW(
        params, lr=optim["lr"], betas=tuple(optim["betas"]), weight_decay=0.0, foreach=True
    )


# -- the data --------------------------------------------------------------------------------


class Samples(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """An ordinary map-style dataset over tensors in memory: one ``(input, target)`` a call."""

    def __init__(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.inputs = inputs
        self.targets = targets

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.targets[index]


class Windows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """The README task's map-style dataset: fixed-length windows of a byte stream, each sample
    a view ``(stream[s : s + T], stream[s + 1 : s + T + 1])`` as a user writes it."""

    def __init__(self, stream: torch.Tensor, seq_len: int) -> None:
        self.stream = stream
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.stream) - 1) // self.seq_len

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.seq_len
        return (
            self.stream[start : start + self.seq_len],
            self.stream[start + 1 : start + self.seq_len + 1],
        )


def load_data(scratch: str | Path) -> tuple[Dataset[Any], Dataset[Any]]:
    data = torch.load(Path(scratch) / DATA, weights_only=True)
    if "train_stream" in data:
        seq_len = load_spec(scratch)["model"]["gpt"]["seq_len"]
        return Windows(data["train_stream"], seq_len), Windows(data["val_stream"], seq_len)
    return Samples(data["train_x"], data["train_y"]), Samples(data["val_x"], data["val_y"])


class PlannedBatches(Sampler[list[int]]):
    """This rank's sample ids, step by step, from the plan ``peers.py`` wrote (dtrain's
    partition): a ``batch_sampler`` for a torch ``DataLoader``."""

    def __init__(self, scratch: str | Path, rank: int, world_size: int) -> None:
        plan = torch.load(Path(scratch) / plan_file(world_size), weights_only=True)
        self.ids: torch.Tensor = plan[:, rank]  # (steps, per-rank batch)

    def __iter__(self) -> Iterator[list[int]]:
        for row in self.ids:
            yield row.tolist()

    def __len__(self) -> int:
        return len(self.ids)


def item_losses(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-item cross entropy, unreduced (dtrain's loss contract): per token for the GPT, per
    sample for the MLP."""
    return F.cross_entropy(
        output.reshape(-1, output.size(-1)), targets.reshape(-1), reduction="none"
    )


def mean_loss(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The loss a hand-written loop takes: the mean over this rank's items (DDP's averaging
    then gives the global mean, every rank holding as many items)."""
    return F.cross_entropy(output.reshape(-1, output.size(-1)), targets.reshape(-1))


@torch.no_grad()
def validation_loss(model: nn.Module, val: Dataset[Any], batch_size: int = 64) -> float:
    """Mean per-item loss over the whole validation set (as dtrain's final evaluation)."""
    model.eval()
    total, items = 0.0, 0
    size = len(val)  # type: ignore[arg-type]
    for begin in range(0, size, batch_size):
        x, y = default_collate([val[i] for i in range(begin, min(begin + batch_size, size))])
        losses = item_losses(model(x), y)
        total += float(losses.double().sum())
        items += losses.numel()
    model.train()
    return total / items


# -- what a rank reports ---------------------------------------------------------------------


class StepClock:
    """The end time of every optimizer step of this process: a global post-hook on
    ``Optimizer.step``, so every runner is timed at the same point whatever wraps its
    optimizer."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []  # this process's CPU time (all threads) at each end
        self._handle = register_optimizer_step_post_hook(self._tick)

    def _tick(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.ends.append(time.perf_counter())
        self.cpu_ends.append(time.process_time())


def peak_rss_kib() -> int:
    """This process's peak resident memory (``ru_maxrss``, KiB on Linux)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def write_report(path: str | Path, record: dict[str, Any]) -> None:
    record = {**record, "pid": os.getpid(), "peak_rss_kib": peak_rss_kib()}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


def report_path(prefix: str | Path, rank: int) -> Path:
    return Path(f"{prefix}-rank{rank}.json")


def finish_peer(
    prefix: str,
    clock: StepClock,
    losses: Sequence[torch.Tensor],
    model: nn.Module,
    val: Dataset[Any],
) -> None:
    """The end of a peer runner (raw, Accelerate, Fabric): every step's global loss (one
    all-reduce of all steps' losses, after training, so the loop itself has no extra sync),
    the final validation loss on rank 0, and every rank's report."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    step_losses = torch.stack([loss.double() for loss in losses])
    if world > 1:
        dist.all_reduce(step_losses)
    record: dict[str, Any] = {"rank": rank, "step_ends": clock.ends, "cpu_ends": clock.cpu_ends}
    if rank == 0:
        record["step_losses"] = (step_losses / world).tolist()
        record["val_loss"] = validation_loss(model, val)
    write_report(report_path(prefix, rank), record)


# -- dtrain's task ---------------------------------------------------------------------------


@dataclass
class PeerTaskConfig:
    scratch: str = ""  # the folder peers.py wrote
    # Declare Task.items_per_sample (a window's tokens, one label); the README's task does not.
    declare_items: bool = False


@dtrain.task_config(PeerTaskConfig)
def build(cfg: dtrain.Config) -> dtrain.Task:
    """The task dtrain trains in ``peers.py``: the same model, weights and data as the other
    runners. Each rank writes its report (step end times, peak memory) into the run folder
    when its process exits."""
    scratch = cfg.task.scratch
    train, val = load_data(scratch)
    clock = StepClock()
    rank = int(os.environ.get("RANK", "0"))
    prefix = Path(cfg.run.dir) / "peer"
    atexit.register(lambda: write_report(report_path(prefix, rank), _dtrain_record(rank, clock)))
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = item_losses
    spec = load_spec(scratch)
    per_sample = spec["model"]["gpt"]["seq_len"] if "gpt" in spec["model"] else 1
    return dtrain.Task(
        model=load_model(scratch),
        train_data=train,
        val_data=val,
        loss_fn=loss_fn,
        items_per_sample=per_sample if cfg.task.declare_items else None,
    )


def _dtrain_record(rank: int, clock: StepClock) -> dict[str, Any]:
    return {"rank": rank, "step_ends": clock.ends, "cpu_ends": clock.cpu_ends}


def median_step_s(ends: Sequence[float], warmup: int) -> float:
    """Median time between consecutive step ends, leaving out the first ``warmup`` steps."""
    gaps = sorted(b - a for a, b in zip(ends[warmup:], ends[warmup + 1 :]))
    if not gaps:
        return math.nan
    middle = len(gaps) // 2
    return gaps[middle] if len(gaps) % 2 else (gaps[middle - 1] + gaps[middle]) / 2
