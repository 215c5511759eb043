"""What fault tolerance costs: three ratios of issue 4, each measured side by side in one run.

1. ``blocking``: how long the training loop is blocked by an asynchronous save, against a
   synchronous save of the same state (target: at most 0.1x). Two real ranks (gloo), the
   default GPT and a larger one, after one AdamW step (so the optimizer state is full size);
   blocks of synchronous and of asynchronous saves alternate; the loop's blocked time is what
   the ``Checkpointer`` records (``blocking_seconds``). An asynchronous save copies into the
   buffers the previous one kept, so the first of a run (nothing to reuse yet) is shown apart.
2. ``slowdown``: training time with checkpoints at the default interval (``checkpoint.every``
   = 100, asynchronous) against no checkpoints (target: at most 3.5% slower). The default GPT
   job through the CLI on 2 workers, 200 steps; the figure is the wall time of steps 101-200,
   which hold the save of step 100 and everything it costs the loop (snapshot, background
   writer competing for the cores); runs of both kinds alternate.
3. ``resume``: time from starting ``dtrain train`` to the end of its first step when it resumes
   a checkpoint of step 10,000 against one of step 10 (target: within 1 s). Both come from real
   runs of the same job on the default corpus (a small GPT, so that 10,000 steps take minutes),
   the step-10,000 one about 80,000 samples into the stream; resumes of both alternate, each
   on a fresh copy of its run folder.

    python benchmarks/bench_checkpoint.py                       # all three (about 45 min here)
    python benchmarks/bench_checkpoint.py --only blocking --reps 5

Writes its figures into docs/benchmarks.md (section "bench_checkpoint").
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

from _report import ROOT, machine_line, update_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.processes import Launch
from tests.ranks import run_ranks


def spread(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if values else "n/a"


# ---------------------------------------------------------------------------------------------
# 1. Blocking time of a save


def blocking_in_rank(raw: dict[str, Any], reps: int) -> dict[str, Any]:
    """Runs in each rank: one training step, then ``reps`` pairs of saves (sync and async in
    alternating order), each on every rank together. Returns the loop's blocked seconds."""
    from dtrain.train.job import build_job_config, build_trainer

    cfg = build_job_config(raw)
    trainer = build_trainer(cfg)
    trainer.fit()  # one step, so that the optimizer holds its state; saves step 1
    c = trainer.checkpointer
    out: dict[str, list[float]] = {"sync": [], "async": [], "async_first": [], "async_write": []}
    step = 1
    # Blocks of 3 saves of one kind, the kinds alternating. In a block, the first save is not
    # in its steady state: a synchronous one may reuse the copy an asynchronous save kept (a
    # run that saves synchronously never has one), an asynchronous one has nothing to reuse
    # yet (as the first save of a run); it is reported apart. The other two are the figures.
    for rep in range(reps):
        for blocking in (True, False) if rep % 2 == 0 else (False, True):
            for index in range(3):
                step += 1
                trainer.step = step
                trainer.save_checkpoint(blocking=blocking)
                blocked = c.blocking_seconds[-1]
                error = c.wait()
                assert error is None, error
                if blocking and index > 0:
                    out["sync"].append(blocked)
                elif not blocking:
                    out["async" if index > 0 else "async_first"].append(blocked)
                    out["async_write"].append(c.write_seconds[-1])
    root = Path(cfg.run.dir) / "checkpoints"
    newest = max(p for p in root.iterdir() if p.name.startswith("step-"))
    return {**out, "bytes": sum(f.stat().st_size for f in newest.iterdir())}


def bench_blocking(work: Path, reps: int) -> list[str]:
    from dtrain.data.corpus import prepare_stdlib_corpus

    prepare_stdlib_corpus()
    lines: list[str] = []
    models: dict[str, dict[str, int]] = {
        "default GPT (3 layers, d_model 192)": {},
        "GPT, 6 layers, d_model 512": {"n_layer": 6, "d_model": 512},
    }
    for label, task in models.items():
        run_dir = work / f"blocking-{len(lines)}"
        raw = {
            "run": {"dir": str(run_dir), "task": "dtrain.tasks.gpt:build"},
            "data": {"global_batch_size": 8},
            "train": {"steps": 1, "log_every": 1},
            "eval": {"every": 0, "max_samples": 8},
            "checkpoint": {"every": 0, "keep_last": 2},
            "task": {"generate_tokens": 0, **task},
        }
        result = run_ranks(blocking_in_rank, 2, raw, reps, timeout=1800)[0]
        sync, async_ = median(result["sync"]), median(result["async"])
        ratio = async_ / sync
        verdict = "met" if ratio <= 0.1 else "MISSED"
        first = median(result["async_first"])
        lines += [
            f"{label}: checkpoint of {result['bytes'] / 1e6:.1f} MB, "
            f"{len(result['sync'])} saves of each kind",
            f"   loop blocked by a synchronous save  {sync * 1000:8.1f} ms "
            f"(median; {spread(result['sync'])} s)",
            f"   loop blocked by an asynchronous one {async_ * 1000:8.1f} ms "
            f"(median; {spread(result['async'])} s); its background write took "
            f"{median(result['async_write']) * 1000:.0f} ms",
            f"   ratio async/sync = {ratio:.3f}x (target <= 0.1x: {verdict})",
            f"   (the first asynchronous save of a run, with no earlier copy to reuse: "
            f"{first * 1000:.1f} ms = {first / sync:.3f}x)",
        ]
        print("\n".join(lines[-5:]), flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)
    return lines


# ---------------------------------------------------------------------------------------------
# 2. Training slowdown from checkpointing


def train_records(run_dir: Path) -> dict[int, dict[str, Any]]:
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "train":
            out[int(record["step"])] = record
    return out


def run_cli(work: Path, args: list[str], nproc: int, timeout: float = 3600) -> Launch:
    """``dtrain train`` with the default config and ``args``; raises when it fails."""
    config = work / "default.toml"
    config.write_text("")  # the built-in job; everything else comes as overrides
    launch = Launch(config, nproc, *args, cwd=ROOT)
    try:
        code = launch.wait(timeout)
        if code != 0:
            raise RuntimeError(f"dtrain train {' '.join(args)} failed:\n{launch.text()[-3000:]}")
    finally:
        launch.close()
    return launch


def bench_slowdown(work: Path, reps: int, steps: int = 200, every: int = 100) -> list[str]:
    times: dict[str, list[float]] = {"none": [], "every": []}
    for rep in range(reps):
        for kind in ("none", "every") if rep % 2 == 0 else ("every", "none"):
            run_dir = work / f"slowdown-{rep}-{kind}"
            run_cli(
                work,
                [
                    f"--run.dir={run_dir}",
                    f"--train.steps={steps}",
                    "--train.log_every=10",
                    "--eval.every=0",
                    "--eval.max_samples=64",
                    "--task.generate_tokens=0",
                    f"--checkpoint.every={every if kind == 'every' else 0}",
                ],
                nproc=2,
            )
            records = train_records(run_dir)
            window = records[2 * every]["time"] - records[every]["time"]
            times[kind].append(window)
            print(
                f"   {kind:5s} rep {rep}: steps {every + 1}-{2 * every} in {window:.2f}s",
                flush=True,
            )
            shutil.rmtree(run_dir, ignore_errors=True)
    base, with_ckpt = median(times["none"]), median(times["every"])
    slowdown = with_ckpt / base - 1
    verdict = "met" if slowdown <= 0.035 else "MISSED"
    pairs = [e / n - 1 for e, n in zip(times["every"], times["none"])]
    return [
        f"default GPT job, 2 workers, steps {every + 1}-{2 * every} of {steps} (one interval, "
        f"holding the async save of step {every}), {reps} runs of each kind, interleaved:",
        f"   no checkpoints            {base:7.2f} s (median; {spread(times['none'])} s)",
        f"   checkpoint.every = {every}   {with_ckpt:7.2f} s (median; {spread(times['every'])} s)",
        f"   slowdown = {slowdown * 100:+.1f}% (target <= 3.5%: {verdict}); run by run: "
        + ", ".join(f"{p * 100:+.1f}%" for p in pairs),
    ]


# ---------------------------------------------------------------------------------------------
# 3. Restart to first step at step 10,000 vs step 10

SMALL = [
    "--task.n_layer=1",
    "--task.d_model=64",
    "--task.n_head=2",
    "--task.seq_len=64",
    "--task.generate_tokens=0",
    "--data.global_batch_size=8",
    "--eval.every=0",
    "--eval.max_samples=64",
]


def bench_resume(work: Path, reps: int, far: int = 10_000, near: int = 10) -> list[str]:
    runs: dict[int, Path] = {}
    for steps in (near, far):
        run_dir = work / f"resume-source-{steps}"
        began = time.monotonic()
        run_cli(
            work,
            [f"--run.dir={run_dir}", f"--train.steps={steps}", "--checkpoint.every=1000", *SMALL],
            nproc=2,
            timeout=7200,
        )
        print(f"   trained {steps} steps in {time.monotonic() - began:.0f}s", flush=True)
        runs[steps] = run_dir
    position = {}
    for steps, run_dir in runs.items():
        state = json.loads(
            next((run_dir / "checkpoints").glob(f"step-*{steps}/meta.json")).read_text()
        )
        position[steps] = state["data"]["consumed"]
    took: dict[int, list[float]] = {near: [], far: []}
    for rep in range(reps):
        for steps in (near, far) if rep % 2 == 0 else (far, near):
            copy = work / f"resume-{steps}-{rep}"
            shutil.copytree(runs[steps], copy)
            started = time.time()
            launch = run_cli(
                work,
                [
                    f"--run.dir={copy}",
                    f"--train.steps={steps + 1}",
                    "--train.log_every=1",
                    *SMALL,
                ],
                nproc=2,
            )
            assert f"resumed from step-{steps:08d}" in launch.text(), launch.text()[-2000:]
            first = train_records(copy)[steps + 1]["time"]
            took[steps].append(first - started)
            print(f"   resume at step {steps:5d} rep {rep}: {first - started:.2f}s", flush=True)
            shutil.rmtree(copy, ignore_errors=True)
    t_near, t_far = median(took[near]), median(took[far])
    verdict = "met" if abs(t_far - t_near) <= 1.0 else "MISSED"
    return [
        f"small GPT (1 layer, d_model 64) on the default corpus, 2 workers, {reps} resumes of "
        "each, interleaved; from starting the CLI to the end of the first step:",
        f"   resume at step {near:6,} (data position {position[near]:,} samples)  "
        f"{t_near:6.2f} s (median; {spread(took[near])} s)",
        f"   resume at step {far:6,} (data position {position[far]:,} samples)  "
        f"{t_far:6.2f} s (median; {spread(took[far])} s)",
        f"   difference = {t_far - t_near:+.2f} s (target within 1 s: {verdict})",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="blocking,slowdown,resume")
    parser.add_argument("--reps", type=int, default=0, help="repetitions (0 = each one's default)")
    parser.add_argument("--no-docs", action="store_true")
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: tiny sizes, one repetition, no docs"
    )
    args = parser.parse_args(argv)
    chosen = [n.strip() for n in args.only.split(",") if n.strip()]
    if args.quick:
        args.reps, args.no_docs = 1, True
    work = Path(tempfile.mkdtemp(prefix="dtrain-bench-ckpt-"))
    sections: list[str] = []
    began = time.monotonic()
    try:
        if "blocking" in chosen:
            print("1. blocking time of a save", flush=True)
            sections += [
                "1. blocking time of a save, async vs sync",
                *bench_blocking(work, args.reps or 4),
            ]
        if "slowdown" in chosen:
            print("2. training slowdown from checkpointing", flush=True)
            sections += [
                "2. training slowdown, checkpoint.every = 100 (async) vs none",
                *bench_slowdown(
                    work, args.reps or 4, **({"steps": 20, "every": 10} if args.quick else {})
                ),
            ]
        if "resume" in chosen:
            print("3. restart to first step", flush=True)
            sections += [
                "3. restart to first step, step 10,000 vs step 10",
                *bench_resume(work, args.reps or 5, **({"far": 200} if args.quick else {})),
            ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n" + "\n".join(sections))
    if not args.no_docs:
        command = "python benchmarks/bench_checkpoint.py" + (
            " " + " ".join(sys.argv[1:] if argv is None else argv) if (argv or sys.argv[1:]) else ""
        )
        body = [
            "## Checkpoint costs (`bench_checkpoint.py`)",
            "",
            f"Command: `{command}`, {time.strftime('%Y-%m-%d')}, "
            f"{(time.monotonic() - began) / 60:.0f} min  ",
            f"Machine: {machine_line()}",
            "",
            "```",
            *sections,
            "```",
        ]
        update_section("bench_checkpoint", "\n".join(body))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
