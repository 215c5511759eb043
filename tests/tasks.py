"""Small tasks the tests train: importable by worker processes as ``tests.tasks:<name>``."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.data import Dataset

from dtrain.config import Config
from dtrain.data.text import collate_padded, collate_windows
from dtrain.models.gpt import GPT, GPTConfig
from dtrain.task import IGNORE_INDEX, Task, task_config
from tests.slowdown import SlowdownOptions, slow_down


class RandomTokens(Dataset[np.ndarray]):
    """Deterministic pseudo-text: windows of ``seq_len + 1`` tokens with learnable structure
    (each token is a function of the previous one plus noise)."""

    def __init__(self, num_samples: int, seq_len: int, seed: int = 0, vocab: int = 64) -> None:
        rng = np.random.default_rng(seed)
        data = np.zeros((num_samples, seq_len + 1), dtype=np.int64)
        data[:, 0] = rng.integers(0, vocab, num_samples)
        noise = rng.integers(0, 4, (num_samples, seq_len))
        for t in range(seq_len):
            data[:, t + 1] = (data[:, t] * 7 + 3 + noise[:, t]) % vocab
        self.data = data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.data[index]


class VariableTokens(Dataset[np.ndarray]):
    """Sequences of skewed lengths, for token-balanced batches."""

    def __init__(self, num_samples: int, max_len: int, seed: int = 0, vocab: int = 64) -> None:
        rng = np.random.default_rng(seed)
        lengths = np.minimum(max_len + 1, 2 + rng.pareto(1.2, num_samples) * 8).astype(np.int64)
        self.seqs = [rng.integers(0, vocab, int(n)) for n in lengths]
        self.lengths = lengths - 1

    def __len__(self) -> int:
        return len(self.seqs)

    def __getitem__(self, index: int) -> np.ndarray:
        return self.seqs[index]

    def sample_lengths(self) -> np.ndarray:
        return self.lengths


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(
        logits.reshape(-1, logits.size(-1)),
        targets.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="none",
    )


@dataclass
class TinyOptions(SlowdownOptions):  # slowdown_*: one rank made slower (tests/slowdown.py)
    samples: int = 256
    seq_len: int = 16
    n_layer: int = 2
    d_model: int = 32
    dropout: float = 0.0
    variable: bool = False
    # Fault injection (tests.tasks:failing_gpt): fail at this step on this rank, every attempt.
    fail_at_step: int = 3
    fail_rank: int = 1
    # ... or, when set, kill that rank outright (SIGKILL, as kill -9 or the OOM killer would)
    # in the forward of this step instead of raising.
    kill_at_step: int = 0
    # ... in the first this many attempts of the job only (0: in every attempt), so that a
    # restarted job goes on past the kill.
    kill_attempts: int = 0
    # ... or, when set, ask the allocator for 4 TiB at this step's forward on that rank: an
    # allocation no machine here grants, which fails at once and touches no memory.
    oom_at_step: int = 0
    # Milliseconds each training forward sleeps: slows a run down so that a test can hit it
    # at a chosen moment, without changing any number it computes.
    slow_ms: int = 0
    # Milliseconds each evaluation forward sleeps: an evaluation that lasts long, in many
    # short batches, without changing any number it computes.
    slow_eval_ms: int = 0
    # Task.items_per_sample (0 = None: the ranks count every step's items).
    items_per_sample: int = 0
    # Build the model on the meta device, with GPT.init_weights as Task.init_weights.
    meta_init: bool = False


@task_config(TinyOptions)
def tiny_gpt(cfg: Config) -> Task:
    opts: TinyOptions = cfg.task
    gpt_config = GPTConfig(
        vocab_size=64,
        seq_len=opts.seq_len,
        n_layer=opts.n_layer,
        n_head=2,
        d_model=opts.d_model,
        dropout=opts.dropout,
    )
    with torch.device("meta") if opts.meta_init else contextlib.nullcontext():
        model = GPT(gpt_config)
    if opts.variable:
        train: Dataset[np.ndarray] = VariableTokens(opts.samples, opts.seq_len, seed=1)
        val: Dataset[np.ndarray] = VariableTokens(max(8, opts.samples // 8), opts.seq_len, seed=2)
        collate = collate_padded
    else:
        train = RandomTokens(opts.samples, opts.seq_len, seed=1)
        val = RandomTokens(max(8, opts.samples // 8), opts.seq_len, seed=2)
        collate = collate_windows
    if opts.slow_ms or opts.slow_eval_ms:
        model = _Slow(model, opts.slow_ms, opts.slow_eval_ms)
    slow_down(model, opts)
    return Task(
        model=model,
        train_data=train,
        val_data=val,
        loss_fn=lm_loss,
        collate_fn=collate,
        item_name="tokens",
        items_per_sample=opts.items_per_sample or None,
        init_weights=GPT.init_weights if opts.meta_init else None,
    )


@dataclass
class SlowFinishOptions(TinyOptions):
    # Seconds the after-training hook sleeps, once it has left a file saying it started.
    finish_s: float = 2.0


@task_config(SlowFinishOptions)
def slow_finish_gpt(cfg: Config) -> Task:
    """:func:`tiny_gpt` whose after-training hook (after the final checkpoint) takes a while:
    a signal sent then arrives after the workers' last chance to stop."""
    task = tiny_gpt(cfg)
    seconds = cfg.task.finish_s
    marker = os.path.join(cfg.run.dir, "after-training-started")

    def finish(model: nn.Module) -> str:
        with open(marker, "w") as fh:
            fh.write(f"{os.getpid()}\n")
        time.sleep(seconds)
        return ""

    task.after_training = finish
    return task


class _Slow(nn.Module):
    def __init__(self, inner: nn.Module, ms: int, eval_ms: int = 0) -> None:
        super().__init__()
        self.inner = inner
        self.ms = ms
        self.eval_ms = eval_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ms = self.ms if self.training else self.eval_ms
        if ms:
            time.sleep(ms / 1000)
        return self.inner(x)


class _FailingModel(nn.Module):
    """Raises (or, with ``kill``, dies by SIGKILL) on one rank at a given forward call (= step,
    with one micro-batch and no evaluation in between): a worker that fails every time it is
    started."""

    def __init__(
        self,
        inner: nn.Module,
        rank: int,
        step: int,
        attempts_file: str,
        kill: bool = False,
        oom: bool = False,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.fail = int(os.environ.get("RANK", "0")) == rank
        self.step = step
        self.kill = kill
        self.oom = oom
        self.calls = 0
        if attempts_file:
            with open(attempts_file, "a") as fh:
                fh.write(f"{os.environ.get('RANK')} {os.getpid()}\n")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.fail and self.training and self.calls == self.step:
            if self.kill:  # no exception, no cleanup, no last heartbeat: gone mid-step
                os.kill(os.getpid(), signal.SIGKILL)
            if self.oom:
                return self.inner(x) + torch.empty(2**42, dtype=torch.uint8).sum()
            raise RuntimeError(f"injected failure at step {self.step}")
        return self.inner(x)


def failing_gpt(cfg: Config) -> Task:
    task = tiny_gpt(cfg)
    opts: TinyOptions = cfg.task
    # Counted in a local run folder only (a store's is no place to append to).
    attempts = os.path.join(cfg.run.dir, "attempts.log") if "://" not in cfg.run.dir else ""
    kill, oom = opts.kill_at_step > 0, opts.oom_at_step > 0
    step = opts.kill_at_step if kill else opts.oom_at_step if oom else opts.fail_at_step
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = -1 if opts.kill_attempts and attempt >= opts.kill_attempts else opts.fail_rank
    task.model = _FailingModel(task.model, rank, step, attempts, kill, oom)
    return task


failing_gpt.config_class = TinyOptions  # type: ignore[attr-defined]


class Regression(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int, dim: int = 8, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        w = torch.randn(dim, 1, generator=g)
        self.y = self.x @ w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def mlp_regression(cfg: Config) -> Task:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return Task(
        model=model,
        train_data=Regression(96),
        val_data=Regression(17, seed=1),
        loss_fn=lambda out, y: F.mse_loss(out, y, reduction="none"),
    )


def batchnorm_regression(cfg: Config) -> Task:
    """:func:`mlp_regression` with a BatchNorm: a module with buffers (running statistics and
    a step count), which DDP broadcasts from rank 0 before each training forward."""
    task = mlp_regression(cfg)
    task.model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    return task


# ---------------------------------------------------------------------------------------------
# Fault injection for tests/system/chaos.py (tests.tasks:chaos_gpt). The factory runs inside each
# worker, so it can wrap the model and install fail points (dtrain.fault.failpoints) in that
# worker only.


@dataclass
class ChaosOptions(TinyOptions):
    # The rank that raises (-1: none), and where: in the forward of this training step (just
    # before the step's gradient all-reduce), inside the file writes of this step's save, or
    # in the main thread while the (asynchronous) save of this step is still being written.
    raise_rank: int = -1
    raise_at_step: int = 0
    raise_in_save_step: int = 0
    raise_while_saving_step: int = 0
    # Every checkpoint file write sleeps this long first (-1 = on every rank): widens the
    # window in which a kill lands inside a save.
    save_slow_ms: int = 0
    save_slow_rank: int = -1


def _stamp(run_dir: str, what: str) -> None:
    """Leave the wall-clock time of an injected fault where the chaos script reads it."""
    path = os.path.join(run_dir, f"injected-rank{os.environ.get('RANK', '0')}.txt")
    with open(path, "w") as fh:
        fh.write(f"{time.time()!r} {what}\n")


class _RaiseAtStep(nn.Module):
    """Counts training forwards (one per step: one micro-batch, no evaluation in between) and
    raises at ``step``, or at the first step after ``armed()`` turns true."""

    def __init__(self, inner: nn.Module, run_dir: str, step: int, armed: object = None) -> None:
        super().__init__()
        self.inner = inner
        self.run_dir = run_dir
        self.step = step
        self.armed = armed
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            hit = self.armed() if callable(self.armed) else self.calls == self.step
            if hit:
                _stamp(self.run_dir, f"forward of step {self.calls}")
                raise RuntimeError(f"injected failure in the forward of step {self.calls}")
        return self.inner(x)


@task_config(ChaosOptions)
def chaos_gpt(cfg: Config) -> Task:
    from typing import Any

    from dtrain.fault.failpoints import set_handler

    task = tiny_gpt(cfg)
    opts: ChaosOptions = cfg.task
    rank = int(os.environ.get("RANK", "0"))
    run_dir = cfg.run.dir
    raising = rank == opts.raise_rank
    writing: dict[str, int] = {"active": 0}

    def on_failpoint(name: str, **args: Any) -> None:
        if name != "checkpoint.write_file":
            return
        if opts.save_slow_ms and opts.save_slow_rank in (-1, rank):
            time.sleep(opts.save_slow_ms / 1000)
        step = args["step"]
        if raising and opts.raise_in_save_step and step == opts.raise_in_save_step:
            _stamp(run_dir, f"save of step {opts.raise_in_save_step}")
            raise OSError(f"injected failure writing {args['path'].name}")
        if raising and opts.raise_while_saving_step and step == opts.raise_while_saving_step:
            writing["active"] = 1

    set_handler(on_failpoint)  # for this worker's whole life, in every thread
    if raising and opts.raise_at_step:
        task.model = _RaiseAtStep(task.model, run_dir, opts.raise_at_step)
    elif raising and opts.raise_while_saving_step:
        # The background writer has started on this step's files (and, slowed down, is still
        # at them): the main thread raises at its next forward.
        task.model = _RaiseAtStep(task.model, run_dir, 0, armed=lambda: writing["active"] == 1)
    return task


def mean_loss_gpt(cfg: Config) -> Task:
    """:func:`tiny_gpt` with the usual ``reduction="mean"``: silently wrong math (gradients
    items-times too small) unless the loss contract is checked."""
    task = tiny_gpt(cfg)
    task.loss_fn = lambda logits, targets: F.cross_entropy(
        logits.reshape(-1, logits.size(-1)), targets.reshape(-1)
    )
    return task


mean_loss_gpt.config_class = TinyOptions  # type: ignore[attr-defined]


@dataclass
class MemberKillOptions(TinyOptions):
    # fault.recovery = 'inplace': the member (DTRAIN_INPLACE_MEMBER) whose first incarnation
    # kills itself (SIGKILL) in its training forward number kill_at_forward (1 = its first);
    # -1: none. A restart of it (TORCHELASTIC_RESTART_COUNT > 0) lives on.
    kill_member: int = -1
    kill_at_forward: int = 0
    # ... or in its optimizer update number kill_at_update, just before it: the step's
    # gradient sync is done, so the others commit that step without it.
    kill_at_update: int = 0


@task_config(MemberKillOptions)
def member_kill_gpt(cfg: Config) -> Task:
    """:func:`tiny_gpt` whose member ``kill_member`` dies by SIGKILL in the middle of a step
    (its forward), once; the same parameters and numbers otherwise (its wrapper has none)."""
    task = tiny_gpt(cfg)
    opts: MemberKillOptions = cfg.task
    member = int(os.environ.get("DTRAIN_INPLACE_MEMBER", "-1"))
    first_life = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    armed = opts.kill_member >= 0 and member == opts.kill_member and first_life
    task.model = _KillAtForward(task.model, opts.kill_at_forward if armed else 0)
    if armed and opts.kill_at_update > 0:
        updates = [0]

        def kill_before_update(*_: object) -> None:
            updates[0] += 1
            if updates[0] == opts.kill_at_update:
                os.kill(os.getpid(), signal.SIGKILL)

        register_optimizer_step_pre_hook(kill_before_update)
    return task


class _KillAtForward(nn.Module):
    def __init__(self, inner: nn.Module, at: int) -> None:
        super().__init__()
        self.inner = inner
        self.at = at
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)
