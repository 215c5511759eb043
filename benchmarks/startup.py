"""Start-up: where a small job's wall time goes before its first step, and a whole 60-step GPT-2
command of dtrain against Hugging Face Accelerate's, side by side in interleaved rounds.

    .venv/bin/python benchmarks/startup.py --rounds 5 --accelerate-python .venv-peers/bin/python
    .venv/bin/python benchmarks/startup.py --rounds 5 --write-docs

Runners, alternated (A B C D, then D C B A, ...) over ``--rounds``:

- ``spirals``: ``dtrain train examples/spirals.toml --nproc 2`` (the README's example, as it
  comes): the command's wall time, and from the command's start to the workers' ``start``
  record (the trainer built: imports, rendezvous, config agreement, model and strategy) and to
  the end of the first optimizer step (its ``first_step`` event).
- ``gpt2-dtrain``: ``dtrain train examples/hf_gpt2.toml --nproc 2 --train.steps=60
  --eval.every=0``: 60 steps of a Hugging Face GPT-2, then the final evaluation, the greedy
  continuation and the checkpoint that every dtrain run ends with.
- ``gpt2-accelerate``: the same job written for Accelerate (``startup_accelerate.py``: the same
  model, data, optimizer, global batch and steps, then a validation pass, the continuation and
  ``save_model``), started by ``torchrun`` with ``--accelerate-python`` (a venv holding
  ``accelerate``: see docs/benchmarks.md, "Notes on peers.py"); skipped where it is missing.
- ``imports``: what the parent process imports before it starts a worker (``dtrain.cli`` and
  the launcher, torch included), and ``import torch`` alone, each in a fresh interpreter.

A ratio is the median over rounds of the ratio of the same round (the machine's load moves
both sides of a round alike); every round is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine_line, update_section

SECTION = "bench_startup"
STEPS = 60
RUNNERS = ("spirals", "gpt2-dtrain", "gpt2-accelerate", "imports")
# What `dtrain train` imports in the parent before its launcher starts a worker.
PARENT_IMPORTS = "import dtrain.cli, dtrain.cli.train, dtrain.launch.launcher"


@dataclass
class Timing:
    wall_s: float  # the command, from its start to its exit
    start_s: float = float("nan")  # to the workers' `start` record (dtrain only)
    first_step_s: float = float("nan")  # to the end of the first optimizer step


class RunFailed(RuntimeError):
    pass


def run(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """Run ``cmd`` from the repository root; (its wall-clock start as time.time(), wall s)."""
    started_at, started = time.time(), time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RunFailed(f"{' '.join(cmd)}: exit code {done.returncode}\n{done.stderr[-3000:]}")
    return started_at, wall


def dtrain_job(config: str, run_dir: Path, extra: list[str]) -> Timing:
    cmd = [sys.executable, "-m", "dtrain", "train", config, "--nproc", "2", f"--run.dir={run_dir}"]
    started_at, wall = run([*cmd, *extra], dict(os.environ))
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r.get("kind") == "start")
    first = next(r for r in records if r.get("kind") == "event" and r["name"] == "first_step")
    return Timing(wall, start["time"] - started_at, first["time"] - started_at)


def accelerate_job(python: str, out: Path) -> Timing:
    out.mkdir(parents=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    script = str(Path(__file__).resolve().parent / "startup_accelerate.py")
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    started_at, wall = run([*cmd, script, str(out), str(STEPS)], env)
    first = json.loads((out / "first_step.json").read_text())["time"]
    return Timing(wall, first_step_s=first - started_at)


def import_time(statement: str) -> float:
    """Wall seconds of a fresh interpreter that runs ``statement`` and exits."""
    return run([sys.executable, "-c", statement], dict(os.environ))[1]


def has_accelerate(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import accelerate"], capture_output=True)
    return probe.returncode == 0


def one(runner: str, scratch: Path, args: argparse.Namespace) -> dict[str, float]:
    folder = Path(tempfile.mkdtemp(prefix=f"{runner}-", dir=scratch))
    shutil.rmtree(folder)
    if runner == "spirals":
        t = dtrain_job("examples/spirals.toml", folder, [])
    elif runner == "gpt2-dtrain":
        extra = [f"--train.steps={STEPS}", "--eval.every=0"]
        t = dtrain_job("examples/hf_gpt2.toml", folder, extra)
    elif runner == "gpt2-accelerate":
        t = accelerate_job(args.accelerate_python, folder)
    else:
        return {"parent_s": import_time(PARENT_IMPORTS), "torch_s": import_time("import torch")}
    return {"wall_s": t.wall_s, "start_s": t.start_s, "first_step_s": t.first_step_s}


def fmt(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def ratios(rounds: list[dict[str, dict[str, float]]], a: str, b: str, key: str) -> list[float]:
    return [r[a][key] / r[b][key] for r in rounds if a in r and b in r]


def report(rounds: list[dict[str, dict[str, float]]], runners: list[str]) -> list[str]:
    def column(runner: str, key: str) -> list[float]:
        return [r[runner][key] for r in rounds if runner in r]

    lines = [
        "| measure | median (s) | rounds (s) |",
        "|---|---:|---:|",
    ]
    rows = [
        ("spirals", "wall_s", "`dtrain train examples/spirals.toml --nproc 2`: whole command"),
        ("spirals", "start_s", "  to the workers' trainer built (`start` record)"),
        ("spirals", "first_step_s", "  to its first step's end"),
        ("gpt2-dtrain", "wall_s", f"GPT-2, {STEPS} steps, dtrain: whole command"),
        ("gpt2-dtrain", "first_step_s", "  to its first step's end"),
        ("gpt2-accelerate", "wall_s", f"GPT-2, {STEPS} steps, Accelerate: whole command"),
        ("gpt2-accelerate", "first_step_s", "  to its first step's end"),
        ("imports", "parent_s", f"parent's imports (`python -c '{PARENT_IMPORTS}'`)"),
        ("imports", "torch_s", "`python -c 'import torch'`"),
    ]
    for runner, key, label in rows:
        if runner in runners:
            values = column(runner, key)
            lines.append(f"| {label} | {statistics.median(values):.2f} | {fmt(values)} |")
    if "gpt2-dtrain" in runners and "gpt2-accelerate" in runners:
        lines.append("")
        for key, what in (("wall_s", "whole command"), ("first_step_s", "to the first step")):
            values = ratios(rounds, "gpt2-dtrain", "gpt2-accelerate", key)
            target = "; target 1.1x" if key == "wall_s" else ""
            lines.append(
                f"GPT-2, {what}: dtrain / Accelerate **{statistics.median(values):.3f}x** "
                f"(rounds {fmt(values)}{target})  "
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument(
        "--accelerate-python",
        default=str(ROOT / ".venv-peers" / "bin" / "python"),
        help="an interpreter whose environment holds accelerate (and this torch)",
    )
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    runners = [r for r in args.runners.split(",") if r]
    unknown = sorted(set(runners) - set(RUNNERS))
    if unknown:
        raise SystemExit(f"--runners: unknown {unknown}; choose from {', '.join(RUNNERS)}")
    skipped = ""
    python = args.accelerate_python
    if "gpt2-accelerate" in runners and not (Path(python).exists() and has_accelerate(python)):
        skipped = f"gpt2-accelerate skipped: no accelerate in {python}"
        print(skipped, flush=True)
        runners.remove("gpt2-accelerate")
    scratch = Path(tempfile.mkdtemp(prefix="dtrain-startup-"))
    rounds: list[dict[str, dict[str, float]]] = []
    started = time.perf_counter()
    try:
        for index in range(args.rounds):
            order = runners if index % 2 == 0 else runners[::-1]
            results: dict[str, dict[str, float]] = {}
            for runner in order:
                results[runner] = one(runner, scratch, args)
                shown = ", ".join(f"{k} {v:.2f}" for k, v in results[runner].items() if v == v)
                print(f"round {index} {runner}: {shown}", flush=True)
            rounds.append(results)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    lines = report(rounds, runners)
    print("\n".join(lines))
    if args.write_docs:
        minutes = (time.perf_counter() - started) / 60
        body = [
            "## Start-up: a small job's wall time, and GPT-2 against Accelerate (`startup.py`)",
            "",
            f"Command: `{command_line()}` ({minutes:.0f} min)  ",
            f"Machine: {machine_line()}  ",
            f"Date: {time.strftime('%Y-%m-%d')}  ",
            *([f"{skipped}  "] if skipped else []),
            "",
            f"{args.rounds} interleaved rounds; every round's figure is given.",
            "",
            *lines,
        ]
        print(f"wrote {update_section(SECTION, chr(10).join(body))}")


if __name__ == "__main__":
    main()
