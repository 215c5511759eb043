"""Less communication, measured (issue 11): bytes per step, final validation loss, and step time
over a throttled link -- every method side by side with uncompressed fp32 data parallelism in
one run.

1. ``quality``: the default job (``dtrain train``, 2 workers, the default GPT, 700 steps) once
   per method: none (fp32 ddp), fp16, bf16, powersgd (rank 4; rank 16 with its factors in
   fp32, fp16 and bf16; rank 24 in bf16), topk (1%), localsgd and diloco (H = 8), from step 0
   and after 100 data-parallel steps (``comm.local_start_step``), diloco also with outer lr /
   momentum 0.5 / 0.5 besides the paper's 0.7 / 0.9. From each run: bytes one rank sends per step
   (``comm_bytes_per_step`` in metrics.jsonl, averaged over the run after PowerSGD's warm
   start) and the final validation loss (the whole validation set), each as a ratio to
   ``none``.
2. ``hosts``: two "hosts" (network namespaces from ``scripts/hosts.sh``, each link limited to
   ``--rate``, 1 worker and 1 thread each) train the default GPT through ``dtrain train
   --nnodes 2`` with none, powersgd (rank 4; rank 24 with bf16 factors) and diloco, rounds
   alternating. The step time is the mean over the steps after the warm-up. Its floor: the
   compute-only step time (the same per-rank batch on 1 worker, no communication, measured in
   the same round with both hosts computing at once, since the two "hosts" share this
   machine's cores) plus the bytes the method sends per step over the link's rate. The lone
   worker's step is reported beside it.

    python benchmarks/bench_comm.py                      # both (about 42 min here; quality 29)
    python benchmarks/bench_comm.py --only hosts --rounds 3
    python benchmarks/bench_comm.py --write-docs         # and update docs/benchmarks.md

The hosts part needs root, ``ip`` and ``tc`` (it says why it is skipped otherwise). This
kernel has no netem, so the link has a rate but no added delay.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, command_line, machine, update_section

sys.path.insert(0, str(ROOT))  # tests/hosts.py: the namespace hosts of a source checkout
from tests.hosts import Hosts, hosts_unavailable
from tests.processes import Launch

SECTION = "bench_comm"
POWERSGD_START = 10  # comm.powersgd_start_step: steps of plain all-reduce first
LOCAL_START = 100  # comm.local_start_step of the post-local rows
OUTER_LR, OUTER_MOMENTUM = 0.5, 0.5  # comm.outer_lr / comm.outer_momentum, small-H DiLoCo rows
SMALL_H_OUTER = f"{OUTER_LR} / {OUTER_MOMENTUM}"
SMALL_H_OUTER_FLAGS = [f"--comm.outer_lr={OUTER_LR}", f"--comm.outer_momentum={OUTER_MOMENTUM}"]

METHODS: dict[str, list[str]] = {
    "none (fp32)": [],
    "fp16": ["--comm.compression=fp16"],
    "bf16": ["--comm.compression=bf16"],
    "powersgd r4": ["--comm.compression=powersgd", "--comm.powersgd_rank=4"],
    # Rank 16 comes within 3% of fp32's loss; its factors in 16 bits halve its bytes.
    "powersgd r16": ["--comm.compression=powersgd", "--comm.powersgd_rank=16"],
    **{
        f"powersgd r16, {factors} factors": [
            "--comm.compression=powersgd",
            "--comm.powersgd_rank=16",
            f"--comm.powersgd_factors={factors}",
        ]
        for factors in ("fp16", "bf16")
    },
    # Rank 24 in bf16: still more than 10x fewer bytes, with room under 3% across seeds.
    "powersgd r24, bf16 factors": [
        "--comm.compression=powersgd",
        "--comm.powersgd_rank=24",
        "--comm.powersgd_factors=bf16",
    ],
    "topk 1%": ["--comm.compression=topk", "--comm.topk_fraction=0.01"],
    "localsgd H8": ["--strategy.name=localsgd", "--comm.sync_every=8"],
    "diloco H8": ["--strategy.name=diloco", "--comm.sync_every=8"],
    # Post-local SGD: plain data parallelism for the first LOCAL_START steps (1/7 of the job).
    f"localsgd H8, ddp first {LOCAL_START}": [
        "--strategy.name=localsgd",
        "--comm.sync_every=8",
        f"--comm.local_start_step={LOCAL_START}",
    ],
    f"diloco H8, ddp first {LOCAL_START}": [
        "--strategy.name=diloco",
        "--comm.sync_every=8",
        f"--comm.local_start_step={LOCAL_START}",
    ],
    # The same with a gentler outer step (docs/communication.md, "Outer values at small H"):
    # the paper's 0.7 / 0.9 were chosen for H = 500.
    f"diloco H8, outer {SMALL_H_OUTER}": [
        "--strategy.name=diloco",
        "--comm.sync_every=8",
        *SMALL_H_OUTER_FLAGS,
    ],
    f"diloco H8, outer {SMALL_H_OUTER}, ddp first {LOCAL_START}": [
        "--strategy.name=diloco",
        "--comm.sync_every=8",
        f"--comm.local_start_step={LOCAL_START}",
        *SMALL_H_OUTER_FLAGS,
    ],
}
# What each must reach against none: bytes ratio at most / val loss ratio at most.
TARGETS: dict[str, tuple[float | None, float]] = {
    "fp16": (0.5, 1.01),
    "bf16": (0.5, 1.01),
    "powersgd r4": (0.1, 1.03),
    "powersgd r16": (0.1, 1.03),
    "powersgd r16, fp16 factors": (0.1, 1.03),
    "powersgd r16, bf16 factors": (0.1, 1.03),
    "powersgd r24, bf16 factors": (0.1, 1.03),
    "localsgd H8": (None, 1.05),
    "diloco H8": (None, 1.05),
    f"localsgd H8, ddp first {LOCAL_START}": (None, 1.05),
    f"diloco H8, ddp first {LOCAL_START}": (None, 1.05),
    f"diloco H8, outer {SMALL_H_OUTER}": (None, 1.05),
    f"diloco H8, outer {SMALL_H_OUTER}, ddp first {LOCAL_START}": (None, 1.05),
}
HOST_METHODS = ["none (fp32)", "powersgd r4", "powersgd r24, bf16 factors", "diloco H8"]
HOST_TARGETS = {  # step time against none, at most
    "powersgd r4": 0.6,
    "powersgd r24, bf16 factors": 0.6,
    "diloco H8": 0.5,
}
FLOOR_TARGET = 1.25


def records(run_dir: Path) -> list[dict[str, Any]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def train_records(run_dir: Path, after_step: int) -> list[dict[str, Any]]:
    return [r for r in records(run_dir) if r["kind"] == "train" and r["step"] > after_step]


def bytes_per_step(run_dir: Path, after_step: int) -> float:
    """Mean over equal metrics windows: a window holds the same number of steps."""
    return statistics.fmean(r["comm_bytes_per_step"] for r in train_records(run_dir, after_step))


def step_time(run_dir: Path, after_step: int) -> float:
    """Mean seconds per step from the first metrics line after ``after_step`` to the last (a
    mean, not a median: a DiLoCo sync falls in some windows and not in others)."""
    lines = [r for r in records(run_dir) if r["kind"] == "train" and r["step"] >= after_step]
    first, last = lines[0], lines[-1]
    return (last["time"] - first["time"]) / (last["step"] - first["step"])


def dtrain_train(run_dir: Path, *args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dtrain", "train", f"--run.dir={run_dir}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise SystemExit(f"dtrain train {' '.join(args)} failed:\n{done.stderr[-3000:]}")


# ---------------------------------------------------------------------------------------------
# 1. Bytes and validation loss on the default job


def bench_quality(work: Path, steps: int) -> list[str]:
    results: dict[str, tuple[float, float]] = {}
    for label, flags in METHODS.items():
        run_dir = work / f"quality-{len(results)}"
        print(f"  {label}: {steps} steps ...", flush=True)
        dtrain_train(
            run_dir,
            "--nproc",
            "2",
            f"--train.steps={steps}",
            f"--comm.powersgd_start_step={POWERSGD_START}",
            "--checkpoint.every=0",
            "--task.generate_tokens=0",
            *flags,
        )
        summary = [r for r in records(run_dir) if r["kind"] == "summary"][-1]
        results[label] = (bytes_per_step(run_dir, 2 * POWERSGD_START), float(summary["val_loss"]))
        shutil.rmtree(run_dir, ignore_errors=True)
    base_bytes, base_loss = results["none (fp32)"]
    lines = [
        f"Default job, 2 workers, {steps} steps; bytes one rank sends per step (after step "
        f"{2 * POWERSGD_START}) and the final validation loss (nats/byte, whole set):",
        "",
        "| method | bytes/step | vs none | val loss | vs none | target | |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, (sent, loss) in results.items():
        bytes_ratio, loss_ratio = sent / base_bytes, loss / base_loss
        target = TARGETS.get(label)
        verdict, wanted = "", ""
        if target is not None:
            max_bytes, max_loss = target
            # Half the gradient bytes is a hair over 0.5x of all bytes: the step's 16-byte item
            # count and the metrics all-reduces are not compressed.
            ok = loss_ratio <= max_loss and (
                max_bytes is None or round(bytes_ratio, 3) <= max_bytes
            )
            verdict = "met" if ok else "MISSED"
            wanted = (f"bytes <= {max_bytes}x, " if max_bytes else "") + f"loss <= {max_loss}x"
        lines.append(
            f"| {label} | {sent:,.0f} | {bytes_ratio:.4f}x ({base_bytes / sent:.1f}x fewer) "
            f"| {loss:.4f} | {loss_ratio:.4f}x | {wanted} | {verdict} |"
        )
    return lines


# ---------------------------------------------------------------------------------------------
# 2. Two hosts over a throttled link


def host_run(hosts: Hosts, work: Path, label: str, steps: int, round_index: int) -> Path:
    run_dir = work / f"hosts-{round_index}-{HOST_METHODS.index(label)}"
    config = work / f"hosts-{round_index}-{HOST_METHODS.index(label)}.toml"
    config.write_text(f'[run]\ndir = "{run_dir}"\n')
    common = [
        f"--train.steps={steps}",
        "--train.log_every=5",
        "--eval.every=0",
        "--eval.max_samples=64",
        "--checkpoint.every=0",
        "--task.generate_tokens=0",
        "--dist.threads=1",
        f"--comm.powersgd_start_step={POWERSGD_START}",
        *METHODS[label],
    ]
    launches = [
        Launch(
            config,
            1,
            "--nnodes=2",
            f"--node-rank={i}",
            f"--rdzv-endpoint={hosts.address(0)}:29400",
            f"--run-id=bench-{round_index}-{HOST_METHODS.index(label)}",
            *common,
            cwd=ROOT,
            exec_prefix=hosts.exec_prefix(i),
        )
        for i in range(2)
    ]
    try:
        codes = [launch.wait(900) for launch in launches]
        if codes != [0, 0]:
            raise SystemExit(f"{label} on 2 hosts failed: {launches[0].text()[-3000:]}")
    finally:
        for launch in launches:
            launch.close()
    return run_dir


def compute_only(hosts: Hosts, work: Path, steps: int, round_index: int) -> tuple[float, float]:
    """The same per-rank work (half the global batch) on 1 worker, no communication: (a)
    alone on this machine, and (b) in both hosts at once, as in the two-host runs, where the
    two workers share this machine's 2 cores (two real hosts would not: the floor takes (b) so
    that the simulation's own contention is not charged to the method)."""
    argv = [
        sys.executable,
        "-m",
        "dtrain",
        "train",
        "--nproc=1",
        f"--train.steps={steps}",
        "--train.log_every=5",
        "--data.global_batch_size=8",  # the default 16 over 2 ranks
        "--eval.every=0",
        "--eval.max_samples=64",
        "--checkpoint.every=0",
        "--task.generate_tokens=0",
        "--dist.threads=1",
    ]
    alone_dir = work / f"compute-{round_index}"
    done = hosts.run(0, [*argv, f"--run.dir={alone_dir}"], cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"the compute-only run failed:\n{done.stderr[-3000:]}")
    alone = step_time(alone_dir, 2 * POWERSGD_START)
    both_dirs = [work / f"compute-{round_index}-host{i}" for i in range(2)]
    procs = [hosts.popen(i, [*argv, f"--run.dir={d}"], cwd=ROOT) for i, d in enumerate(both_dirs)]
    for proc in procs:
        output, _ = proc.communicate(timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"the concurrent compute-only run failed:\n{output[-3000:]}")
    both = statistics.fmean(step_time(d, 2 * POWERSGD_START) for d in both_dirs)
    for run_dir in [alone_dir, *both_dirs]:
        shutil.rmtree(run_dir, ignore_errors=True)
    return alone, both


def bench_hosts(work: Path, steps: int, rounds: int, rate: str) -> list[str]:
    reason = hosts_unavailable()
    if reason:
        return [f"Two hosts: skipped ({reason})."]
    rate_bytes = parse_rate(rate)
    times: dict[str, list[float]] = {label: [] for label in HOST_METHODS}
    sent: dict[str, list[float]] = {label: [] for label in HOST_METHODS}
    compute: list[tuple[float, float]] = []  # (alone, both hosts at once) per round
    with Hosts(2, rate=rate) as hosts:
        for round_index in range(rounds):
            order = HOST_METHODS if round_index % 2 == 0 else HOST_METHODS[::-1]
            for label in order:
                print(f"  round {round_index + 1}: {label} on 2 hosts ...", flush=True)
                run_dir = host_run(hosts, work, label, steps, round_index)
                times[label].append(step_time(run_dir, 2 * POWERSGD_START))
                sent[label].append(bytes_per_step(run_dir, 2 * POWERSGD_START))
                shutil.rmtree(run_dir, ignore_errors=True)
            print(f"  round {round_index + 1}: compute only ...", flush=True)
            compute.append(compute_only(hosts, work, steps, round_index))
    base = statistics.median(times["none (fp32)"])
    alone_s = statistics.median(c[0] for c in compute)
    compute_s = statistics.median(c[1] for c in compute)
    lines = [
        f"Two hosts (network namespaces), 1 worker and 1 thread each, links limited to {rate} "
        f"(no added delay: this kernel has no netem); the default GPT, {steps} steps, step "
        f"time = mean over steps {2 * POWERSGD_START}-{steps}, median of {rounds} alternating "
        f"rounds. Compute-only step (the same per-rank batch, 1 worker, no communication) "
        f"with both hosts computing at once, as in the two-host runs (they share this "
        f"machine's 2 cores): {compute_s:.3f} s (rounds: "
        f"{', '.join(f'{c[1]:.3f}' for c in compute)}); one worker alone on the machine: "
        f"{alone_s:.3f} s ({', '.join(f'{c[0]:.3f}' for c in compute)}). Floor = the "
        "compute-only step with both hosts computing + the bytes a rank sends per step over "
        "the link's rate; the last column takes the lone worker's step instead.",
        "",
        "| method | step time (s) | vs none | target | bytes/step | floor (s) | vs floor | "
        "| vs floor, 1 worker alone |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label in HOST_METHODS:
        seconds = statistics.median(times[label])
        per_step = statistics.median(sent[label])
        floor = compute_s + per_step / rate_bytes
        floor_alone = alone_s + per_step / rate_bytes
        target = HOST_TARGETS.get(label)
        ok = seconds / floor <= FLOOR_TARGET and (target is None or seconds / base <= target)
        lines.append(
            f"| {label} | {seconds:.3f} ({', '.join(f'{t:.3f}' for t in times[label])}) "
            f"| {seconds / base:.3f}x | {f'<= {target}x' if target else ''} "
            f"| {per_step:,.0f} | {floor:.3f} | {seconds / floor:.3f}x (<= {FLOOR_TARGET}x) "
            f"| {'met' if ok else 'MISSED'} | {seconds / floor_alone:.3f}x |"
        )
    return lines


def parse_rate(rate: str) -> float:
    """Bytes per second of a tc rate such as ``100mbit``."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, bits in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * bits / 8
    raise SystemExit(f"--rate {rate}: expected a number and gbit, mbit or kbit (e.g. 100mbit)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["quality", "hosts"], default=None)
    parser.add_argument("--steps", type=int, default=700, help="steps of the quality runs")
    parser.add_argument("--host-steps", type=int, default=60, help="steps of each hosts run")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds on the hosts")
    parser.add_argument("--rate", default="100mbit", help="each host's link rate (tc)")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dtrain-bench-comm-"))
    try:
        # Each part has its own section of docs/benchmarks.md, with the command that made it.
        if args.only in (None, "quality"):
            print("quality: the default job per method", flush=True)
            report("quality", QUALITY_TITLE, bench_quality(work, args.steps), args.write_docs)
        if args.only in (None, "hosts"):
            print(f"hosts: 2 hosts at {args.rate}", flush=True)
            lines = bench_hosts(work, args.host_steps, args.rounds, args.rate)
            report("hosts", HOSTS_TITLE, lines, args.write_docs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


QUALITY_TITLE = "Less communication: bytes per step and final validation loss per method"
HOSTS_TITLE = "Less communication: step time on two hosts over a throttled link"


def report(part: str, title: str, lines: list[str], write_docs: bool) -> None:
    when = f"`{command_line()}` on {time.strftime('%Y-%m-%d')} ({machine()})"
    text = "\n".join([f"## {title}", "", when, "", *lines])
    print(text)
    if write_docs:
        print(f"wrote {update_section(f'{SECTION}_{part}', text)}")


if __name__ == "__main__":
    main()
