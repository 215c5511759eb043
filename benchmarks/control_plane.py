"""The control plane as the world grows: start-up, what liveness and metrics cost each rank per
step, a checkpoint's commit, and the time from a kill -9 to a named error and to training
again -- at 2 to 32 ranks of one machine (``benchmarks/control_plane_task.py``: a tiny model
whose forward sleeps, one thread per rank).

On a machine with fewer cores than ranks, wall times measure the machine as much as dtrain: 32
ranks share 2 cores. So the per-step cost is counted where it is spent, per rank: CPU time of
the training thread inside the control plane's calls, CPU time of the watchdog's thread, and
the calls each rank makes to the job's key-value store -- each per step, and its ratio to the
2-rank figure (the target: within 1.1x at 32 ranks). Start-up, commit and failure times are
wall times, printed as measured, with what bounds them here.

    python benchmarks/control_plane.py                  # 2, 4, 8, 16, 32 ranks
    python benchmarks/control_plane.py --worlds 2,8 --write-doc
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _report import machine_line, write_report_section
from dtrain.testing import Launch, rank_of

HERE = Path(__file__).resolve().parent
PER_RANK_BATCH = 2


def write_config(path: Path, run_dir: Path, world: int, steps: int, sleep_ms: float) -> Path:
    lines = [
        "[run]",
        f'dir = "{run_dir}"',
        'task = "control_plane_task:build"',
        "[data]",
        f"global_batch_size = {PER_RANK_BATCH * world}",  # the same work per rank
        "prefetch = 0",
        "[train]",
        f"steps = {steps}",
        "log_every = 10",
        "[optim]",
        'name = "sgd"',
        "lr = 0.01",
        "warmup_steps = 0",
        "[eval]",
        "every = 0",
        "[checkpoint]",
        "every = 10",
        "[dist]",
        "threads = 1",
        "timeout_s = 60",
        "[task]",
        f"samples = {max(4096, 4 * PER_RANK_BATCH * world * steps)}",
        f"sleep_ms = {sleep_ms}",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def records(run_dir: Path) -> list[dict[str, Any]]:
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def wait_for(run_dir: Path, launch: Launch, test: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in records(run_dir):
            if test(record):
                return record
        if not launch.alive():
            raise RuntimeError(f"the run ended early:\n{launch.text()[-3000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"timed out after {timeout:.0f}s:\n{launch.text()[-3000:]}")


def steady(scratch: Path, world: int, steps: int, sleep_ms: float) -> dict[str, Any]:
    """One run to the end: start-up, per-rank control-plane cost per step, commit times."""
    run_dir = scratch / f"steady-w{world}"
    config = write_config(scratch / f"steady-w{world}.toml", run_dir, world, steps, sleep_ms)
    started = time.time()
    launch = Launch(config, world, cwd=HERE)
    code = launch.wait(1800)
    launch.close()
    if code != 0:
        logs = "".join(
            f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((run_dir / "logs").glob("*"))
        )
        raise RuntimeError(f"{world} ranks: exit {code}\n{launch.text()[-3000:]}\n{logs}")
    start = next(r for r in records(run_dir) if r.get("kind") == "start")
    ranks = [json.loads(p.read_text()) for p in sorted((run_dir / "bench").glob("*.json"))]
    assert len(ranks) == world, f"{len(ranks)} rank reports of {world}"
    per_rank = [measured(r) for r in ranks]
    rank0 = next(p for p, r in zip(per_rank, ranks, strict=True) if r["rank"] == 0)
    commits = [s for r in ranks for s in r["commit_s"]]

    def median(name: str) -> float:
        return statistics.median(p[name] for p in per_rank)

    return {
        "world": world,
        "startup_s": start["time"] - started,
        "main_units": median("main_units"),
        "watchdog_units": median("watchdog_units"),
        "rank0_main_units": rank0["main_units"],
        "main_us": median("main_us"),
        "watchdog_us": median("watchdog_us"),
        "ref_us": median("ref_us"),
        "store_ops": max(p["store_ops"] for p in per_rank),
        "per_s": {
            name: max(p["per_s"].get(name, 0.0) for p in per_rank)
            for name in ("store_calls", "beats", "stamps", "syncs")
        },
        "set_phase": median("set_phase"),
        "step_s": median("step_s"),
        "commit_s": statistics.median(commits) if commits else float("nan"),
        "parts_units": {
            name: statistics.median(p["parts_units"].get(name, 0.0) for p in per_rank)
            for name in sorted({n for p in per_rank for n in p["parts_units"]})
        },
    }


def measured(rank: dict[str, Any]) -> dict[str, Any]:
    """One rank's counters from the end of warm-up to the end: CPU per step in units of the
    reference work's CPU time on the same thread (``control_plane_task._reference_work``),
    and counts per step or per second."""
    warm, end = rank["warm"], rank["end"]
    steps = end["steps"] - warm["steps"]
    seconds = end["time"] - warm["time"]
    main_ref = statistics.median(rank["main_ref_s"])
    watchdog_ref = statistics.median(rank["watchdog_ref_s"] or rank["main_ref_s"])

    def parts(at: dict[str, Any]) -> dict[str, float]:
        return {
            **{k.rsplit(".", 1)[-1]: v for k, v in at["main_cpu_by"].items()},
            **at["inner_cpu_by"],
        }

    before, after = parts(warm), parts(end)
    main_s = (end["main_cpu_s"] - warm["main_cpu_s"]) / steps
    watchdog_s = (
        (end["watchdog_cpu_s"] or 0.0)
        - (warm["watchdog_cpu_s"] or 0.0)
        - (end["watchdog_ref_cpu_s"] - warm["watchdog_ref_cpu_s"])
    ) / steps
    counts = {k: end["counts"].get(k, 0) - warm["counts"].get(k, 0) for k in end["counts"]}
    return {
        "main_units": main_s / main_ref,
        "watchdog_units": watchdog_s / watchdog_ref,
        "main_us": 1e6 * main_s,
        "watchdog_us": 1e6 * watchdog_s,
        "ref_us": 1e6 * main_ref,
        "store_ops": (end["store_ops"] - warm["store_ops"]) / steps,
        "per_s": {
            "store_calls": (end["store_ops"] - warm["store_ops"]) / seconds,
            **{name: counts.get(name, 0) / seconds for name in ("beats", "stamps", "syncs")},
        },
        "set_phase": counts.get("set_phase", 0) / steps,
        "step_s": seconds / steps,
        "parts_units": {k: (v - before.get(k, 0.0)) / steps / main_ref for k, v in after.items()},
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Several runs of one world size: each figure's median."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        if isinstance(value, dict):
            out[key] = median_row([row[key] for row in rows])
        elif isinstance(value, (int, float)):
            out[key] = statistics.median(row[key] for row in rows)
        else:
            out[key] = value
    return out


def kill_and_resume(scratch: Path, world: int, sleep_ms: float) -> dict[str, Any]:
    """kill -9 of one rank (not rank 0, which hosts the job's store): seconds until a rank
    names it, and until the restarted group trains again."""
    run_dir = scratch / f"kill-w{world}"
    config = write_config(scratch / f"kill-w{world}.toml", run_dir, world, 2000, sleep_ms)
    launch = Launch(config, world, "--max-restarts", "1", cwd=HERE)
    try:
        wait_for(run_dir, launch, lambda r: r.get("kind") == "train" and r["step"] >= 20, 1200)
        victims = [p for p in launch.workers() if rank_of(p) == world - 1]
        killed_wall, killed = time.time(), time.monotonic()
        os.kill(random.choice(victims), signal.SIGKILL)
        named = None
        deadline = killed + 600
        while named is None and time.monotonic() < deadline:
            named = launch.first(rf"rank {world - 1} \([^)]*\) died", since=killed)
            time.sleep(0.05)
        resumed = wait_for(
            run_dir,
            launch,
            lambda r: r.get("kind") == "event" and r.get("name") == "restart",
            1200,
        )
        again = wait_for(
            run_dir,
            launch,
            lambda r: r.get("kind") == "train" and r["time"] > resumed["time"],
            1200,
        )
    finally:
        launch.close()
    return {
        "named_s": (named[0] - killed) if named is not None else float("nan"),
        "restarted_s": resumed["time"] - killed_wall,
        "training_s": again["time"] - killed_wall,
    }


def ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def report(rows: list[dict[str, Any]], sleep_ms: float, steps: int, repeats: int) -> str:
    base = rows[0]
    unit_us = base["ref_us"]  # one unit, as the 2-rank runs measured it
    step_s = base["step_s"]  # the 2-rank step

    def watchdog(row: dict[str, Any]) -> float:
        # The watchdog works by the clock: its share of a step is its rate times the step's
        # length, counted at the 2-rank step (the steps here are longer at 32 ranks only
        # because 32 ranks share this machine's cores).
        return float(row["watchdog_units"] / row["step_s"] * step_s)

    def total(row: dict[str, Any]) -> float:
        return float(row["main_units"]) + watchdog(row)

    lines = [
        f"Per rank and step, steps 21-{steps} of each run ({repeats} run(s) per size, medians; "
        f"each forward sleeps {sleep_ms:.0f} ms). CPU time in the control plane, median rank, "
        "in units of a fixed piece of Python work timed on the same thread in the same run "
        f"(shown as microseconds at the 2-rank runs' speed: 1 unit = {unit_us:.0f} us); the "
        "watchdog's, which works by the clock, per second times the 2-rank step "
        f"({step_s * 1000:.0f} ms). Store calls of the busiest rank, per step likewise. Raw: "
        "the CPU time as measured, and the wall step time:",
        "",
        f"{'ranks':>5}  {'control plane':>13}  {'vs 2':>5}  {'training':>8}  {'(rank 0)':>8}  "
        f"{'watchdog':>8}  {'store calls':>11}  {'raw CPU':>8}  {'raw step':>8}",
    ]
    for row in rows:
        calls = row["per_s"]["store_calls"] * step_s
        lines.append(
            f"{row['world']:>5}  {total(row) * unit_us:>10.0f} us  "
            f"{ratio(total(row), total(base)):>5}  {row['main_units'] * unit_us:>5.0f} us  "
            f"{row['rank0_main_units'] * unit_us:>5.0f} us  {watchdog(row) * unit_us:>5.0f} us  "
            f"{calls:>11.2f}  {row['main_us'] + row['watchdog_us']:>5.0f} us  "
            f"{row['step_s'] * 1000:>5.0f} ms"
        )
    lines += [
        "",
        "Counted, per rank (the busiest): store calls, beats, liveness stamps and syncs per "
        "second of training; the training thread's set_phase calls per step:",
        "",
        f"{'ranks':>5}  {'store calls/s':>13}  {'beats/s':>7}  {'stamps/s':>8}  {'syncs/s':>7}  "
        f"{'phases/step':>11}",
    ]
    for row in rows:
        per_s = row["per_s"]
        lines.append(
            f"{row['world']:>5}  {per_s['store_calls']:>13.2f}  {per_s['beats']:>7.2f}  "
            f"{per_s['stamps']:>8.2f}  {per_s['syncs']:>7.2f}  {row['set_phase']:>11.1f}"
        )
    names = sorted({n for row in rows for n in row["parts_units"]})
    lines += [
        "",
        "The training thread's part by call (us per step at the 2-rank speed, median rank; "
        "gather_*, on_window: inside the balancer's hooks, once a timing window):",
        "",
        f"{'ranks':>5}  " + "  ".join(f"{n[:13]:>13}" for n in names),
    ]
    for row in rows:
        lines.append(
            f"{row['world']:>5}  "
            + "  ".join(f"{row['parts_units'].get(n, 0.0) * unit_us:>13.1f}" for n in names)
        )
    lines += [
        "",
        "Wall times (every rank shares this machine's cores: they grow with its load):",
        "",
        f"{'ranks':>5}  {'start-up':>9}  {'commit':>8}  {'kill -9 -> named':>16}  "
        f"{'-> restarted':>12}  {'-> training':>11}",
    ]
    for row in rows:
        lines.append(
            f"{row['world']:>5}  {row['startup_s']:>8.1f}s  {row['commit_s'] * 1000:>6.0f}ms  "
            f"{row.get('named_s', float('nan')):>15.1f}s  "
            f"{row.get('restarted_s', float('nan')):>11.1f}s  "
            f"{row.get('training_s', float('nan')):>10.1f}s"
        )
    return "\n".join([*lines, "", NOTES])


NOTES = """\
What a rank does for the control plane is the same at any size: each phase change is a few
stores into its liveness file's shared memory; its watchdog wakes 5 times a second, beats to
the job's store when a phase has lasted 0.2 s and once a second, reads rank 0's beat once a
second (ranks other than 0), and syncs its liveness file once a second. What grows with the
world, by design, is elsewhere: rank 0's store serves every rank's beats (about 3 calls per
rank per second); once a timing window (at least balance.every steps and balance.window_s)
every rank receives every rank's timing row (an all-gather of 88 bytes per rank) and rank 0
writes one `ranks` record of W entries; a checkpoint's commit gathers every rank's file list
on rank 0, which writes them into one marker; at start, gloo connects every rank to every
other. Start-up, commit and recovery times here are bounded by the machine: every process
imports torch and builds its model on the same cores."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", default="2,4,8,16,32")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--sleep-ms", type=float, default=100.0)
    parser.add_argument("--repeats", type=int, default=1, help="steady runs per size")
    parser.add_argument("--no-kill", action="store_true", help="skip the kill -9 runs")
    parser.add_argument("--write-doc", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    worlds = [int(w) for w in args.worlds.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="dtrain-control-plane-") as tmp:
        runs: dict[int, list[dict[str, Any]]] = {world: [] for world in worlds}
        for repeat in range(args.repeats):  # interleaved: a busy spell hits every size alike
            for world in worlds:
                scratch = Path(tmp) / f"r{repeat}"
                scratch.mkdir(exist_ok=True)
                runs[world].append(steady(scratch, world, args.steps, args.sleep_ms))
                print(json.dumps(runs[world][-1]), flush=True)
        for world in worlds:
            row = median_row(runs[world])
            if not args.no_kill:
                row.update(kill_and_resume(Path(tmp), world, args.sleep_ms))
            rows.append(row)
            print(json.dumps({"row": row}), flush=True)
    text = report(rows, args.sleep_ms, args.steps, args.repeats)
    print(text)
    print(machine_line())
    if args.write_doc:
        path = write_report_section(
            "control-plane", "The control plane from 2 to 32 ranks", text, "one machine"
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
