"""Where a dtrain step's time goes beside its math, measured inside the loop, against the same
parts of a hand-written loop.

Small torch ops cost several times more inside a training loop than in a tight loop of their
own: after a forward, backward and optimizer step the caches no longer hold torch's dispatch
path. So each part of dtrain's step is timed where it runs, in ``Trainer.fit`` (a timer around
each call: the loader, the split/count/move of the batch, the loss scale, forward and backward,
the NaN guard's norm, the optimizer, the LR schedule, ``zero_grad``, the balancer's clocks, the
watchdog's phase marks, the loss window, the item count against the plan), and the raw loop's
parts the same way (its ``DataLoader``, forward and backward, the optimizer, ``zero_grad``).
What the timers do not cover is the loop's remaining bookkeeping (``rest``).

One process, so no DDP and no communication: what differs is the loops' own work. The model and
optimizer are those of ``benchmarks/peers.py``'s MLP (64-256x3-10, batch 128, AdamW with
foreach kernels, constant LR, no weight decay, no clipping), 1 thread. Rounds alternate the raw
loop and dtrain, each in a fresh process; a part's figure is the median over rounds of its mean
per step after ``--warmup`` steps. A third launch each round runs dtrain without the timers:
its step time is the one to compare with the raw loop's, since in the loop each timer costs
several µs (a part's figure includes some of its own timer; ``rest`` holds the rest of them).

    .venv/bin/python benchmarks/bench_step_parts.py               # prints the table
    .venv/bin/python benchmarks/bench_step_parts.py --write-docs  # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import dtrain
import peer_task
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

from dtrain.config.load import build_config

SECTION = "bench_step_parts"
SAMPLES = 8192
BATCH = 128
LR, BETAS = 1e-3, (0.9, 0.95)


def _data() -> peer_task.Samples:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, 64, generator=generator)
    return peer_task.Samples(inputs, torch.randint(0, 10, (SAMPLES,), generator=generator))


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return peer_task.MLP(64, 256, 3, 10)


def mlp_task(cfg: dtrain.Config) -> dtrain.Task:
    """dtrain's side (``run.task = bench_step_parts:mlp_task``): the same model and data."""
    return dtrain.Task(
        model=_model(), train_data=_data(), loss_fn=peer_task.item_losses, items_per_sample=1
    )


class Parts:
    """Time per named part, counted only while ``on``."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.on = False

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            began = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] = self.spent.get(part, 0.0) + time.perf_counter() - began

        return timed


def raw_round(steps: int, warmup: int) -> dict[str, float]:
    """The hand-written loop, its parts timed; seconds per step."""
    torch.set_num_threads(1)
    model = _model()
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0, foreach=True
    )
    loader = DataLoader(
        _data(),
        batch_size=BATCH,
        shuffle=True,
        drop_last=True,
        generator=torch.Generator().manual_seed(0),
    )

    def batches() -> Iterator[Any]:
        while True:
            yield from loader

    stream = batches()
    spent = {"loader": 0.0, "forward + backward": 0.0, "optimizer step": 0.0, "zero_grad": 0.0}
    began = 0.0
    for step in range(1, steps + 1):
        if step == warmup + 1:
            began = time.perf_counter()
        counted = step > warmup
        t0 = time.perf_counter()
        inputs, targets = next(stream)
        t1 = time.perf_counter()
        peer_task.mean_loss(model(inputs), targets).backward()
        t2 = time.perf_counter()
        optimizer.step()
        t3 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        t4 = time.perf_counter()
        if counted:
            for part, seconds in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spent[part] += seconds
    counted_steps = steps - warmup
    result = {part: seconds / counted_steps for part, seconds in spent.items()}
    result["step"] = (time.perf_counter() - began) / counted_steps
    return result


def instrument(trainer: Any, parts: Parts) -> None:
    """A timer around each of the calls ``Trainer.fit`` makes in a step."""
    import dtrain.data.loader as loader_module
    import dtrain.train.trainer as trainer_module
    from dtrain.metrics.summary import LossWindow
    from dtrain.train.step import ForwardBackward, LossScale

    strategy, balance, watchdog = trainer.strategy, trainer.balance, trainer.watchdog
    # Instances: the calls the trainer makes on its own objects.
    strategy.clip_grad_norm = parts.wrap("NaN guard's norm", strategy.clip_grad_norm)  # type: ignore[method-assign]
    trainer.optimizer.step = parts.wrap("optimizer step", trainer.optimizer.step)  # type: ignore[method-assign]
    trainer.optimizer.zero_grad = parts.wrap("zero_grad", trainer.optimizer.zero_grad)  # type: ignore[method-assign]
    for name in ("step_started", "data_ready", "backward_done", "step_finished"):
        setattr(balance, name, parts.wrap("balancer's clocks", getattr(balance, name)))
    watchdog.set_phase = parts.wrap("watchdog's marks", watchdog.set_phase)  # type: ignore[method-assign]
    trainer.run_log.train = parts.wrap("metrics line", trainer.run_log.train)  # type: ignore[method-assign]
    strategy.after_optimizer_step = parts.wrap(  # type: ignore[method-assign]
        "after the update (strategy)", strategy.after_optimizer_step
    )
    trainer.checkpointer.poll = parts.wrap("checkpoint poll", trainer.checkpointer.poll)  # type: ignore[method-assign]
    # Classes and module functions: what the loop reaches by name or by a dunder method, and
    # the schedule (whose state_dict holds its instance attributes).
    schedule_class = type(trainer.scheduler)
    schedule_class.step = parts.wrap("LR schedule", schedule_class.step)  # type: ignore[method-assign]
    loader_class = type(trainer.loader)
    loader_class.__next__ = parts.wrap("loader", loader_class.__next__)  # type: ignore[method-assign]
    trainer_module.split_to_device = parts.wrap(  # type: ignore[attr-defined]
        "split, count, move", loader_module.split_to_device
    )
    LossScale.__call__ = parts.wrap("loss scale", LossScale.__call__)  # type: ignore[method-assign]
    ForwardBackward.__call__ = parts.wrap("forward + backward", ForwardBackward.__call__)  # type: ignore[method-assign]
    LossWindow.add = parts.wrap("loss window", LossWindow.add)  # type: ignore[method-assign]
    step_batch = loader_module.StepBatch
    step_batch.planned_items = parts.wrap("count against the plan", step_batch.planned_items)  # type: ignore[method-assign]


def dtrain_round(raw: dict[str, Any], warmup: int, timed: bool) -> dict[str, float]:
    """dtrain's loop (``Trainer.fit``), its parts timed when ``timed``; seconds per step."""
    from dtrain.fault.failpoints import failpoints
    from dtrain.train.job import build_job_config, build_trainer

    Path(raw["run"]["dir"]).mkdir(parents=True, exist_ok=True)
    sys.stderr = open(Path(raw["run"]["dir"]) / "progress.log", "w")  # noqa: SIM115
    trainer = build_trainer(build_job_config(raw))
    parts = Parts()
    if timed:
        instrument(trainer, parts)
    marks: dict[int, float] = {}
    last = raw["train"]["steps"]

    def on_step(name: str, **args: Any) -> None:
        # The window runs from step warmup+1's train.step point to the last step's: every
        # part falls into it once per step (the end of one step, the start of the next).
        if name == "train.step" and args["step"] in (warmup + 1, last):
            marks[args["step"]] = time.perf_counter()
            parts.on = args["step"] == warmup + 1

    with failpoints(on_step):
        trainer.fit()
    steps = last - (warmup + 1)
    result = {part: seconds / steps for part, seconds in parts.spent.items()}
    result["step"] = (marks[last] - marks[warmup + 1]) / steps
    return result


def in_process(kind: str, raw: dict[str, Any], steps: int, warmup: int) -> dict[str, float]:
    """Run by ``run_ranks`` in a fresh process (1 rank)."""
    if kind == "raw":
        return raw_round(steps, warmup)
    return dtrain_round(raw, warmup, timed=kind == "dtrain")


def table(rounds: dict[str, list[dict[str, float]]]) -> list[str]:
    def median(kind: str, part: str) -> float:
        return statistics.median(r.get(part, 0.0) for r in rounds[kind])

    parts = [p for p in rounds["dtrain"][0] if p != "step"]
    shared = ["loader", "forward + backward", "optimizer step", "zero_grad"]
    own = [p for p in parts if p not in shared]
    lines = ["  part                          dtrain (us)   raw loop (us)   dtrain - raw (us)"]
    for part in shared:
        d, r = median("dtrain", part), median("raw", part)
        lines.append(f"  {part:28s} {d * 1e6:11.1f} {r * 1e6:15.1f} {(d - r) * 1e6:+19.1f}")
    for part in own:
        d = median("dtrain", part)
        lines.append(f"  {part:28s} {d * 1e6:11.1f} {'-':>15s} {d * 1e6:+19.1f}")
    rest = {
        k: [r["step"] - sum(v for p, v in r.items() if p != "step") for r in rounds[k]]
        for k in ("raw", "dtrain")
    }
    d, r = statistics.median(rest["dtrain"]), statistics.median(rest["raw"])
    lines.append(
        f"  {'rest (the loop itself)':28s} {d * 1e6:11.1f} {r * 1e6:15.1f} {(d - r) * 1e6:+19.1f}"
    )
    d, r = median("dtrain", "step"), median("raw", "step")
    lines.append(
        f"  {'step (timers on)':28s} {d * 1e6:11.1f} {r * 1e6:15.1f} {(d - r) * 1e6:+19.1f}"
    )
    d = median("bare", "step")
    lines.append(
        f"  {'step (no timers)':28s} {d * 1e6:11.1f} {r * 1e6:15.1f} {(d - r) * 1e6:+19.1f}"
    )
    lines.append("")
    for kind, label in (("bare", "no timers"), ("dtrain", "timers on")):
        ratios = [a["step"] / b["step"] for a, b in zip(rounds[kind], rounds["raw"])]
        lines.append(
            f"  step time, dtrain ({label}) / raw loop: {statistics.median(ratios):.3f}x "
            f"(rounds {', '.join(f'{x:.3f}' for x in ratios)})"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="launches of each loop")
    parser.add_argument("--steps", type=int, default=3000, help="steps a launch")
    parser.add_argument("--warmup", type=int, default=200, help="steps left out at the start")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, float]]] = {"raw": [], "dtrain": [], "bare": []}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-step-parts-") as scratch:
        for i in range(args.rounds):
            kinds = ["raw", "bare", "dtrain"]
            for kind in kinds if i % 2 == 0 else kinds[::-1]:
                raw = build_config(
                    {
                        "run": {"dir": f"{scratch}/{kind}{i}", "task": "bench_step_parts:mlp_task"},
                        "data": {"global_batch_size": BATCH},
                        "train": {"steps": args.steps, "grad_clip": 0, "log_every": 10},
                        "optim": {
                            "lr": LR,
                            "betas": list(BETAS),
                            "weight_decay": 0,
                            "warmup_steps": 0,
                            "min_lr_ratio": 1,
                        },
                        "eval": {"every": 0},
                        "checkpoint": {"every": 0},
                        "dist": {"threads": 1},
                    }
                ).to_dict()
                result = run_ranks(in_process, 1, kind, raw, args.steps, args.warmup, timeout=600)
                rounds[kind].append(result[0])
                print(f"round {i} {kind}: {result[0]['step'] * 1e3:.3f} ms/step", flush=True)
    wall = time.perf_counter() - started
    lines = [
        f"One process, 1 thread, the MLP of peers.py (batch {BATCH}, AdamW foreach, no clipping); "
        f"{args.rounds} alternating launches of each loop, {args.steps} steps each, the first "
        f"{args.warmup} left out ({wall:.0f} s); per step, the median over launches:",
        "",
        *table(rounds),
    ]
    print("\n".join(lines))
    if args.write_docs:
        write_report_section(
            SECTION,
            "Where a step's time goes, inside the loop (`bench_step_parts.py`)",
            "\n".join(lines),
            "torch.set_num_threads(1)",
        )


if __name__ == "__main__":
    main()
