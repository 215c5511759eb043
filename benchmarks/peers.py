"""dtrain against the tools a user would pick instead: a hand-written PyTorch DDP loop, Hugging
Face Accelerate and Lightning Fabric, measured side by side on this machine in one run.

    .venv/bin/python benchmarks/peers.py                    # dtrain rows and the raw loop only
    .venv-peers/bin/python benchmarks/peers.py --write-docs # every row (see docs/benchmarks.md)

Every runner trains the same model from the same initial weights (one state dict), on the same
data in memory, in the same order and per-rank split (dtrain's partition of its seeded stream,
written out per step and rank for the others), with the same optimizer (AdamW, constant LR, no
weight decay, no clipping), global batch, seed and step count, on 2 processes of 1 thread each
under torch's elastic launcher: ``torchrun`` for the raw loop (``peer_raw.py``), Accelerate
(``peer_accelerate.py``) and Fabric (``peer_fabric.py``); ``dtrain train --run.task=...`` for
dtrain's ``ddp`` and ``allreduce``, and with ``--run.script=peer_own_loop.py`` for the same
task in a loop of the user's own (``dtrain.Run``), as a user runs it (the CLI, reading its
``metrics.jsonl``: what dtrain costs includes its launcher, its loop and its defaults, which a
call to ``Trainer.fit`` in a test harness would leave out). Every runner sums gradients through
gloo on loopback (dtrain's default ``comm.transport = "backend"``); dtrain's task declares
nothing, as the README's does, except in the row that declares ``Task.items_per_sample``.

Runners alternate (A B C D E, then E D C B A, ...) over ``--repeats`` rounds. A run reports, for
each rank, the end time of every optimizer step (a global post-hook on ``Optimizer.step``: the
same clock for everyone), the process's CPU time at each, and its peak resident memory
(``ru_maxrss``). Step time: rank 0's median time between consecutive step ends after
``--warmup`` steps; CPU per step likewise (all of the process's threads: steadier than wall
time when other jobs share the machine). A ratio is the median over rounds of the ratio to the
raw loop of the same round.

All runners must reach the same loss: the mean training loss of every ``log_every`` window
(dtrain's metrics lines) and the final validation loss agree with the raw loop's within
``--tolerance``, or the script refuses to print a table. A peer whose package is missing is
reported and its row skipped.

Weak scaling: per-worker throughput at 2 workers over 1 worker (the same per-worker batch, 1
thread each), for the raw loop and dtrain ``ddp`` (also through shared memory, and with
``dist.pin_cores = true``, to show what binding each worker to its own core gives), with the
launcher's own CPU use while the workers train (sampled from ``/proc``). One more row launches
two separate 1-worker dtrain jobs at once, which share nothing but the machine: their
efficiency is this machine's ceiling for any 2-worker run (the slower job's median step while
both train, against one job alone).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import peer_task as common
from _report import ROOT, command_line, machine, update_section
from dtrain.data.partition import OrderSpec, plan_steps

HERE = Path(__file__).resolve().parent
SECTION = "bench_peers"
RUNNERS = ("raw", "ddp", "own-loop", "ddp-declared", "allreduce", "accelerate", "fabric")
# Which package each peer needs; dtrain's rows and the raw loop need only torch.
PACKAGES = {"accelerate": "accelerate", "fabric": "lightning"}
SCRIPTS = {"raw": "peer_raw.py", "accelerate": "peer_accelerate.py", "fabric": "peer_fabric.py"}
# dtrain's runners: the strategy, then any other config the run gets. The task declares
# nothing, as the README's does, unless the runner says so.
DTRAIN = {
    "ddp": ["ddp"],
    "allreduce": ["allreduce"],
    "ddp-declared": ["ddp", "--task.declare_items=true"],  # Task.items_per_sample given
    # The same task in a loop of the user's own (dtrain.Run), under ddp.
    "own-loop": ["ddp", f"--run.script={HERE / 'peer_own_loop.py'}"],
    # Gradients summed through a shared-memory segment (dtrain.ext.shm, opt-in).
    "ddp-shm": ["ddp", "--comm.transport=auto"],
    "ddp-pinned": ["ddp", "--dist.pin_cores=true"],  # weak scaling: what binding gives
}
LABELS = {
    "raw": "raw PyTorch DDP loop (peer_raw.py)",
    "ddp": "dtrain ddp",
    "own-loop": "dtrain own loop (dtrain.Run, ddp; peer_own_loop.py)",
    "allreduce": "dtrain allreduce",
    "accelerate": "Hugging Face Accelerate",
    "fabric": "Lightning Fabric",
    "ddp-declared": "dtrain ddp, Task.items_per_sample declared",
    "ddp-shm": "dtrain ddp, comm.transport = auto (shared memory)",
    "ddp-pinned": "dtrain ddp, dist.pin_cores = true",
    "ddp-apart": "two 1-worker dtrain jobs at once, nothing shared (this machine's ceiling)",
}

# The models: the default job's GPT (dtrain.tasks.gpt's defaults) and a small MLP.
MODELS: dict[str, dict[str, Any]] = {
    "gpt": {
        "model": {
            "kind": "gpt",
            "gpt": {"vocab_size": 256, "seq_len": 128, "n_layer": 3, "n_head": 4, "d_model": 192},
        },
        "global_batch": 32,
        "steps": 80,
        "train_samples": 4096,
        "val_samples": 256,
    },
    # The README's own-model task (peer_task.ByteGPT and peer_task.Windows): a byte-level GPT
    # the user wrote, returning logits, over a map-style Dataset of windows of one byte
    # stream (views, collated by the loader), per-token unreduced cross-entropy.
    "readme": {
        "model": {
            "kind": "readme",
            "gpt": {"seq_len": 64, "n_layer": 4, "n_head": 4, "d_model": 128},
        },
        "global_batch": 32,
        "steps": 120,
        "train_samples": 4096,
        "val_samples": 256,
    },
    "mlp": {
        "model": {"kind": "mlp", "inputs": 64, "width": 256, "depth": 3, "classes": 10},
        "global_batch": 256,
        # 80 steps of 4-5 ms are 0.35 s of training: one busy moment of this shared machine
        # moved a round by up to 0.3x; 400 steps keep a round's median steadier.
        "steps": 400,
        "train_samples": 32768,
        "val_samples": 2048,
    },
}
OPTIM = {"lr": 1e-3, "betas": [0.9, 0.95]}


# -- preparing what every runner reads --------------------------------------------------------


def stdlib_bytes(count: int) -> torch.Tensor:
    """The first ``count`` bytes of the standard library's sources, in file-name order."""
    chunks, total = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= count:
            break
    raw = b"".join(chunks)[:count]
    if len(raw) < count:
        raise SystemExit(f"the standard library holds only {len(raw)} bytes of sources")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()


def make_data(setup: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    train_n, val_n = setup["train_samples"], setup["val_samples"]
    model = setup["model"]
    if model["kind"] == "gpt":
        width = model["gpt"]["seq_len"] + 1
        windows = stdlib_bytes((train_n + val_n) * width).view(-1, width)
        x, y = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
    elif model["kind"] == "readme":
        # Two byte streams, cut into windows by the dataset itself (peer_task.Windows).
        seq_len = model["gpt"]["seq_len"]
        stream = stdlib_bytes((train_n + val_n) * seq_len + 2)
        cut = train_n * seq_len + 1
        return {"train_stream": stream[:cut].clone(), "val_stream": stream[cut:].clone()}
    else:
        # Labels from a fixed random teacher: a task the MLP can learn.
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(train_n + val_n, model["inputs"], generator=gen)
        teacher = torch.randn(model["inputs"], model["classes"], generator=gen)
        y = torch.tanh(x @ teacher).argmax(dim=1)
    return {
        "train_x": x[:train_n],
        "train_y": y[:train_n],
        "val_x": x[train_n:],
        "val_y": y[train_n:],
    }


def prepare(scratch: Path, name: str, steps: int, seed: int, worlds: list[int]) -> dict[str, Any]:
    """Write the scratch folder every runner of one model reads (see peer_task.py)."""
    setup = MODELS[name]
    scratch.mkdir(parents=True, exist_ok=True)
    spec = {"name": name, "model": setup["model"], "optim": OPTIM, "steps": steps, "seed": seed}
    (scratch / common.SPEC).write_text(json.dumps(spec))
    torch.save(make_data(setup, seed), scratch / common.DATA)
    torch.manual_seed(seed)
    torch.save(common.build_model(spec).state_dict(), scratch / common.INIT)
    per_worker = setup["global_batch"] // 2
    order = OrderSpec(num_samples=setup["train_samples"], seed=seed, shuffle="full")
    for world in worlds:
        # dtrain's own plan of its stream at this world size: (steps, ranks, per-rank batch).
        plans = plan_steps(order, 0, steps, per_worker * world, world, 1)
        ids = np.stack([np.stack([p.rank_ids(rank)[0] for rank in range(world)]) for p in plans])
        torch.save(torch.from_numpy(ids).long(), scratch / common.plan_file(world))
    return spec


# -- running ----------------------------------------------------------------------------------


@dataclass
class Result:
    runner: str
    world: int
    step_s: float  # rank 0's median step time after warm-up
    peak_rss_kib: list[int]  # per rank
    wall_s: float  # the whole launch, from the command to its exit
    launcher_share: float  # the launcher's own CPU while the workers trained, of one core
    window_losses: list[float]  # mean training loss of every log_every window
    val_loss: float
    step_cpu_s: list[float] = field(default_factory=list)  # per rank, median CPU time a step
    step_ends: list[float] = field(default_factory=list)  # rank 0's, time.perf_counter()


class RunFailed(RuntimeError):
    pass


@dataclass
class Launch:
    wall_s: float  # from the command to its exit
    samples: list[tuple[float, float]]  # (perf_counter, the launcher's own CPU seconds)


def process_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) a process has used itself, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_command(cmd: list[str], env: dict[str, str]) -> Launch:
    """Run ``cmd`` (a launcher) to its end, sampling the launcher's own CPU time (perf_counter
    is one clock for every process of the machine, so the samples line up with the step times
    the workers report)."""
    started = time.perf_counter()
    samples: list[tuple[float, float]] = []
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        while proc.poll() is None:
            cpu = process_cpu_s(proc.pid)
            if cpu is not None:
                samples.append((time.perf_counter(), cpu))
            time.sleep(0.1)
        wall = time.perf_counter() - started
        out.seek(0)
        text = out.read()
    if proc.returncode != 0:
        raise RunFailed(f"exit code {proc.returncode}:\n{text[-3000:]}")
    return Launch(wall, samples)


def launcher_share(launch: Launch, first: float, last: float) -> float:
    """The launcher's CPU use while the workers trained (between two step ends), as a share of
    one core."""
    inside = [(t, c) for t, c in launch.samples if first <= t <= last]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH")) if p)
    return env


def run_once(
    runner: str, scratch: Path, spec: dict[str, Any], world: int, run_dir: Path, args: Any
) -> Result:
    """One launch of ``runner`` on ``world`` processes; what its ranks reported."""
    global_batch = MODELS[spec["name"]]["global_batch"] // 2 * world
    prefix = run_dir / "peer"  # each rank writes prefix-rankN.json (peer_task.report_path)
    if runner in DTRAIN:
        cmd = [
            sys.executable,
            "-m",
            "dtrain",
            "train",
            "--nproc",
            str(world),
            f"--run.dir={run_dir}",
            "--run.task=peer_task:build",
            f"--task.scratch={scratch}",
            f"--run.seed={spec['seed']}",
            f"--strategy.name={DTRAIN[runner][0]}",
            *DTRAIN[runner][1:],
            f"--data.global_batch_size={global_batch}",
            f"--train.steps={spec['steps']}",
            "--train.grad_clip=0",
            f"--train.log_every={args.log_every}",
            f"--optim.lr={OPTIM['lr']}",
            "--optim.betas=[" + ",".join(str(b) for b in OPTIM["betas"]) + "]",
            "--optim.weight_decay=0",
            "--optim.warmup_steps=0",
            "--optim.min_lr_ratio=1",
            "--eval.every=0",
            "--checkpoint.every=0",
            "--dist.threads=1",
        ]
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(world),
            str(HERE / SCRIPTS[runner]),
            str(scratch),
            str(prefix),
        ]
    launch = run_command(cmd, child_env())
    reports = [json.loads(common.report_path(prefix, r).read_text()) for r in range(world)]
    if runner in DTRAIN:
        records = [
            json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        ]
        windows = [float(r["loss"]) for r in records if r.get("kind") == "train"]
        summary = next(r for r in records if r.get("kind") == "summary")
        # An own loop's evaluation is its own (run.evaluate), logged before the summary.
        evals = [r["val_loss"] for r in records if r.get("kind") == "eval"]
        val_loss = float(summary["val_loss"] if summary.get("val_loss") is not None else evals[-1])
    else:
        losses = reports[0]["step_losses"]
        windows = [
            statistics.fmean(losses[i : i + args.log_every])
            for i in range(0, len(losses), args.log_every)
        ]
        val_loss = float(reports[0]["val_loss"])
    ends = reports[0]["step_ends"]
    return Result(
        runner=runner,
        world=world,
        step_s=common.median_step_s(ends, args.warmup),
        peak_rss_kib=[int(r["peak_rss_kib"]) for r in reports],
        wall_s=launch.wall_s,
        launcher_share=launcher_share(launch, ends[min(args.warmup, len(ends) - 1)], ends[-1]),
        window_losses=windows,
        val_loss=val_loss,
        step_cpu_s=[common.median_step_s(r["cpu_ends"], args.warmup) for r in reports],
        step_ends=list(ends),
    )


def run_apart(scratch: Path, spec: dict[str, Any], run_dirs: list[Path], args: Any) -> Result:
    """Two 1-worker dtrain ``ddp`` jobs launched at once, sharing nothing but the machine: the
    slower job's median step over the steps both ended while the other trained (perf_counter
    is one clock for every process); the first job's result otherwise."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        jobs = [pool.submit(run_retrying, "ddp", scratch, spec, 1, d, args) for d in run_dirs]
        results = [job.result() for job in jobs]
    after_warmup = [r.step_ends[args.warmup :] for r in results]
    start = max(ends[0] for ends in after_warmup)
    stop = min(ends[-1] for ends in after_warmup)
    medians = []
    for ends in after_warmup:
        inside = [t for t in ends if start <= t <= stop]
        gaps = [b - a for a, b in itertools.pairwise(inside)]
        if len(gaps) < 10:
            raise RunFailed(f"the two jobs trained together for {len(gaps)} steps only")
        medians.append(statistics.median(gaps))
    return replace(results[0], runner="ddp-apart", world=2, step_s=max(medians))


def run_retrying(
    runner: str, scratch: Path, spec: dict[str, Any], world: int, run_dir: Path, args: Any
) -> Result:
    """:func:`run_once`, launched a second time after a failure: torch's processes now and then
    abort at exit ("terminate called without an active exception", seen with the raw loop and
    Accelerate), which would drop a row or end the benchmark over a crash after training.
    Only a fresh launch's figures are used; a second failure is the caller's to handle."""
    try:
        return run_once(runner, scratch, spec, world, run_dir, args)
    except RunFailed as exc:
        lines = str(exc).splitlines()
        cause = next((line for line in lines if "terminate called" in line), lines[0])
        print(f"{LABELS[runner]} failed ({cause.strip()}); launching it once more", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
        return run_once(runner, scratch, spec, world, run_dir, args)


def missing_package(runner: str) -> str | None:
    package = PACKAGES.get(runner)
    if package is not None and importlib.util.find_spec(package) is None:
        return package
    return None


# -- checking and reporting -------------------------------------------------------------------


def loss_gap(result: Result, baseline: Result) -> float:
    """The largest difference between two runs' window losses and final validation losses."""
    if len(result.window_losses) != len(baseline.window_losses):
        return float("inf")
    pairs = [
        *zip(result.window_losses, baseline.window_losses),
        (result.val_loss, baseline.val_loss),
    ]
    return max(abs(a - b) for a, b in pairs)


def check_same_training(results: list[Result], tolerance: float, what: str) -> float:
    """Refuse (exit) when any run's losses differ from the raw loop's beyond ``tolerance``."""
    baseline = next(r for r in results if r.runner == "raw")
    worst = 0.0
    for result in results:
        gap = loss_gap(result, baseline)
        worst = max(worst, gap)
        if gap > tolerance:
            raise SystemExit(
                f"{what}: {LABELS[result.runner]} did not train the same thing as the raw loop: "
                f"its losses differ by {gap:.3g} (tolerance {tolerance:g}); windows "
                f"{_fmt(result.window_losses)} val {result.val_loss:.6f} against the raw loop's "
                f"{_fmt(baseline.window_losses)} val {baseline.val_loss:.6f}. No table printed: "
                "a comparison of runs that trained different things would mislead."
            )
    return worst


def _fmt(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.6f}" for v in values) + "]"


def mib(kib: float) -> float:
    return kib / 1024


def table(name: str, rounds: list[dict[str, Result]], skipped: dict[str, str]) -> list[str]:
    runners = [r for r in dict.fromkeys([*RUNNERS, *DTRAIN]) if r in rounds[0]]
    lines = [
        "| runner | step time, median (ms) | x raw loop (rounds) | CPU per step, rank 0 (ms) "
        "| peak RSS per rank (MiB) | x raw loop | launch wall (s) | final val loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    raw_rss = [max(r["raw"].peak_rss_kib) for r in rounds]
    for runner in runners:
        step = statistics.median(r[runner].step_s for r in rounds)
        ratios = [r[runner].step_s / r["raw"].step_s for r in rounds]
        rss = [max(r[runner].peak_rss_kib) for r in rounds]
        per_rank = " / ".join(
            f"{mib(statistics.median(r[runner].peak_rss_kib[k] for r in rounds)):.0f}"
            for k in range(len(rounds[0][runner].peak_rss_kib))
        )
        rss_ratio = statistics.median(a / b for a, b in zip(rss, raw_rss))
        wall = statistics.median(r[runner].wall_s for r in rounds)
        cpu = statistics.median(r[runner].step_cpu_s[0] for r in rounds)
        lines.append(
            f"| {LABELS[runner]} | {step * 1e3:.2f} | **{statistics.median(ratios):.3f}x** "
            f"({', '.join(f'{x:.3f}' for x in ratios)}) | {cpu * 1e3:.2f} | {per_rank} "
            f"| {rss_ratio:.3f}x | {wall:.1f} | {rounds[-1][runner].val_loss:.6f} |"
        )
    for runner, why in skipped.items():
        lines.append(f"| {LABELS[runner]} | skipped: {why} | | | | | | |")
    return lines


def scaling_lines(name: str, rounds: list[dict[str, Result]]) -> list[str]:
    lines = [
        "| runner | step time, 1 worker (ms) | step time, 2 workers (ms) | efficiency "
        "(per-worker throughput 2/1; rounds) | launcher's CPU while 2 workers train |",
        "|---|---:|---:|---:|---:|",
    ]
    for runner in ("raw", "ddp", "ddp-shm", "ddp-pinned", "ddp-apart"):
        # One worker: nothing to bind and nothing to send (its share is every core, and a
        # transport carries nothing): the same run as ddp's.
        one = [r[f"{'raw' if runner == 'raw' else 'ddp'}-1"].step_s for r in rounds]
        two = [r[f"{runner}-2"].step_s for r in rounds]
        eff = [a / b for a, b in zip(one, two)]
        launcher = statistics.median(r[f"{runner}-2"].launcher_share for r in rounds)
        lines.append(
            f"| {LABELS[runner]} | {statistics.median(one) * 1e3:.2f} | "
            f"{statistics.median(two) * 1e3:.2f} | **{statistics.median(eff):.3f}** "
            f"({', '.join(f'{x:.3f}' for x in eff)}) | {share(launcher)} |"
        )
    return lines


def share(value: float) -> str:
    return "n/a (too short to sample)" if value != value else f"{value:.1%} of a core"


def versions() -> str:
    """The peers' versions (machine() names torch's)."""
    parts = []
    for package in ("accelerate", "lightning"):
        try:
            from importlib.metadata import version

            parts.append(f"{package} {version(package)}")
        except Exception:
            parts.append(f"{package} not installed")
    return ", ".join(parts)


# -- main -------------------------------------------------------------------------------------


def steps_of(model: str, args: Any) -> int:
    """Optimizer steps of every run of ``model``: ``--steps``, else the model's own."""
    return int(args.steps or MODELS[model]["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="readme,gpt,mlp", help="comma-separated: readme, gpt, mlp"
    )
    parser.add_argument("--runners", default=",".join(RUNNERS), help="comma-separated runners")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every runner")
    parser.add_argument(
        "--steps", type=int, default=0, help="optimizer steps per run (0: gpt 80, mlp 400)"
    )
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the median")
    parser.add_argument("--log-every", type=int, default=10, help="dtrain's train.log_every")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest loss difference")
    parser.add_argument("--scaling", default="gpt", help="models for weak scaling ('' = none)")
    # Five: one launch to the next moves a GPT step by up to 5% on this shared machine, which
    # moves one round's efficiency by as much; the median of 3 rounds moved by 0.04 between
    # runs of this script (docs/benchmarks.md).
    parser.add_argument("--scaling-repeats", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the scratch folder")
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    models = [m for m in args.models.split(",") if m]
    wanted = [r for r in args.runners.split(",") if r]
    for name in [*models, *[m for m in args.scaling.split(",") if m]]:
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    choices = [*RUNNERS, *(r for r in DTRAIN if r not in RUNNERS)]
    unknown = [r for r in wanted if r not in choices]
    if unknown or "raw" not in wanted:
        raise SystemExit(f"--runners: choose from {', '.join(choices)}, raw included")
    skipped: dict[str, str] = {}
    for runner in wanted:
        package = missing_package(runner)
        if package is not None:
            skipped[runner] = (
                f"`{package}` is not installed in {sys.executable} "
                "(pip install -e '.[peers]' in a separate venv, see docs/benchmarks.md)"
            )
            print(f"{LABELS[runner]}: skipped, {skipped[runner]}", flush=True)
    runners = [r for r in wanted if r not in skipped]
    scratch_root = Path(tempfile.mkdtemp(prefix="dtrain-peers-"))
    report: list[str] = []
    started = time.perf_counter()
    try:
        for name in models:
            scratch = scratch_root / name
            spec = prepare(scratch, name, steps_of(name, args), args.seed, [1, 2])
            rounds: list[dict[str, Result]] = []
            failed: dict[str, str] = {}
            for index in range(args.repeats):
                order = runners if index % 2 == 0 else runners[::-1]
                results: dict[str, Result] = {}
                for runner in order:
                    if runner in failed:
                        continue
                    run_dir = scratch_root / f"{name}-{runner}-{index}"
                    try:
                        results[runner] = run_retrying(runner, scratch, spec, 2, run_dir, args)
                    except RunFailed as exc:
                        if runner == "raw" or runner in DTRAIN:
                            raise SystemExit(f"{LABELS[runner]} failed: {exc}") from None
                        failed[runner] = f"failed ({str(exc).splitlines()[0]})"
                        print(f"{LABELS[runner]} failed: {exc}", flush=True)
                        continue
                    shutil.rmtree(run_dir, ignore_errors=True)
                    r = results[runner]
                    print(
                        f"{name} round {index} {runner}: {r.step_s * 1e3:.2f} ms/step "
                        f"({r.step_cpu_s[0] * 1e3:.2f} ms CPU), peak RSS "
                        f"{'/'.join(f'{mib(k):.0f}' for k in r.peak_rss_kib)} MiB, wall "
                        f"{r.wall_s:.1f} s, val loss {r.val_loss:.6f}",
                        flush=True,
                    )
                for runner in failed:
                    results.pop(runner, None)
                worst = check_same_training(list(results.values()), args.tolerance, name)
                rounds.append(results)
            for runner in failed:
                for r in rounds:
                    r.pop(runner, None)
            gpt = spec["model"].get("gpt")
            kind = "the README's own GPT" if spec["model"]["kind"] == "readme" else "GPT"
            shape = (
                f"{kind}, {gpt['n_layer']} layers, d_model {gpt['d_model']}, seq {gpt['seq_len']}"
                if gpt
                else f"MLP {spec['model']['inputs']}-{spec['model']['width']}x"
                f"{spec['model']['depth']}-{spec['model']['classes']}"
            )
            params = sum(p.numel() for p in common.build_model(spec).parameters())
            report += [
                f"### {name}: {shape} ({params / 1e6:.2f} M parameters), global batch "
                f"{MODELS[name]['global_batch']}, {steps_of(name, args)} steps (median after "
                f"{args.warmup}), {args.repeats} rounds",
                "",
                *table(name, rounds, {**skipped, **failed}),
                "",
                f"Every run's window losses and final validation loss agree with the raw "
                f"loop's of its round within {worst:.2g} (tolerance {args.tolerance:g}).",
                "",
            ]
            print("\n".join(report[-(len(runners) + len(skipped) + 7) :]), flush=True)
        for name in [m for m in args.scaling.split(",") if m]:
            scratch = scratch_root / name
            if not (scratch / common.SPEC).exists():
                prepare(scratch, name, steps_of(name, args), args.seed, [1, 2])
            spec = common.load_spec(scratch)
            scaling: list[dict[str, Result]] = []
            for index in range(args.scaling_repeats):
                results = {}
                keys = [
                    ("raw", 1),
                    ("raw", 2),
                    ("ddp", 1),
                    ("ddp", 2),
                    ("ddp-shm", 2),
                    ("ddp-pinned", 2),
                    ("ddp-apart", 2),
                ]
                for runner, world in keys if index % 2 == 0 else keys[::-1]:
                    run_dir = scratch_root / f"scale-{name}-{runner}-{world}-{index}"
                    if runner == "ddp-apart":
                        dirs = [run_dir / "a", run_dir / "b"]
                        r = run_apart(scratch, spec, dirs, args)
                    else:
                        r = run_retrying(runner, scratch, spec, world, run_dir, args)
                    shutil.rmtree(run_dir, ignore_errors=True)
                    results[f"{runner}-{world}"] = r
                    print(
                        f"scaling {name} round {index} {runner} x{world}: "
                        f"{r.step_s * 1e3:.2f} ms/step, launcher {share(r.launcher_share)}, "
                        f"wall {r.wall_s:.1f} s",
                        flush=True,
                    )
                two = ["ddp-2", "ddp-shm-2", "ddp-pinned-2"]  # not ddp-apart: 1 worker's batch
                for world, runs in ((1, ["ddp-1", "ddp-apart-2"]), (2, two)):
                    same = [results[f"raw-{world}"], *(results[k] for k in runs)]
                    check_same_training(same, args.tolerance, f"{name} at {world} worker(s)")
                scaling.append(results)
            per_worker = MODELS[name]["global_batch"] // 2
            report += [
                f"### Weak scaling: {name}, {per_worker} samples per worker, 1 thread each, "
                f"{args.scaling_repeats} rounds",
                "",
                *scaling_lines(name, scaling),
                "",
            ]
            print("\n".join(report[-6:]), flush=True)
    finally:
        if args.keep:
            print(f"scratch folder kept: {scratch_root}")
        else:
            shutil.rmtree(scratch_root, ignore_errors=True)
    minutes = (time.perf_counter() - started) / 60
    if args.write_docs:
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        body = "\n".join(
            [
                "## dtrain against a raw DDP loop, Accelerate and Lightning Fabric (`peers.py`)",
                "",
                f"Command: `{command_line()}` ({minutes:.0f} min)  ",
                f"Machine: {machine()}; {versions()}; load average {load} when it finished  ",
                f"Date: {time.strftime('%Y-%m-%d')}",
                "",
                "Every runner: the same initial weights, data in memory, per-rank sample ids "
                "(dtrain's partition), AdamW (foreach, constant LR, no weight decay, no "
                "clipping), 2 processes of 1 thread each (gloo on loopback, CPU) started by "
                "torch's elastic launcher (`torchrun`; `dtrain train --run.task=peer_task:build` "
                "for dtrain, whose task declares nothing unless the row says so), gradients "
                "summed by gloo (dtrain's default `comm.transport`). The raw "
                "loop, Accelerate and Fabric read through a torch `DataLoader` with the plan "
                "as its batch "
                "sampler. Step time: rank 0's median time between the ends of consecutive "
                "optimizer steps; CPU per step: rank 0's process, all threads; peak RSS: each "
                "rank's `ru_maxrss`; ratios: the median over rounds of the ratio to the raw "
                "loop of the same round.",
                "",
                *report,
            ]
        )
        print(f"wrote {update_section(SECTION, body)}")


if __name__ == "__main__":
    main()
