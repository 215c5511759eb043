"""Fault injection at scale: the trials of issue 4, many times each, through the real CLI.

Every trial starts ``python -m dtrain train CONFIG --nproc N ...`` from the repository root (the
elastic agent and real worker processes, gloo on loopback, CPU), injects one fault, and checks
what the user would see: exit codes, log lines, timings, the checkpoints left behind, and the
final parameters and sample ids against an uninterrupted run of the same job.

    python benchmarks/chaos.py                 # every trial, the issue's counts (about an hour)
    python benchmarks/chaos.py --quick         # one trial of each kind (a few minutes)
    python benchmarks/chaos.py --trials kill9,sigstop --count 3

Trials (``--trials``; default counts in brackets):

  kill9            [20] kill -9 of one of 4 workers at a random step, --max-restarts 3: exit 0,
                        parameters bit-identical to the uninterrupted run, every sample once
  always_fails     [5]  a worker that fails every time, --max-restarts 2: exactly 3 attempts,
                        non-zero exit, the error names the rank, no process left after 10 s
  sigstop          [10] SIGSTOP of one of 4 workers, dist.timeout_s = 5: every other rank raises
                        naming it within 10 s; the launcher exits (not stuck)
  raise_collective [5]  rank 0 raises in the forward, just before the gradient all-reduce: every
                        rank exits within 2 x the timeout
  raise_save       [6]  rank 0 raises during a save (in its file writes with synchronous saves;
                        in the main thread while its background save is being written with
                        asynchronous ones): every rank exits within 2 x the timeout, nothing
                        committed for that step
  kill_in_save     [50] kill -9 (of one worker, or of the launcher and every worker) at a random
                        moment inside a save; the next start resumes from the newest committed
                        step, removes every leftover, and ends bit-identical
  corrupt          [30] the newest checkpoint truncated, zero-filled, bit-flipped or a file
                        deleted (rotating through the modes and files): detected, named, resumed
                        from the previous checkpoint, ends bit-identical
  sigterm          [5]  SIGTERM to the launcher at a random step: saved, exit 0 within the grace;
                        the resumed run bit-identical
  resize           [6]  SIGTERM at a random step, resume at another world size (4->2, 2->4, 2->3):
                        the same global batches, every sample exactly once

The table printed at the end is also written into docs/benchmarks.md (section "chaos").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from _fault_common import (
    Launch,
    machine_line,
    median,
    metrics_step,
    pid_alive,
    processes_of,
    rank_of,
    wait_for_step,
    wait_gone,
    write_config,
    write_docs_section,
)
from dtrain.fault import checkpoint as ckpt
from dtrain.fault.audit import check_stream, read_trajectory

SAMPLES = 64  # 8 steps per epoch at a global batch of 8: a 20-step run crosses two epochs
STEPS = 20
STARTED = r"dtrain: training \w+ on (\d+) rank\(s\)"


def sections(
    task: str = "tests.tasks:tiny_gpt",
    *,
    steps: int = STEPS,
    every: int = 4,
    timeout_s: float = 20.0,
    grace_s: float = 30.0,
    async_save: bool = True,
    **task_options: object,
) -> dict[str, dict[str, object]]:
    """The tiny job of the launcher tests: a 2-layer GPT, 64 samples, 20 AdamW steps, each
    training forward slowed by 40 ms so that a random step is a meaningful kill point."""
    return {
        "run": {"task": task},
        "data": {"global_batch_size": 8},
        "train": {"steps": steps, "log_every": 1},
        "eval": {"every": 0},
        "checkpoint": {"every": every, "async_save": async_save},
        "optim": {"name": "adamw", "lr": 0.003},
        "fault": {"audit_sample_ids": True, "preempt_grace_s": grace_s},
        "dist": {"timeout_s": timeout_s},
        "task": {"samples": SAMPLES, "slow_ms": 40, **task_options},
    }


@dataclass
class Outcome:
    ok: bool
    problems: list[str] = field(default_factory=list)
    times: dict[str, float] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)


class Context:
    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root = root
        self.rng = rng
        self._references: dict[str, Path] = {}
        self._counter = 0

    def new_dir(self, name: str) -> Path:
        self._counter += 1
        path = self.root / f"{self._counter:03d}-{name}"
        path.mkdir(parents=True)
        return path

    def reference(self, nproc: int, secs: dict[str, dict[str, object]]) -> Path:
        """The uninterrupted run of a job (made once per job and world size)."""
        key = json.dumps([nproc, secs], sort_keys=True)
        if key not in self._references:
            folder = self.new_dir(f"reference-{nproc}")
            run_dir = folder / "run"
            launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc)
            try:
                code = launch.wait(900)
                if code != 0:
                    raise RuntimeError(f"the reference run failed:\n{launch.text()[-3000:]}")
            finally:
                launch.close()
            self._references[key] = run_dir
        return self._references[key]


# ---------------------------------------------------------------------------------------------
# Checks shared by the trials


def final_params(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return torch.load(
        run_dir / "checkpoints" / ckpt.step_dir_name(step) / "model.pt", weights_only=True
    )


def same_run(reference: Path, run_dir: Path) -> list[str]:
    """Problems found comparing a run with the uninterrupted one: its final parameters must be
    bit-identical, every step must have trained on the same sample ids, each exactly once."""
    problems = []
    try:
        ckpt.verify_checkpoint(run_dir / "checkpoints" / ckpt.step_dir_name(STEPS))
        ref, got = final_params(reference), final_params(run_dir)
        if ref.keys() != got.keys():
            problems.append("final parameters: different keys")
        different = [k for k in ref if k in got and not torch.equal(ref[k], got[k])]
        if different:
            worst = max(float((ref[k] - got[k]).abs().max()) for k in different)
            problems.append(
                f"final parameters differ in {len(different)} tensor(s) (max |diff| {worst:.3g})"
            )
    except Exception as exc:
        problems.append(f"final checkpoint: {type(exc).__name__}: {exc}")
    try:
        want, got_ids = read_trajectory(reference), read_trajectory(run_dir)
        if {s: r.ids for s, r in want.items()} != {s: r.ids for s, r in got_ids.items()}:
            bad = sorted(
                s for s in set(want) | set(got_ids) if s not in want or s not in got_ids
            ) or sorted(s for s in want if want[s].ids != got_ids[s].ids)
            problems.append(f"sample ids differ from the reference at steps {bad[:8]}")
        audit = check_stream(got_ids, SAMPLES)
        if not audit.exactly_once or audit.gaps or audit.positions != STEPS * 8:
            problems.append(
                f"audit: {audit.repeated} repeated, {audit.missing} missing, "
                f"{audit.overlaps} overlapping, gaps {audit.gaps}, {audit.positions} positions"
            )
    except Exception as exc:
        problems.append(f"audit: {type(exc).__name__}: {exc}")
    return problems


def no_processes_left(run_dir: Path, within: float = 10.0) -> list[str]:
    deadline = time.monotonic() + within
    while processes_of(run_dir) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = processes_of(run_dir)
    return [f"{len(left)} process(es) left {within:.0f}s after the launcher exited"] if left else []


def injected_at(run_dir: Path, rank: int) -> float | None:
    path = run_dir / f"injected-rank{rank}.txt"
    try:
        return float(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def wait_exit_tracking(launch: Launch, timeout: float) -> tuple[int | None, float | None]:
    """Wait for the launcher; also note the wall-clock time at which the last worker seen
    exited. Returns (exit code or None when stuck, time.time() when no worker was left)."""
    deadline = time.monotonic() + timeout
    last_gone: float | None = None
    while time.monotonic() < deadline:
        launch.workers()
        alive = [p for p in launch.known_workers if pid_alive(p)]
        if not alive and last_gone is None:
            last_gone = time.time()
        if not launch.alive():
            break
        time.sleep(0.02)
    code = launch.wait(timeout=max(0.0, deadline - time.monotonic()))
    if last_gone is None and code is not None:
        last_gone = time.time()
    return code, last_gone


def leftovers(root: Path) -> list[str]:
    """Names in a checkpoints folder that a start must remove: temp and trash folders, and
    ``step-N`` folders without a completion marker."""
    if not root.is_dir():
        return []
    out = []
    for entry in sorted(root.iterdir()):
        stale = entry.name.startswith((".tmp-", ".trash-"))
        if stale or (entry.name.startswith("step-") and not (entry / ckpt.MARKER).exists()):
            out.append(entry.name)
    return out


# ---------------------------------------------------------------------------------------------
# The trials


def trial_kill9(ctx: Context, index: int) -> Outcome:
    nproc = 4
    secs = sections()
    reference = ctx.reference(nproc, secs)
    folder = ctx.new_dir("kill9")
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc, "--max-restarts=3")
    out = Outcome(ok=False)
    try:
        wait_for_step(run_dir, ctx.rng.randint(2, STEPS - 2), launch)
        victim = ctx.rng.choice(launch.workers())
        rank = rank_of(victim)
        out.tags["killed"] = f"rank {rank} at step {metrics_step(run_dir)}"
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(600)
        named = launch.first(rf"PeerFailure: .*rank {rank} \([^)]*\) died: its process is gone")
        out.tags["a survivor's error names the killed rank"] = "yes" if named else "no"
        if code != 0:
            out.problems.append(f"exit code {code}")
        starts = [t for t, line in launch.lines if re.search(STARTED, line)]
        if len(starts) != 2:
            out.problems.append(f"{len(starts)} starts of the group (expected 2)")
        else:
            out.times["kill -> group resumed training"] = starts[1] - killed
        out.times["whole run"] = (launch.ended or time.monotonic()) - launch.started
        out.problems += same_run(reference, run_dir)
        out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_always_fails(ctx: Context, index: int) -> Outcome:
    nproc = 2
    fail_rank = index % nproc
    fail_step = ctx.rng.randint(1, 6)
    secs = sections("tests.tasks:failing_gpt", fail_rank=fail_rank, fail_at_step=fail_step)
    secs["task"]["slow_ms"] = 0
    folder = ctx.new_dir("always-fails")
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc, "--max-restarts=2")
    out = Outcome(ok=False, tags={"failing": f"rank {fail_rank} at step {fail_step}"})
    try:
        code = launch.wait(600)
        out.times["start -> launcher exit"] = (launch.ended or time.monotonic()) - launch.started
        if code in (0, None):
            out.problems.append(f"exit code {code} (expected a failure)")
        try:
            attempts = (run_dir / "attempts.log").read_text().split()[0::2].count(str(fail_rank))
        except OSError:
            attempts = 0
        if attempts != 3:
            out.problems.append(f"{attempts} attempts (expected 3)")
        named = launch.first(
            rf"^\s+rank {fail_rank} \(pid \d+, exit code \d+\): .*injected failure at step "
            rf"{fail_step}"
        )
        if named is None:
            out.problems.append(f"no error line naming rank {fail_rank} and its failure")
        gone = time.monotonic()
        out.problems += no_processes_left(run_dir)
        out.times["launcher exit -> no process left"] = time.monotonic() - gone
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_sigstop(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s = 4, 5.0
    secs = sections(steps=400, timeout_s=timeout_s, grace_s=2.0)
    folder = ctx.new_dir("sigstop")
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc)
    out = Outcome(ok=False)
    victim = -1
    try:
        wait_for_step(run_dir, ctx.rng.randint(3, 12), launch)
        victim = ctx.rng.choice(launch.workers())
        rank = rank_of(victim)
        out.tags["stopped"] = f"rank {rank} at step {metrics_step(run_dir)}"
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        code = launch.wait(180)
        if code is None:
            out.problems.append("STUCK: the launcher had not exited 180 s after the SIGSTOP")
            out.tags["stuck"] = "yes"
        else:
            out.times["SIGSTOP -> launcher exit"] = (launch.ended or 0) - stopped
        # Every other rank's PeerFailure must name the stopped one.
        named: dict[int, float] = {}
        pattern = rf"PeerFailure: rank (\d+) \(.*rank {rank} \([^)]*\) stopped responding"
        for arrived, line in launch.lines:
            match = re.search(pattern, line)
            if match and arrived >= stopped:
                named.setdefault(int(match.group(1)), arrived - stopped)
        others = set(range(nproc)) - {rank}
        if set(named) != others:
            missing = sorted(others - set(named))
            out.problems.append(f"rank(s) {missing} did not raise a PeerFailure naming rank {rank}")
        if named:
            out.times["SIGSTOP -> first rank names it"] = min(named.values())
            out.times["SIGSTOP -> last rank names it"] = max(named.values())
            if max(named.values()) > 10.0:
                out.problems.append(
                    f"the others named it only after {max(named.values()):.1f}s (target 10s)"
                )
        if code is not None:
            out.problems += no_processes_left(run_dir)
    finally:
        if victim > 0 and pid_alive(victim):
            os.kill(victim, signal.SIGKILL)
        launch.close()
    out.ok = not out.problems
    return out


def _raise_trial(
    ctx: Context,
    name: str,
    secs: dict[str, dict[str, object]],
    nproc: int,
    timeout_s: float,
    save_step: int = 0,
    failed_save: bool = False,
) -> Outcome:
    folder = ctx.new_dir(name)
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc)
    out = Outcome(ok=False)
    try:
        wait_for_step(run_dir, 1, launch)
        launch.workers()
        code, all_gone = wait_exit_tracking(launch, 180)
        raised = injected_at(run_dir, 0)
        if code is None:
            out.problems.append("STUCK: the launcher had not exited 180 s after starting")
        elif code == 0:
            out.problems.append("exit code 0 (expected a failure)")
        if raised is None:
            out.problems.append("the fault was not injected")
        elif all_gone is None:
            out.problems.append("workers still alive")
        else:
            took = all_gone - raised
            out.times["raise -> every worker exited"] = took
            if launch.ended_wall is not None:
                out.times["raise -> launcher exit"] = launch.ended_wall - raised
            if took > 2 * timeout_s:
                out.problems.append(f"the ranks exited {took:.1f}s after the raise (> 2 x timeout)")
        others = [r for r in range(1, nproc)]
        for r in others:
            if launch.first(rf"PeerFailure: rank {r} \(.*rank 0 \(") is None:
                out.problems.append(f"rank {r}'s error does not name rank 0")
        folder_k = run_dir / "checkpoints" / ckpt.step_dir_name(save_step)
        if save_step and failed_save and (folder_k / ckpt.MARKER).exists():
            out.problems.append(f"the failed save of step {save_step} was committed")
        elif save_step and (folder_k / ckpt.MARKER).exists():
            # The save itself went well (its snapshot was taken before the raise): it may
            # commit while the process goes down, but only whole.
            try:
                ckpt.verify_checkpoint(folder_k)
            except Exception as exc:
                out.problems.append(f"a committed checkpoint does not verify: {exc}")
        if code is not None:
            out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_raise_collective(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s = 2, 5.0
    step = ctx.rng.randint(2, 12)
    secs = sections(
        "tests.tasks:chaos_gpt", steps=40, timeout_s=timeout_s, raise_rank=0, raise_at_step=step
    )
    out = _raise_trial(ctx, "raise-collective", secs, nproc, timeout_s)
    out.tags["raised"] = f"forward of step {step}"
    return out


def trial_raise_save(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s, every = 2, 5.0, 4
    step = every * ctx.rng.randint(1, 3)
    if index % 2 == 0:  # synchronous save: the write raises on rank 0 and so does the save
        secs = sections(
            "tests.tasks:chaos_gpt",
            steps=40,
            timeout_s=timeout_s,
            every=every,
            async_save=False,
            raise_rank=0,
            raise_in_save_step=step,
        )
        kind = "sync save, in a file write"
    else:  # asynchronous: rank 0's main thread raises while its background write runs
        secs = sections(
            "tests.tasks:chaos_gpt",
            steps=40,
            timeout_s=timeout_s,
            every=every,
            raise_rank=0,
            raise_while_saving_step=step,
            save_slow_ms=300,
            save_slow_rank=0,
        )
        kind = "async save in flight, main thread"
    out = _raise_trial(
        ctx, "raise-save", secs, nproc, timeout_s, save_step=step, failed_save=index % 2 == 0
    )
    out.tags["raised"] = f"{kind}, step {step}"
    return out


def next_save(root: Path, timeout: float = 60) -> tuple[str, float]:
    """The name of the next temp folder to appear in ``root``, and when it appeared."""
    seen = {e.name for e in root.iterdir()} if root.is_dir() else set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = {e.name for e in root.iterdir()} if root.is_dir() else set()
        for name in names - seen:
            if name.startswith(".tmp-"):
                return name, time.monotonic()
        seen = names
        time.sleep(0.002)
    raise RuntimeError(f"no save started within {timeout:.0f}s")


def committed_at(root: Path, tmp_name: str, timeout: float = 60) -> float:
    """When the save writing ``tmp_name`` put its completion marker in place."""
    marker = root / tmp_name.removeprefix(".tmp-") / ckpt.MARKER
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if marker.exists():
            return time.monotonic()
        time.sleep(0.002)
    raise RuntimeError(f"{tmp_name} was not committed within {timeout:.0f}s")


def trial_kill_in_save(ctx: Context, index: int) -> Outcome:
    nproc = 2
    secs = sections("tests.tasks:chaos_gpt", every=2, save_slow_ms=80)
    reference = ctx.reference(nproc, secs)
    folder = ctx.new_dir("kill-in-save")
    run_dir = folder / "run"
    root = run_dir / "checkpoints"
    config = write_config(folder / "job.toml", run_dir, **secs)
    group = index % 2 == 1
    out = Outcome(ok=False, tags={"killed": "launcher + every worker" if group else "one worker"})
    launch = Launch(config, nproc)
    try:
        wait_for_step(run_dir, ctx.rng.randint(1, STEPS - 8), launch)
        # Time one whole save (its temp folder appears .. its marker appears), then kill at a
        # uniformly random moment of the next one (or just after it: up to 1.15 x as long).
        name, began = next_save(root)
        duration = committed_at(root, name) - began
        _, began = next_save(root)
        delay = ctx.rng.uniform(0.0, 1.15 * duration)
        time.sleep(max(0.0, began + delay - time.monotonic()))
        out.times["save duration (observed)"] = duration
        launch.workers()
        if group:
            launch.kill_all()
        else:
            os.kill(ctx.rng.choice(launch.workers()), signal.SIGKILL)
            if launch.wait(120) is None:
                out.problems.append("the launcher did not exit after a worker was killed")
                launch.kill_all()
        wait_gone(launch.known_workers, 30)
    finally:
        launch.close()
    # What the kill left: the newest committed step, and what the next start must remove.
    left = leftovers(root)
    committed = ckpt.committed_steps(root)
    phase = (
        "writing files"
        if any(n.startswith(".tmp-") for n in left)
        else "renamed, marker not yet written"
        if any(n.startswith("step-") for n in left)
        else "pruning"
        if any(n.startswith(".trash-") for n in left)
        else "between saves or after the commit"
    )
    out.tags["phase"] = phase
    expected = max(committed) if committed else None
    if expected is not None:
        try:
            ckpt.verify_checkpoint(root / ckpt.step_dir_name(expected))
        except Exception as exc:
            out.problems.append(f"a committed checkpoint does not verify: {exc}")
    again = Launch(config, nproc)
    try:
        code = again.wait(600)
        if code != 0:
            out.problems.append(f"the next start failed (exit {code}): {again.text()[-1500:]}")
        started = again.first(STARTED + r".*(resumed from (step-\d+)|from scratch)")
        if started is None:
            out.problems.append("the next start did not say where it resumed from")
        else:
            got = started[1].group(3)
            want = ckpt.step_dir_name(expected) if expected is not None else None
            out.times["start -> training resumed"] = started[0] - again.started
            if got != want:
                out.problems.append(f"resumed from {got or 'scratch'}, expected {want}")
        for name in left:
            if again.first(rf"removed the leftover of an interrupted save: {name}$") is None:
                out.problems.append(f"the next start did not report removing {name}")
        still = leftovers(root)
        if still:
            out.problems.append(f"left after the next run: {still}")
        out.problems += same_run(reference, run_dir)
        out.problems += no_processes_left(run_dir)
    finally:
        again.close()
    out.ok = not out.problems
    return out


CORRUPT_MODES = ("truncate", "zero-fill", "bit-flip", "delete")
CORRUPT_FILES = (
    "model.pt",
    "optimizer.pt",
    "train_state.pt",
    "meta.json",
    "rng-rank00000.pt",
    "rng-rank00001.pt",
    ckpt.MARKER,
)


def corrupt(path: Path, mode: str, rng: random.Random) -> str:
    data = bytearray(path.read_bytes())
    if mode == "delete":
        path.unlink()
        return "deleted"
    if mode == "truncate":
        keep = rng.randrange(0, len(data))
        path.write_bytes(bytes(data[:keep]))
        return f"truncated to {keep} of {len(data)} bytes"
    if mode == "zero-fill":  # a lost page: 4 KiB of zeros (the whole file when smaller)
        start = rng.randrange(0, max(1, len(data) - 4096) + 1) if len(data) > 4096 else 0
        end = min(len(data), start + 4096)
        data[start:end] = bytes(end - start)
        path.write_bytes(bytes(data))
        return f"bytes {start}-{end} zeroed"
    offset = rng.randrange(len(data))
    bit = rng.randrange(8)
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))
    return f"bit {bit} of byte {offset} flipped"


class _Base:
    """The run whose newest checkpoint the corruption trials damage (made once)."""

    run_dir: Path | None = None


def trial_corrupt(ctx: Context, index: int) -> Outcome:
    nproc = 2
    secs = sections()
    reference = ctx.reference(nproc, secs)  # its checkpoints: step-16 and step-20
    newest, previous = ckpt.step_dir_name(STEPS), ckpt.step_dir_name(STEPS - 4)
    mode = CORRUPT_MODES[index % len(CORRUPT_MODES)]
    name = CORRUPT_FILES[(index // len(CORRUPT_MODES)) % len(CORRUPT_FILES)]
    folder = ctx.new_dir("corrupt")
    run_dir = folder / "run"
    shutil.copytree(reference, run_dir)
    config = write_config(folder / "job.toml", run_dir, **secs)
    what = corrupt(run_dir / "checkpoints" / newest / name, mode, ctx.rng)
    out = Outcome(ok=False, tags={"corrupted": f"{name}: {what}"})
    launch = Launch(config, nproc)
    try:
        code = launch.wait(600)
        if code != 0:
            out.problems.append(f"exit {code}: {launch.text()[-1500:]}")
        detected = launch.first(
            rf"skipping checkpoint {newest}: |removed the leftover of an interrupted save: "
            rf"{newest}$"
        )
        if detected is None:
            out.problems.append(f"no warning naming {newest}")
        started = launch.first(STARTED + r".*(resumed from (step-\d+)|from scratch)")
        if started is None:
            out.problems.append("no line saying where it resumed from")
        else:
            out.times["start -> training resumed"] = started[0] - launch.started
            got = started[1].group(3)
            if got == newest:
                out.problems.append(f"SILENT LOAD: resumed from the corrupted {newest}")
                out.tags["silent"] = "yes"
            elif got != previous:
                out.problems.append(f"resumed from {got or 'scratch'}, expected {previous}")
        out.problems += same_run(reference, run_dir)
        out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_sigterm(ctx: Context, index: int) -> Outcome:
    nproc, grace = 2, 30.0
    secs = sections(grace_s=grace)
    reference = ctx.reference(nproc, secs)
    folder = ctx.new_dir("sigterm")
    run_dir = folder / "run"
    config = write_config(folder / "job.toml", run_dir, **secs)
    out = Outcome(ok=False)
    launch = Launch(config, nproc)
    try:
        wait_for_step(run_dir, ctx.rng.randint(2, STEPS - 3), launch)
        sent = time.monotonic()
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.wait(grace + 60)
        took = (launch.ended or time.monotonic()) - sent
        out.times["SIGTERM -> launcher exit"] = took
        if code != 0:
            out.problems.append(f"exit code {code}: {launch.text()[-1500:]}")
        if took > grace:
            out.problems.append(f"exited {took:.1f}s after SIGTERM (grace {grace:.0f}s)")
        try:
            status = json.loads((run_dir / "status.json").read_text())
        except (OSError, ValueError):
            status = {}
        if status.get("state") != "preempted":
            out.problems.append(f"status.json: {status}")
        step = int(status.get("step", -1))
        out.tags["stopped"] = f"step {step}"
        out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    again = Launch(config, nproc)
    try:
        if again.wait(600) != 0:
            out.problems.append(f"the resumed run failed: {again.text()[-1500:]}")
        if again.first(rf"resumed from {ckpt.step_dir_name(step)}") is None:
            out.problems.append(f"the resumed run did not start from step {step}")
        out.problems += same_run(reference, run_dir)
        out.problems += no_processes_left(run_dir)
    finally:
        again.close()
    out.ok = not out.problems
    return out


RESIZES = ((4, 2), (2, 4), (2, 3))


def trial_resize(ctx: Context, index: int) -> Outcome:
    before, after = RESIZES[index % len(RESIZES)]
    secs = sections()
    reference = ctx.reference(2, secs)  # sample ids per step do not depend on the world size
    folder = ctx.new_dir(f"resize-{before}-{after}")
    run_dir = folder / "run"
    config = write_config(folder / "job.toml", run_dir, **secs)
    out = Outcome(ok=False, tags={"resize": f"{before} -> {after}"})
    launch = Launch(config, before)
    try:
        wait_for_step(run_dir, ctx.rng.randint(2, STEPS - 3), launch)
        launch.proc.send_signal(signal.SIGTERM)
        if launch.wait(120) != 0:
            out.problems.append(f"the first leg did not stop cleanly: {launch.text()[-1500:]}")
    finally:
        launch.close()
    status = json.loads((run_dir / "status.json").read_text())
    out.tags["stopped"] = f"step {status.get('step')}"
    again = Launch(config, after)
    try:
        if again.wait(600) != 0:
            out.problems.append(f"the resumed run failed: {again.text()[-1500:]}")
        if again.first(rf"on {after} rank\(s\).*resumed from step-") is None:
            out.problems.append(f"did not resume on {after} ranks")
        want, got = read_trajectory(reference), read_trajectory(run_dir)
        if {s: r.ids for s, r in want.items()} != {s: r.ids for s, r in got.items()}:
            out.problems.append("sample ids per step differ from the uninterrupted run")
        audit = check_stream(got, SAMPLES)
        if not audit.exactly_once or audit.gaps or audit.positions != STEPS * 8:
            out.problems.append(f"audit: {audit}")
        out.problems += no_processes_left(run_dir)
    finally:
        again.close()
    out.ok = not out.problems
    return out


@dataclass(frozen=True)
class Kind:
    run: Callable[[Context, int], Outcome]
    count: int
    what: str
    targets: dict[str, float] = field(default_factory=dict)  # timing name -> upper bound


TRIALS: dict[str, Kind] = {
    "kill9": Kind(trial_kill9, 20, "kill -9 of 1 of 4 workers at a random step, --max-restarts 3"),
    "always_fails": Kind(trial_always_fails, 5, "a worker that always fails, --max-restarts 2"),
    "sigstop": Kind(
        trial_sigstop,
        10,
        "SIGSTOP of 1 of 4 workers, dist.timeout_s = 5",
        {"SIGSTOP -> last rank names it": 10.0},
    ),
    "raise_collective": Kind(
        trial_raise_collective,
        5,
        "rank 0 raises just before a collective (timeout 5 s)",
        {"raise -> every worker exited": 10.0},
    ),
    "raise_save": Kind(
        trial_raise_save,
        6,
        "rank 0 raises during a save, sync and async (timeout 5 s)",
        {"raise -> every worker exited": 10.0},
    ),
    "kill_in_save": Kind(trial_kill_in_save, 50, "kill -9 at a random point inside a save"),
    "corrupt": Kind(trial_corrupt, 30, "newest checkpoint corrupted (4 modes x 7 files)"),
    "sigterm": Kind(
        trial_sigterm,
        5,
        "SIGTERM to the launcher at a random step (grace 30 s)",
        {"SIGTERM -> launcher exit": 30.0},
    ),
    "resize": Kind(trial_resize, 6, "SIGTERM, resume at another world size (4->2, 2->4, 2->3)"),
}


# ---------------------------------------------------------------------------------------------
# Running and reporting


@dataclass
class Tally:
    name: str
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(o.ok for o in self.outcomes)

    def timings(self) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {}
        for o in self.outcomes:
            for key, value in o.times.items():
                out.setdefault(key, []).append(value)
        return out


def table(tallies: list[Tally]) -> list[str]:
    rows = [
        "| trial | what | passed | timing | median | max | target |",
        "|---|---|---:|---|---:|---:|---:|",
    ]
    for tally in tallies:
        kind = TRIALS[tally.name]
        timings = tally.timings() or {"": []}
        first = True
        for key, values in timings.items():
            target = kind.targets.get(key)
            cells = [
                f"`{tally.name}`" if first else "",
                kind.what if first else "",
                f"{tally.passed}/{len(tally.outcomes)}" if first else "",
                key,
                f"{median(values):.2f} s" if values else "",
                f"{max(values):.2f} s" if values else "",
                f"<= {target:.0f} s" if target else "",
            ]
            rows.append("| " + " | ".join(cells) + " |")
            first = False
    return rows


def tag_summary(tally: Tally) -> list[str]:
    """Counts of each tag value (kill phases, corrupted files, ...), for the notes."""
    lines = []
    keys = sorted({k for o in tally.outcomes for k in o.tags})
    for key in keys:
        if key in ("killed", "stopped", "raised", "corrupted", "failing", "silent", "stuck"):
            continue
        counts: dict[str, int] = {}
        for o in tally.outcomes:
            if key in o.tags:
                counts[o.tags[key]] = counts.get(o.tags[key], 0) + 1
        shown = ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
        lines.append(f"- `{tally.name}` {key}: {shown}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", default=",".join(TRIALS), help="comma-separated kinds")
    parser.add_argument("--count", type=int, default=0, help="trials of each kind (0 = issue's)")
    parser.add_argument("--quick", action="store_true", help="one trial of each kind")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kill points")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("--no-docs", action="store_true", help="do not update docs/benchmarks.md")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.trials.split(",") if n.strip()]
    unknown = [n for n in names if n not in TRIALS]
    if unknown:
        parser.error(f"unknown trial(s) {unknown}; choose from {', '.join(TRIALS)}")
    root = Path(tempfile.mkdtemp(prefix="dtrain-chaos-"))
    ctx = Context(root, random.Random(args.seed))
    began = time.monotonic()
    tallies: list[Tally] = []
    try:
        for name in names:
            kind = TRIALS[name]
            count = 1 if args.quick else (args.count or kind.count)
            tally = Tally(name)
            tallies.append(tally)
            for index in range(count):
                t0 = time.monotonic()
                try:
                    outcome = kind.run(ctx, index)
                except Exception as exc:
                    outcome = Outcome(ok=False, problems=[f"{type(exc).__name__}: {exc}"])
                    traceback.print_exc()
                tally.outcomes.append(outcome)
                tags = "; ".join(f"{k} {v}" for k, v in outcome.tags.items())
                times = ", ".join(f"{k} {v:.2f}s" for k, v in outcome.times.items())
                status = "ok  " if outcome.ok else "FAIL"
                print(
                    f"[{name} {index + 1}/{count}] {status} {time.monotonic() - t0:5.1f}s  "
                    f"{tags}  {times}",
                    flush=True,
                )
                for problem in outcome.problems:
                    print(f"    - {problem[:2000]}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
        else:
            print(f"run folders kept in {root}")
    elapsed = time.monotonic() - began
    rows = table(tallies)
    print("\n" + "\n".join(rows))
    failures = [
        f"- `{t.name}` trial {i + 1}: {'; '.join(p[:300] for p in o.problems)}"
        for t in tallies
        for i, o in enumerate(t.outcomes)
        if not o.ok
    ]
    notes = [line for t in tallies for line in tag_summary(t)]
    if failures:
        print("\nfailed trials:\n" + "\n".join(failures))
    if not args.no_docs:
        command = "python benchmarks/chaos.py" + (
            " " + " ".join(argv if argv is not None else sys.argv[1:])
            if (argv if argv is not None else sys.argv[1:])
            else ""
        )
        body = [
            "## Fault tolerance (chaos)",
            "",
            f"Command: `{command}` (seed {args.seed}), {time.strftime('%Y-%m-%d')}, "
            f"{elapsed / 60:.0f} min in all  ",
            f"Machine: {machine_line()}  ",
            "Each trial runs `python -m dtrain train` (torch's elastic agent, gloo on loopback, "
            "CPU) on a 2-layer GPT, 64 samples, 20 AdamW steps of 8 samples, each forward "
            'slowed by 40 ms; "bit-identical" compares the final `model.pt` with an '
            "uninterrupted run of the same job and world size (`torch.equal`), and the "
            "sample ids of every step with the same run's audit (`fault.audit_sample_ids`).",
            "",
            *rows,
            "",
            *(["Where the kills landed and what was damaged:", "", *notes, ""] if notes else []),
            *(["Failed trials:", "", *failures, ""] if failures else ["Every trial passed.", ""]),
        ]
        write_docs_section("chaos", "\n".join(body))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
