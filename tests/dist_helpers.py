"""Functions that run inside the ranks started by :func:`tests.ranks.run_ranks`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dtrain.fault.failpoints import failpoints
from dtrain.train.job import build_job_config, build_trainer
from dtrain.train.trainer import Trainer


def make_trainer(raw: dict[str, Any]) -> Trainer:
    return build_trainer(build_job_config(raw))


def synced_backward(strategy: Any, micro: list[Any], loss_fn: Any, scale: Any) -> Any:
    """Forward and backward over ``micro`` with the gradients synchronized, as a step runs
    them, without the step's agreement (what a test of a strategy's gradients wants: no
    bytes but the gradients'); returns the loss sum."""
    from dtrain.train.step import run_micro_batches

    if not getattr(strategy, "_test_warmed_up", False):
        strategy._test_warmed_up = True
        strategy.before_first_step(micro[0], loss_fn)
    loss_sum = run_micro_batches(strategy, micro, loss_fn, scale)
    strategy.sync_gradients()
    return loss_sum


def train_params(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    """Train with this config; return the final parameters as NumPy arrays."""
    trainer = make_trainer(raw)
    trainer.fit()
    return {
        k: v.detach().cpu().numpy().copy() for k, v in trainer.strategy.model_state_dict().items()
    }


def train_losses(raw: dict[str, Any]) -> list[float]:
    trainer = make_trainer(raw)
    trainer.fit()
    import json
    from pathlib import Path

    lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]


# ---------------------------------------------------------------------------------------------
# Fault injection inside the ranks (through the fail points of dtrain.fault.failpoints)


def params_of(trainer: Trainer) -> dict[str, np.ndarray]:
    return {
        k: v.detach().cpu().numpy().copy() for k, v in trainer.strategy.model_state_dict().items()
    }


def losses_by_step(run_dir: str) -> dict[int, float]:
    """The last logged training loss of every step (a resumed run overwrites earlier ones)."""
    import json
    from pathlib import Path

    out: dict[int, float] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            out[record["step"]] = record["loss"]
    return out


class _Injected(RuntimeError):
    pass


def crash_then_resume(
    raw: dict[str, Any], crash_step: int, resume_raw: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Raise on every rank at the start of ``crash_step``, then resume in a fresh trainer from
    the newest checkpoint (with ``resume_raw``'s config when given) and finish. Returns the
    final parameters, the step it resumed from, the resumed optimizer's kernels (each
    group's ``foreach`` and ``fused``) and its groups' settings (all but their parameters)."""
    trainer = make_trainer(raw)

    def crash(name: str, **args: Any) -> None:
        if name == "train.step" and args["step"] == crash_step:
            raise _Injected(f"injected crash at step {crash_step}")

    with failpoints(crash):
        try:
            trainer.fit()
        except _Injected:
            pass
        trainer.checkpointer.wait()
    resumed = make_trainer(resume_raw or raw)
    summary = resumed.fit()
    groups = resumed.optimizer.param_groups
    kernels = [(group["foreach"], group["fused"]) for group in groups]
    settings = [{k: v for k, v in group.items() if k != "params"} for group in groups]
    return {
        "params": params_of(resumed),
        "start_step": summary.start_step,
        "kernels": kernels,
        "settings": settings,
    }


def two_jobs_then_crash(
    earlier: dict[str, Any], this: dict[str, Any], crash_step: int
) -> dict[str, Any]:
    """An earlier job trains ``earlier``; then this job (another job id) trains ``this``,
    crashing at ``crash_step`` and resuming in a fresh trainer (a restart of the same job).
    Returns the checkpoints the earlier job left and :func:`crash_then_resume`'s result."""
    import os

    import torch.distributed as dist

    from dtrain.checkpoint.hold import JOB_ID_ENV
    from dtrain.checkpoint.layout import committed_steps

    os.environ[JOB_ID_ENV] = "earlier"
    make_trainer(earlier).fit()
    dist.barrier()
    left = committed_steps(Path(earlier["run"]["dir"]) / "checkpoints")
    os.environ[JOB_ID_ENV] = "this"
    return {"left": left, **crash_then_resume(this, crash_step)}


class RecordingLoader:
    """Forwards to a RankLoader and remembers the last step handed out."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.last: Any = None

    def __next__(self) -> Any:
        self.last = next(self.inner)
        return self.last

    def __iter__(self) -> RecordingLoader:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def train_with_nan(raw: dict[str, Any], bad_starts: list[int], bad_rank: int) -> dict[str, Any]:
    """The loss is NaN on ``bad_rank`` for the steps whose stream position starts at one of
    ``bad_starts`` (a bad batch: it stays bad if it comes again)."""
    import torch
    import torch.distributed as dist

    trainer = make_trainer(raw)
    recorder = RecordingLoader(trainer.loader)
    trainer.loader = recorder  # type: ignore[assignment]
    loss_fn = trainer.task.loss_fn
    rank = dist.get_rank() if dist.is_initialized() else 0

    def poisoned(output: Any, targets: Any) -> Any:
        losses = loss_fn(output, targets)
        if rank == bad_rank and recorder.last.plan.start in bad_starts:
            return losses * torch.tensor(float("nan"))
        return losses

    trainer.task.loss_fn = poisoned
    try:
        summary = trainer.fit()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "params": params_of(trainer),
        "skipped": summary.skipped_steps,
        "rollbacks": summary.rollbacks,
        "steps": summary.steps,
    }


def signal_self_at_step(
    raw: dict[str, Any], rank_to_signal: int, step: int, signame: str
) -> dict[str, Any]:
    """Send ``signame`` to this process on one rank when it starts ``step``; return what the
    trainer did, and how long the other ranks took to give up (for hang tests)."""
    import os
    import signal
    import time

    import torch.distributed as dist

    trainer = make_trainer(raw)
    me = dist.get_rank() if dist.is_initialized() else 0
    fired: dict[str, float] = {}

    def signal_at_step(name: str, **args: Any) -> None:
        if name == "train.step" and args["step"] == step:
            fired["t"] = time.time()
            if me == rank_to_signal:
                (trainer.run_dir / f"pid-rank{me}").write_text(str(os.getpid()))
                os.kill(os.getpid(), getattr(signal, signame))

    try:
        with failpoints(signal_at_step):
            summary = trainer.fit()
    except Exception as exc:
        seconds = time.time() - fired["t"]
        stopped = trainer.run_dir / f"pid-rank{rank_to_signal}"
        if signame == "SIGSTOP" and stopped.exists():  # end the stopped peer, as a launcher would
            os.kill(int(stopped.read_text()), signal.SIGKILL)
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": seconds}
    return {"preempted": summary.preempted, "steps": summary.steps, "params": params_of(trainer)}


def raise_before_collective(raw: dict[str, Any], bad_rank: int, step: int) -> dict[str, Any]:
    """``bad_rank`` raises just before the step's first collective; the others must fail fast
    naming it."""
    import time

    import torch.distributed as dist

    trainer = make_trainer(raw)
    me = dist.get_rank()
    started = time.time()

    def raise_at_step(name: str, **args: Any) -> None:
        if name == "train.before_collective" and args["step"] == step and me == bad_rank:
            raise ValueError("injected failure before a collective")

    try:
        with failpoints(raise_at_step):
            trainer.fit()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.time() - started}
    return {"error": None}


def save_and_full_state(raw: dict[str, Any]) -> dict[str, np.ndarray]:
    """Train (saving checkpoints as configured) and return the full model state."""
    trainer = make_trainer(raw)
    trainer.fit()
    state = trainer.strategy.model_state_dict()
    return {k: v.detach().cpu().numpy().copy() for k, v in state.items()}


def load_full_state(raw: dict[str, Any]) -> dict[str, Any]:
    """Resume from the run folder's newest checkpoint without training; full state + step."""
    trainer = make_trainer(raw)
    point = trainer.resume()
    assert point is not None
    state = trainer.strategy.model_state_dict()
    # The optimizer's state in the strategy's own form: whole, or this rank's shards.
    optim = trainer.strategy.state_dicts(trainer.optimizer)["optimizer"].state
    steps = sorted({float(v["step"]) for v in optim["state"].values()})
    return {
        "params": {k: v.detach().cpu().numpy().copy() for k, v in state.items()},
        "step": trainer.step,
        "optimizer_steps": steps,
        "consumed": trainer.loader.consumed,
    }


def threads_left_by_worker_train(raw: dict[str, Any]) -> list[str]:
    """Run ``dtrain.worker.train`` (as a worker process does) and list the ``dtrain-*`` threads
    still alive when it has returned."""
    import threading

    from dtrain.worker import train

    train(build_job_config(raw))
    return [t.name for t in threading.enumerate() if t.name.startswith("dtrain-") and t.is_alive()]


def fail_commit_then_preempt(raw: dict[str, Any], step: int) -> dict[str, Any]:
    """Rank 0's commit of checkpoint ``step`` fails (after every rank wrote its files), and
    rank 0 alone is then asked to stop, just before the next step's first collective."""
    import os
    import signal

    import torch.distributed as dist

    trainer = make_trainer(raw)
    me = dist.get_rank()
    failed: list[int] = []

    def inject(name: str, **args: Any) -> None:
        if me != 0:
            return
        if name == "checkpoint.before_marker" and args["step"] == step and not failed:
            failed.append(step)  # once: the final save of the same step must go through
            raise OSError("injected failure before the marker")
        if name == "train.before_collective" and args["step"] == step + 1:
            thread = trainer.checkpointer._thread
            if thread is not None:
                thread.join()  # the failed commit is over before the stop is asked for
            os.kill(os.getpid(), signal.SIGTERM)

    try:
        with failpoints(inject):
            summary = trainer.fit()
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"preempted": summary.preempted, "steps": summary.steps, "params": params_of(trainer)}


def fit_summary(raw: dict[str, Any]) -> dict[str, Any]:
    """Train with this config; the run's summary as a dict."""
    import dataclasses

    return dataclasses.asdict(make_trainer(raw).fit())


def damage_then_resume_slowly(
    raw: dict[str, Any], longer: dict[str, Any], slow_rank: int, seconds_per_piece: float
) -> dict[str, Any]:
    """Train ``raw``, hashing checkpoint files in pieces of 8 KiB (so that a tiny model's files
    are many pieces, as a large model's are); rank 0 then damages a piece of the newest
    checkpoint's ``optimizer.pt`` that rank 1 verifies; then train ``longer``, resuming, as
    :func:`resume_verifying_slowly` does. Returns what that returns, and the damaged piece."""
    import torch.distributed as dist

    from dtrain.checkpoint import layout
    from dtrain.checkpoint.read import find_latest_valid, read_marker
    from dtrain.checkpoint.verify import assign

    layout.PIECE_BYTES = 8192
    make_trainer(raw).fit()
    dist.barrier()
    newest = find_latest_valid(Path(raw["run"]["dir"]) / "checkpoints")[0]
    assert newest is not None
    theirs = [p for p in assign(read_marker(newest), 2)[1] if p.name == "optimizer.pt"]
    victim = theirs[len(theirs) // 2]
    if dist.get_rank() == 0:
        with open(newest / victim.name, "r+b") as fh:
            fh.seek(victim.start + 5)
            byte = fh.read(1)
            fh.seek(victim.start + 5)
            fh.write(bytes([byte[0] ^ 0x40]))
    dist.barrier()
    return {**resume_verifying_slowly(longer, slow_rank, seconds_per_piece), "victim": victim}


def resume_verifying_slowly(
    raw: dict[str, Any], slow_rank: int, seconds_per_piece: float
) -> dict[str, Any]:
    """Train, resuming from the run folder's newest checkpoint, while ``slow_rank`` takes
    ``seconds_per_piece`` longer for every piece it verifies: a verification as long as a large
    checkpoint's, made of many short pieces. Returns the summary, the pieces this rank
    verified (file, index), how long its verification took, and what rank 0 logged."""
    import dataclasses
    import time

    import torch.distributed as dist

    me = dist.get_rank()
    verified: list[tuple[str, int]] = []
    spent = [0.0]

    def slow(name: str, **args: Any) -> None:
        if name == "checkpoint.verify_piece":
            started = time.perf_counter()
            verified.append((f"{args['path'].parent.name}/{args['path'].name}", args["index"]))
            if me == slow_rank:
                time.sleep(seconds_per_piece)
            spent[0] += time.perf_counter() - started

    trainer = make_trainer(raw)
    logged: list[str] = []
    log = trainer.log
    trainer.log = lambda text: (logged.append(text), log(text))[-1]  # type: ignore[method-assign]
    with failpoints(slow):
        summary = dataclasses.asdict(trainer.fit())
    return {"summary": summary, "verified": verified, "slept": spent[0], "logged": logged}
