"""Chaos trials on resuming: kill -9 inside a save, corrupted checkpoints, SIGTERM, a new
world size (see chaos.py)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from pathlib import Path

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from tests.audit import check_stream, read_trajectory
from tests.processes import Launch, wait_gone
from tests.system.chaos_checks import (
    REPO,
    SAMPLES,
    STARTED,
    STEPS,
    Context,
    Outcome,
    leftovers,
    no_processes_left,
    same_run,
    sections,
    wait_for_step,
    write_config,
)


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
    marker = root / tmp_name.removeprefix(".tmp-") / layout.MARKER
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
    launch = Launch(config, nproc, cwd=REPO)
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
    committed = layout.committed_steps(root)
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
            ckread.verify_checkpoint(root / layout.step_dir_name(expected))
        except Exception as exc:
            out.problems.append(f"a committed checkpoint does not verify: {exc}")
    again = Launch(config, nproc, cwd=REPO)
    try:
        code = again.wait(600)
        if code != 0:
            out.problems.append(f"the next start failed (exit {code}): {again.text()[-1500:]}")
        started = again.first(STARTED + r".*(resumed from (step-\d+)|from scratch)")
        if started is None:
            out.problems.append("the next start did not say where it resumed from")
        else:
            got = started[1].group(3)
            want = layout.step_dir_name(expected) if expected is not None else None
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
    layout.MARKER,
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


def trial_corrupt(ctx: Context, index: int) -> Outcome:
    nproc = 2
    secs = sections()
    reference = ctx.reference(nproc, secs)  # its checkpoints: step-16 and step-20
    newest, previous = layout.step_dir_name(STEPS), layout.step_dir_name(STEPS - 4)
    mode = CORRUPT_MODES[index % len(CORRUPT_MODES)]
    name = CORRUPT_FILES[(index // len(CORRUPT_MODES)) % len(CORRUPT_FILES)]
    folder = ctx.new_dir("corrupt")
    run_dir = folder / "run"
    shutil.copytree(reference, run_dir)
    config = write_config(folder / "job.toml", run_dir, **secs)
    what = corrupt(run_dir / "checkpoints" / newest / name, mode, ctx.rng)
    out = Outcome(ok=False, tags={"corrupted": f"{name}: {what}"})
    launch = Launch(config, nproc, cwd=REPO)
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
    launch = Launch(config, nproc, cwd=REPO)
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
    again = Launch(config, nproc, cwd=REPO)
    try:
        if again.wait(600) != 0:
            out.problems.append(f"the resumed run failed: {again.text()[-1500:]}")
        if again.first(rf"resumed from {layout.step_dir_name(step)}") is None:
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
    launch = Launch(config, before, cwd=REPO)
    try:
        wait_for_step(run_dir, ctx.rng.randint(2, STEPS - 3), launch)
        launch.proc.send_signal(signal.SIGTERM)
        if launch.wait(120) != 0:
            out.problems.append(f"the first leg did not stop cleanly: {launch.text()[-1500:]}")
    finally:
        launch.close()
    status = json.loads((run_dir / "status.json").read_text())
    out.tags["stopped"] = f"step {status.get('step')}"
    again = Launch(config, after, cwd=REPO)
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
