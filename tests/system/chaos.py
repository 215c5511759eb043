"""Fault injection at scale: the trials of issue 4, many times each, through the real CLI.

Every trial starts ``python -m dtrain train CONFIG --nproc N ...`` from the repository root (the
elastic agent and real worker processes, gloo on loopback, CPU), injects one fault, and checks
what the user would see: exit codes, log lines, timings, the checkpoints left behind, and the
final parameters and sample ids against an uninterrupted run of the same job.

    python -m tests.system.chaos               # every trial, the issue's counts (about an hour)
    python -m tests.system.chaos --quick       # one trial of each kind (a few minutes)
    python -m tests.system.chaos --trials kill9,sigstop --count 3

(from the repository root; ``make chaos`` runs the first.)

Trials (``--trials``; default counts in brackets):

  kill9            [20] kill -9 of one of 4 workers at a random step, --max-restarts 3: exit 0,
                        parameters bit-identical to the uninterrupted run, every sample once
  always_fails     [5]  a worker that fails every time, --max-restarts 2: exactly 3 attempts,
                        non-zero exit, the error names the rank, no process left after 10 s
  sigstop          [10] SIGSTOP of each of 4 workers in turn, dist.timeout_s = 5: every other
                        rank raises naming it within 10 s; the launcher exits (not stuck)
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
  inplace_kill9    [20] fault.recovery = 'inplace': kill -9 of one of 4 workers, --max-restarts 3:
                        exit 0, the others' next step within 1 s, a membership event, the
                        restarted worker rejoins healed (its start -> first shared step timed),
                        every sample exactly once, no checkpoint read
  inplace_sigstop  [20] the same with SIGSTOP for 20 s (dist.timeout_s = 5): the others go on
                        within the timeout + 1 s; after SIGCONT it rejoins healed (timed)
  inplace_link     [20] two namespace hosts (root), one worker each, host 1's link down for
                        10 s then up (dist.timeout_s = 8): host 0 trains on before its timeout,
                        host 1 rejoins healed, every sample once, no checkpoint read

The table printed at the end is also written into docs/benchmarks.md (section "chaos").
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from benchmarks._report import machine_line, update_section

from tests.system.chaos_checks import Context, Outcome
from tests.system.chaos_inplace import (
    trial_inplace_kill9,
    trial_inplace_link,
    trial_inplace_sigstop,
)
from tests.system.chaos_process import (
    trial_always_fails,
    trial_kill9,
    trial_raise_collective,
    trial_raise_save,
    trial_sigstop,
)
from tests.system.chaos_resume import (
    trial_corrupt,
    trial_kill_in_save,
    trial_resize,
    trial_sigterm,
)


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
    "inplace_kill9": Kind(
        trial_inplace_kill9,
        20,
        "fault.recovery = 'inplace': kill -9 of 1 of 4 workers, --max-restarts 3",
        # The bounds: every survivor's next committed step within 1 s of the kill; the
        # restarted worker trains with the others within 5 s of its start.
        {
            "kill9 -> the others' next step": 1.0,
            "restarted worker's start -> its first step with the others": 5.0,
        },
    ),
    "inplace_sigstop": Kind(
        trial_inplace_sigstop,
        20,
        "fault.recovery = 'inplace': SIGSTOP of 1 of 4 workers for 20 s (timeout 5 s)",
        {"sigstop -> the others' next step": 6.0},
    ),
    "inplace_link": Kind(
        trial_inplace_link,
        20,
        "fault.recovery = 'inplace', 2 hosts (namespaces) x 1 worker: host 1's link down 10 s",
        # Before its collective timeout (8 s): the coordinator cuts a machine silent for 3 s.
        {"link down (10 s) -> the other host's next step": 8.0},
    ),
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
        "| trial | what | passed | timing | min | median | max | target | within it |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
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
                f"{min(values):.2f} s" if values else "",
                f"{median(values):.2f} s" if values else "",
                f"{max(values):.2f} s" if values else "",
                f"<= {target:.0f} s" if target else "",
                f"{sum(v <= target for v in values)}/{len(values)}" if target and values else "",
            ]
            rows.append("| " + " | ".join(cells) + " |")
            first = False
    return rows


def tag_summary(tally: Tally) -> list[str]:
    """Counts of each tag value (kill phases, corrupted files, ...), for the notes."""
    lines = []
    keys = sorted({k for o in tally.outcomes for k in o.tags})
    for key in keys:
        if key in (
            *("killed", "stopped", "raised", "corrupted", "failing", "silent", "stuck"),
            *("kill9", "sigstop"),  # the in-place kinds' member and step, different each time
        ):
            continue
        counts: dict[str, int] = {}
        for o in tally.outcomes:
            if key in o.tags:
                counts[o.tags[key]] = counts.get(o.tags[key], 0) + 1
        shown = ", ".join(f"{v}: {n}" for v, n in sorted(counts.items()))
        lines.append(f"- `{tally.name}` {key}: {shown}")
    return lines


READING = [
    "How to read the timings:",
    "",
    "- `kill -> group resumed training`: from the kill to the restarted group's first line "
    "(torch's agent notices, stops the group, starts 4 new workers that import torch and load "
    "the newest checkpoint).",
    "- `SIGSTOP -> launcher exit`: once the other ranks have failed, torch's elastic agent "
    "gives the stopped worker its fixed 30 s stop timeout before SIGKILL (on the failure path "
    "it does not use `shutdown_timeout`, which dtrain sets from `fault.preempt_grace_s` for "
    "preemption signals); the launcher then exits non-zero, nothing left behind.",
    "- `raise -> every worker exited`: from the raise (wall clock, written by the failing rank) "
    "to the moment no worker process was left.",
    "- `start -> training resumed`: from starting `dtrain train` to its line saying where it "
    "resumed from (process start, torch import, verifying checkpoints, loading).",
    "- `kill9 -> the others' next step` (inplace): from the kill to the first step the others "
    "commit without the killed worker (the step in flight dropped, a new generation formed).",
    "- `restarted worker's start -> its first step with the others` (inplace): from the start "
    "of the process the launcher started in its place (importing torch, being let in at a "
    "step boundary, receiving the state from a peer) to the first step trained with it.",
    "- `link down -> the other host's next step` (inplace_link): the coordinator names a "
    "machine whose workers have all been silent for 3 s cut off, and the others shut down "
    "their connections to it; `link up -> it trains with the other again`: the cut-off "
    "worker's collective fails, it asks to join and is healed from the other's memory.",
    "- `sigstop -> the others' next step` (inplace): the others drop the stopped worker when "
    "their collective times out (`dist.timeout_s` = 5 s); `SIGCONT -> its first step with the "
    "others`: its failed collective, asking to join, the state received from a peer.",
    "",
]


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
        write_docs(args, argv, names, elapsed, rows, notes, failures)
    return 0 if not failures else 1


def write_docs(
    args: argparse.Namespace,
    argv: list[str] | None,
    names: list[str],
    elapsed: float,
    rows: list[str],
    notes: list[str],
    failures: list[str],
) -> None:
    """The table into docs/benchmarks.md: section ``chaos`` for every kind, a section of
    its own for a subset (so that rerunning some kinds does not drop the others' figures)."""
    command = "python -m tests.system.chaos" + (
        " " + " ".join(argv if argv is not None else sys.argv[1:])
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    every = names == list(TRIALS)
    title = (
        "## Fault tolerance (chaos)" if every else f"## Fault tolerance (chaos: {', '.join(names)})"
    )
    body = [
        title,
        "",
        f"Command: `{command}` (seed {args.seed}), {time.strftime('%Y-%m-%d')}, "
        f"{elapsed / 60:.0f} min in all  ",
        f"Machine: {machine_line()}  ",
        "Each trial runs `python -m dtrain train` (torch's elastic agent, gloo on loopback, "
        "CPU) on a 2-layer GPT, 64 samples, AdamW steps of 8 samples (20; 400 for the "
        "`inplace` kinds; `inplace_link` runs the job of tests/test_inplace_hosts.py, 256 "
        "samples, ended by SIGTERM), each forward "
        'slowed by 40 ms; "bit-identical" compares the final `model.pt` with an '
        "uninterrupted run of the same job and world size (`torch.equal`), and the "
        "sample ids of every step with the same run's audit (`fault.audit_sample_ids`).",
        "",
        *rows,
        "",
        *(["Where the kills landed and what was damaged:", "", *notes, ""] if notes else []),
        *READING,
        *(["Failed trials:", "", *failures, ""] if failures else ["Every trial passed.", ""]),
    ]
    update_section("chaos" if every else "chaos_" + "_".join(names), "\n".join(body))


if __name__ == "__main__":
    sys.exit(main())
