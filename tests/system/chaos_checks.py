"""The chaos trials' job, their bookkeeping, and the checks they share (see chaos.py)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from tests.audit import check_stream, read_trajectory
from tests.processes import Launch, pid_alive, processes_of

# Every job starts here, so that the workers import the tasks as ``tests.tasks:...``.
REPO = Path(__file__).resolve().parents[2]
SAMPLES = 64  # 8 steps per epoch at a global batch of 8: a 20-step run crosses two epochs
STEPS = 20
STARTED = r"dtrain: training \w+ on (\d+) rank\(s\)"


def write_config(path: Path, run_dir: Path, **sections: Mapping[str, object]) -> Path:
    """A TOML config: ``write_config(p, d, train={"steps": 20}, task={...})``."""
    run = {"dir": str(run_dir), **sections.get("run", {})}
    lines = ["[run]", *(f"{k} = {json.dumps(v)}" for k, v in run.items())]
    for name, values in sections.items():
        if name != "run":
            lines.append(f"[{name}]")
            lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


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
            launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc, cwd=REPO)
            try:
                code = launch.wait(900)
                if code != 0:
                    raise RuntimeError(f"the reference run failed:\n{launch.text()[-3000:]}")
            finally:
                launch.close()
            self._references[key] = run_dir
        return self._references[key]


def final_params(run_dir: Path, step: int = STEPS) -> dict[str, torch.Tensor]:
    return torch.load(
        run_dir / "checkpoints" / layout.step_dir_name(step) / "model.pt", weights_only=True
    )


def same_run(reference: Path, run_dir: Path) -> list[str]:
    """Problems found comparing a run with the uninterrupted one: its final parameters must be
    bit-identical, every step must have trained on the same sample ids, each exactly once."""
    problems = []
    try:
        ckread.verify_checkpoint(run_dir / "checkpoints" / layout.step_dir_name(STEPS))
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


def metrics_step(run_dir: Path) -> int:
    """The highest step in RUN_DIR/metrics.jsonl so far (0 when none)."""
    path = run_dir / "metrics.jsonl"
    best = 0
    try:
        text = path.read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        try:
            best = max(best, int(json.loads(line).get("step", 0)))
        except (ValueError, AttributeError):
            pass  # a line being written
    return best


def wait_for_step(run_dir: Path, step: int, launch: Launch, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not launch.alive():
            raise RuntimeError(
                f"the run ended (exit {launch.returncode}) before step {step}:\n"
                + launch.text()[-3000:]
            )
        if metrics_step(run_dir) >= step:
            return
        time.sleep(0.01)
    raise RuntimeError(f"the run did not reach step {step} within {timeout:.0f}s")


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
        if stale or (entry.name.startswith("step-") and not (entry / layout.MARKER).exists()):
            out.append(entry.name)
    return out
