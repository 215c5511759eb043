"""The training loop, and only the loop.

What happens, and where each concern plugs in::

    setup:  strategy.setup(task)                  # wrap the model (ddp, allreduce, fsdp, ...)
            build optimizer, LR schedule, loader   # loader = this rank's share of one stream
            resume(latest valid checkpoint)        # dict of state_dicts -> every component
    loop:   for step in range(start, steps):
              batch  = next(loader)                # micro-batches of (inputs, targets)
              count  = all_reduce(items in batch)  # the global number of loss items
              strategy.forward_backward(batch, scale = dp_size / count)
                                                   # grads = d(global mean loss), synced
              norm   = strategy.clip_grad_norm()   # global norm: the same on every rank
              if norm is not finite: skip step     # NaN guard, agreed by construction
              optimizer.step(); scheduler.step()
              every log_every:   metrics.jsonl + progress
              every eval.every:  evaluate (each val sample exactly once)
              every ckpt.every:  checkpoint (async: the loop waits only for a snapshot)
    end:    evaluate, final checkpoint, summary

The trainer never asks which strategy it runs; everything strategy-specific is behind
:class:`dtrain.parallel.base.Strategy`.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dtrain import __version__
from dtrain.config import Config
from dtrain.data.build import build_train_loader
from dtrain.data.loader import RankLoader, eval_batches, to_device
from dtrain.fault import checkpoint as ckpt
from dtrain.fault.resume import ResumePoint, load_training_state, resolve_resume
from dtrain.fault.rng import rank_seed, rng_state, seed_everything
from dtrain.metrics.sinks import JsonlSink, Progress, format_duration, format_rate
from dtrain.optim import build_optimizer, build_scheduler
from dtrain.parallel.base import Strategy, build_strategy
from dtrain.runtime import Runtime, barrier
from dtrain.task import Task


@dataclass
class Summary:
    steps: int = 0
    start_step: int = 0
    wall_s: float = 0.0
    train_loss: float = float("nan")
    val_loss: float | None = None
    items_per_s: float = 0.0
    items: int = 0
    skipped_steps: int = 0
    checkpoint: str = ""
    generated: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


class Trainer:
    def __init__(
        self, cfg: Config, task: Task, runtime: Runtime, strategy: Strategy | None = None
    ) -> None:
        self.cfg = cfg
        self.task = task
        self.runtime = runtime
        self.run_dir = Path(cfg.run.dir)
        self.strategy = strategy or build_strategy(cfg, runtime)
        self.strategy.setup(task)
        self.optimizer = build_optimizer(self.strategy.named_parameters(), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, cfg.train.steps)
        self.loader: RankLoader = build_train_loader(task, cfg, self.strategy, runtime.device)
        self.step = 0
        self.items_seen = 0
        self.skipped_steps = 0
        self.is_main = runtime.is_main
        self.progress: Progress | None = None
        self.metrics: JsonlSink | None = None
        # Saves coordinate over their own gloo group so that a background save never
        # interleaves with the training collectives of the default group.
        side_group = (
            dist.new_group(backend="gloo", timeout=runtime.timeout)
            if dist.is_initialized()
            else None
        )
        self.checkpointer = ckpt.Checkpointer(
            self.run_dir / "checkpoints",
            rank=runtime.rank,
            world_size=runtime.world_size,
            keep_last=cfg.checkpoint.keep_last,
            keep_every=cfg.checkpoint.keep_every,
            group=side_group,
            log=self.log,
        )

    # -- logging -------------------------------------------------------------------------

    def log(self, text: str) -> None:
        if self.progress is not None:
            self.progress.message(text)
        elif self.is_main:
            print(text, flush=True)

    # -- training state ------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "items_seen": self.items_seen,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.items_seen = int(state["items_seen"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

    def checkpoint_files(self) -> dict[str, Any]:
        """This rank's part of the training state: one file per component."""
        files: dict[str, Any] = {ckpt.rng_file(self.runtime.rank): rng_state()}
        if self.strategy.replicated_state and self.is_main:
            files["model.pt"] = self.strategy.model_state_dict()
            files["optimizer.pt"] = self.strategy.optimizer_state_dict(self.optimizer)
            files["train_state.pt"] = {
                "scheduler": self.scheduler.state_dict(),
                "data": self.loader.state_dict(),
                "trainer": self.state_dict(),
            }
        return files

    def checkpoint_meta(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "world_size": self.runtime.world_size,
            "data_parallel_size": self.strategy.data_parallel_size,
            "strategy": self.cfg.strategy.name,
            "config": self.cfg.to_toml(),
            "dtrain_version": __version__,
            "torch_version": torch.__version__,
            "data": self.loader.state_dict(),
        }

    def save_checkpoint(self, *, blocking: bool) -> None:
        meta = self.checkpoint_meta() if self.is_main else None
        self.checkpointer.save(self.step, self.checkpoint_files(), meta, blocking=blocking)

    def resume(self) -> ResumePoint | None:
        point = resolve_resume(self.cfg, self.run_dir / "checkpoints", self.runtime, self.log)
        if point is None:
            return None
        load_training_state(point, self)
        return point

    # -- the loop ------------------------------------------------------------------------

    def fit(self) -> Summary:
        started = time.perf_counter()
        cfg = self.cfg
        point = self.resume()
        if point is None or not point.rng_restored:
            seed_everything(rank_seed(cfg.run.seed, self.runtime.rank) + self.step)
        start_step = self.step
        summary = Summary(start_step=start_step)
        if self.is_main:
            self.metrics = JsonlSink(self.run_dir / "metrics.jsonl")
            self.progress = Progress(cfg.train.steps, start_step, self.task.item_name, enabled=True)
            where = f"resumed from {point.path.name}" if point else "from scratch"
            self.log(
                f"dtrain: training {self.strategy.name} on {self.runtime.world_size} "
                f"rank(s), {self.runtime.device.type}, {where}; run folder {self.run_dir}"
            )
        window_loss = torch.zeros((), dtype=torch.float64, device=self.runtime.device)
        window_items = 0
        window_start = time.perf_counter()
        window_steps = 0
        last_loss = float("nan")
        dp = self.strategy.data_parallel_size
        model_module = self.strategy.unwrapped
        model_module.train()
        while self.step < cfg.train.steps:
            batch = next(self.loader)
            micro = [to_device(self.task.split_batch(m), self.runtime.device) for m in batch.micro]
            count = torch.tensor(
                sum(self.task.count_items(t) for _, t in micro),
                dtype=torch.float64,
                device=self.runtime.device,
            )
            self.strategy.all_reduce_sum(count)
            scale = (dp / count.clamp(min=1)).to(torch.float32)
            result = self.strategy.forward_backward(micro, self.task.loss_fn, scale)
            grad_norm = self.strategy.clip_grad_norm(cfg.train.grad_clip)
            norm_value = float(grad_norm)
            if math.isfinite(norm_value):
                self.optimizer.step()
            else:
                self.skipped_steps += 1
                self.log(
                    f"warning: step {self.step + 1}: non-finite gradient norm; step skipped "
                    "on every rank"
                )
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.step += 1
            items = int(count.item())
            self.items_seen += items
            window_loss += result.loss_sum.double()
            window_items += items
            window_steps += 1
            error = self.checkpointer.poll()
            if error:
                self.log(f"warning: {error}")
            if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                self.strategy.all_reduce_sum(window_loss)
                elapsed = time.perf_counter() - window_start
                last_loss = float(window_loss) / max(1, window_items)
                rate = window_items / elapsed if elapsed > 0 else 0.0
                self._log_train(last_loss, norm_value, rate, window_steps, elapsed)
                window_loss.zero_()
                window_items, window_steps = 0, 0
                window_start = time.perf_counter()
            if cfg.eval.every and self.step % cfg.eval.every == 0 and self.step < cfg.train.steps:
                self.evaluate(cfg.eval.max_samples)
            if (
                cfg.checkpoint.every
                and self.step % cfg.checkpoint.every == 0
                and self.step < cfg.train.steps
            ):
                self.save_checkpoint(blocking=False)
        summary.val_loss = self.evaluate(cfg.eval.max_samples)
        final_error = self.checkpointer.wait()
        if final_error:
            self.log(f"warning: {final_error}")
        self.save_checkpoint(blocking=True)
        summary.steps = self.step
        summary.train_loss = last_loss
        summary.skipped_steps = self.skipped_steps
        summary.checkpoint = str(self.run_dir / "checkpoints" / ckpt.step_dir_name(self.step))
        summary.wall_s = time.perf_counter() - started
        summary.items = self.items_seen
        if self.progress is not None:
            self.progress.close()
        if self.is_main and self.task.after_training is not None:
            model_module.eval()
            summary.generated = self.task.after_training(model_module)
        self.loader.close()
        if self.metrics is not None:
            self.metrics.write(
                {
                    "kind": "summary",
                    "step": self.step,
                    "wall_s": summary.wall_s,
                    "train_loss": summary.train_loss,
                    "val_loss": summary.val_loss,
                    "skipped_steps": summary.skipped_steps,
                }
            )
            self.metrics.close()
        barrier()
        return summary

    def _log_train(
        self, loss: float, grad_norm: float, rate: float, steps: int, elapsed: float
    ) -> None:
        if not self.is_main:
            return
        record = {
            "kind": "train",
            "step": self.step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            f"{self.task.item_name}_per_s": rate,
            "step_time_s": elapsed / max(1, steps),
            "epoch": self.loader.epoch(),
            "items_seen": self.items_seen,
            "skipped_steps": self.skipped_steps,
            "param_bytes_rank0": self.strategy.parameter_bytes(),
            "time": time.time(),
        }
        assert self.metrics is not None and self.progress is not None
        self.metrics.write(record)
        self.progress.update(self.step, loss, rate)

    @torch.no_grad()
    def evaluate(self, max_samples: int = 0) -> float | None:
        """Mean validation loss; every sample of the set (or of its first ``max_samples``)
        counted exactly once across ranks."""
        if self.task.val_data is None:
            return None
        module = self.strategy.unwrapped
        module.eval()
        totals = torch.zeros(2, dtype=torch.float64, device=self.runtime.device)
        for batch in eval_batches(
            self.task.val_data,
            self.strategy.data_parallel_rank,
            self.strategy.data_parallel_size,
            self.cfg.eval.batch_size,
            self.task.collate_fn,
            max_samples,
        ):
            inputs, targets = to_device(self.task.split_batch(batch), self.runtime.device)
            totals[0] += self.strategy.eval_loss((inputs, targets), self.task.loss_fn).double()
            totals[1] += self.task.count_items(targets)
        self.strategy.all_reduce_sum(totals)
        module.train()
        val_loss = float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")
        if self.is_main:
            assert self.metrics is not None
            self.metrics.write(
                {
                    "kind": "eval",
                    "step": self.step,
                    "val_loss": val_loss,
                    "val_items": int(totals[1]),
                    "time": time.time(),
                }
            )
            self.log(
                f"step {self.step}: val_loss {val_loss:.4f} over {int(totals[1])} "
                f"{self.task.item_name}"
            )
        return val_loss


def print_summary(summary: Summary, item_name: str, world_size: int) -> None:
    rate = summary.items / summary.wall_s if summary.wall_s > 0 else 0.0
    val = f"{summary.val_loss:.4f}" if summary.val_loss is not None else "n/a"
    lines = [
        "",
        f"done: {summary.steps} steps ({summary.steps - summary.start_step} this run) on "
        f"{world_size} rank(s) in {format_duration(summary.wall_s)}",
        f"  train loss {summary.train_loss:.4f}   val loss {val}   "
        f"{format_rate(rate)} {item_name}/s overall",
    ]
    if summary.skipped_steps:
        lines.append(f"  skipped steps (non-finite gradients): {summary.skipped_steps}")
    lines.append(f"  checkpoint {summary.checkpoint}")
    if summary.generated:
        lines += ["", summary.generated]
    print("\n".join(lines), flush=True)


def default_run_dir() -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    stamp = run_id if run_id and run_id != "none" else time.strftime("%Y%m%d-%H%M%S")
    return str(Path("runs") / stamp)
