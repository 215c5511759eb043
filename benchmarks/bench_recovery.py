"""Recovery after kill -9 of one worker: fault.recovery = 'inplace' against 'restart'.

Each trial runs the real ``dtrain train`` (tiny GPT, gloo, ``--nproc`` workers (2 or 4), steps
slowed to ~50 ms, a checkpoint every 4 steps) and kills member (rank) 1 outright after step 10;
with 4 workers, member 3 is then a survivor not next to it in gloo's ring. Measured from the
outside, with the wall-clock times of the train records in ``metrics.jsonl`` (one per step):

- inplace: kill -> the survivors' next committed step; the restarted worker's process start
  -> the first step it trains with the survivors (its heal included);
- restart: kill -> the first step after torch's agent restarted both workers (which resume
  from the newest checkpoint), and the steps trained again.

Trials alternate between the modes; min / median / max over ``--trials`` each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _report import ROOT, machine_line, update_section
from peers import process_cpu_s

sys.path.insert(0, str(ROOT))

from tests.processes import Launch, metrics_records, rank_of, started_at, worker_pids

from dtrain.train.job import build_job_config


def job(run_dir: Path, mode: str) -> dict[str, Any]:
    return {
        "run": {"dir": str(run_dir), "task": "tests.tasks:tiny_gpt", "seed": 0},
        "data": {"global_batch_size": 8, "prefetch": 0},
        "train": {"steps": 3000, "log_every": 1},
        "optim": {"name": "sgd", "lr": 0.5, "warmup_steps": 2},
        "eval": {"every": 0, "batch_size": 8},
        "checkpoint": {"every": 4},
        "fault": {"recovery": mode},
        "dist": {"timeout_s": 30},
        "task": {"slow_ms": 30},
    }


def wait_for(what: str, probe: Any, launch: Launch, limit_s: float = 120.0) -> Any:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        found = probe()
        if found is not None:
            return found
        if not launch.alive():
            raise RuntimeError(f"the job ended waiting for {what}:\n{launch.text()[-3000:]}")
        time.sleep(0.02)
    raise RuntimeError(f"no {what} within {limit_s:.0f} s:\n{launch.text()[-3000:]}")


def first_train_after(run_dir: Path, moment: float) -> tuple[int, float] | None:
    for r in metrics_records(run_dir):
        if r.get("kind") == "train" and r["time"] > moment:
            return int(r["step"]), float(r["time"])
    return None


def last_step(run_dir: Path) -> int:
    steps = [int(r["step"]) for r in metrics_records(run_dir) if r.get("kind") == "train"]
    return max(steps, default=0)


def trial(root: Path, mode: str, number: int, nproc: int) -> dict[str, float]:
    run_dir = root / f"{mode}-{nproc}-{number}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config = run_dir.parent / f"{mode}-{nproc}-{number}.toml"
    config.write_text(build_job_config(job(run_dir, mode)).to_toml())
    launch = Launch(config, nproc, "--max-restarts", "3", cwd=ROOT)
    try:
        wait_for("step 10", lambda: True if last_step(run_dir) >= 10 else None, launch)
        if mode == "inplace":
            victim = launch.inplace_workers()[1]
        else:
            victim = next(p for p in worker_pids(launch.pid) if rank_of(p) == 1)
        before = last_step(run_dir)
        killed = time.time()
        os.kill(victim, signal.SIGKILL)
        step, at = wait_for(
            "a step after the kill", lambda: first_train_after(run_dir, killed), launch
        )
        result = {"kill_to_step_s": at - killed, "steps_again": float(before + 1 - step)}
        if mode == "inplace":
            joiner = wait_for(
                "the restarted worker",
                lambda: next(
                    (p for m, p in launch.inplace_workers().items() if m == 1 and p != victim),
                    None,
                ),
                launch,
            )
            born = started_at(joiner)
            cpu = [0.0]  # the joiner's own CPU seconds at the last look

            def joined() -> float | None:
                cpu[0] = process_cpu_s(joiner) or cpu[0]
                for r in metrics_records(run_dir):
                    if r.get("name") == "membership" and r.get("joined") == [1]:
                        found = first_train_after(run_dir, float(r["time"]))
                        return found[1] if found else None
                return None

            result["start_to_shared_step_s"] = (
                wait_for("the joiner's first step", joined, launch) - born
            )
            # What it would take with a core of its own: the CPU its start (imports) and heal
            # used. With 4 workers on 2 cores it gets about half a core, hence the wall time.
            result["joiner_cpu_s"] = cpu[0]
        return result
    finally:
        launch.close()


def spread(values: list[float]) -> str:
    return f"{min(values):.2f} / {statistics.median(values):.2f} / {max(values):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2, choices=(2, 4))
    parser.add_argument("--root", default="/tmp/dtrain-bench/recovery")
    parser.add_argument("--no-doc", action="store_true")
    args = parser.parse_args()
    root = Path(args.root)
    runs: dict[str, list[dict[str, float]]] = {"inplace": [], "restart": []}
    for number in range(args.trials):
        for mode in runs:
            runs[mode].append(trial(root, mode, number, args.nproc))
            print(mode, number, runs[mode][-1], flush=True)

    def column(mode: str, key: str) -> list[float]:
        return [r[key] for r in runs[mode]]

    inplace_s = statistics.median(column("inplace", "kill_to_step_s"))
    restart_s = statistics.median(column("restart", "kill_to_step_s"))
    nproc = args.nproc
    option = "" if nproc == 2 else f" --nproc {nproc}"
    lines = [
        f"## Recovery after kill -9 of 1 of {nproc} workers: in place against restart "
        "(`bench_recovery.py`)",
        "",
        f"Command: `python benchmarks/bench_recovery.py --trials {args.trials}{option}`  ",
        f"Machine: {machine_line()}  ",
        f"Job: tiny GPT, gloo, {nproc} workers on one machine, ~50 ms steps, a checkpoint every "
        "4 steps; worker 1 killed (SIGKILL) after step 10; its launcher restarts it "
        f"(`--max-restarts 3`). Times are wall clock from the train records; min / median / "
        f"max over {args.trials} trials, the modes alternating.",
        "",
        "| mode | what | seconds (min / median / max) |",
        "|---|---|---:|",
        f"| inplace | kill -> the survivors' next committed step | "
        f"{spread(column('inplace', 'kill_to_step_s'))} |",
        f"| inplace | restarted worker's start -> its first step with the survivors | "
        f"{spread(column('inplace', 'start_to_shared_step_s'))} |",
        f"| inplace | the restarted worker's own CPU seconds until then | "
        f"{spread(column('inplace', 'joiner_cpu_s'))} |",
        f"| restart | kill -> the first step after the restart | "
        f"{spread(column('restart', 'kill_to_step_s'))} |",
        "",
        f"Steps trained again: inplace {spread(column('inplace', 'steps_again'))}, restart "
        f"{spread(column('restart', 'steps_again'))} (min / median / max). Kill -> next step, "
        f"median: restart / inplace = {restart_s / inplace_s:.1f}x.",
    ]
    report = "\n".join(lines)
    print(report)
    if not args.no_doc:
        section = "bench_recovery" if nproc == 2 else f"bench_recovery_{nproc}"
        print(f"wrote {update_section(section, report)}")


if __name__ == "__main__":
    main()
