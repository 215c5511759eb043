"""Chaos trials of ``fault.recovery = 'inplace'`` (see chaos.py): kill -9 or SIGSTOP of one of
4 workers, or one of two hosts cut off for 10 s; the others go on, the lost one comes back
healed from their memory."""

from __future__ import annotations

import os
import signal
import time

from tests.audit import check_stream, read_trajectory
from tests.processes import Launch, metrics_records, pid_alive, started_at
from tests.system.chaos_checks import (
    REPO,
    SAMPLES,
    Context,
    Outcome,
    metrics_step,
    no_processes_left,
    sections,
    wait_for_step,
    write_config,
)

# Long enough that the lost worker rejoins before the end: a restarted one starts seconds after
# the kill (torch's import, under 3 training workers on 2 cores), a stopped one is resumed 20 s
# after the stop; the 3 others train ~5 steps/s here.
STEPS = 400


def _trial(ctx: Context, index: int, kind: str) -> Outcome:
    nproc, timeout_s = 4, 5.0
    secs = sections(steps=STEPS, timeout_s=timeout_s, grace_s=2.0)
    secs["fault"]["recovery"] = "inplace"
    folder = ctx.new_dir(f"inplace-{kind}")
    run_dir = folder / "run"
    config = write_config(folder / "job.toml", run_dir, **secs)
    launch = Launch(config, nproc, "--max-restarts=3", cwd=REPO)
    out = Outcome(ok=False)
    victim = -1
    try:
        wait_for_step(run_dir, ctx.rng.randint(3, 12), launch)
        workers = launch.inplace_workers()
        member = index % nproc if index % nproc in workers else min(workers)
        victim = workers[member]
        out.tags[kind] = f"member {member} at step {metrics_step(run_dir)}"
        hit = time.time()
        if kind == "kill9":
            os.kill(victim, signal.SIGKILL)
            back = started_at(replacement(launch, member, victim))
        else:
            os.kill(victim, signal.SIGSTOP)
            time.sleep(20)
            os.kill(victim, signal.SIGCONT)
            back = time.time()
        code = launch.wait(600)
        if code != 0:
            out.problems.append(f"exit code {code}")
        runs = metrics_records(run_dir)
        after = [r["time"] for r in runs if r.get("kind") == "train" and r["time"] > hit]
        if after:
            out.times[f"{kind} -> the others' next step"] = after[0] - hit
        changes = [r for r in runs if r.get("name") == "membership"]
        left = [r for r in changes if member in r["left"]]
        joined = [r for r in changes if member in r["joined"]]
        if not left:
            out.problems.append(f"no membership event with member {member} leaving")
        if joined:
            # its first step with the others: the first step trained after it was let in
            shared = [
                r["time"]
                for r in runs
                if r.get("kind") == "train" and r["time"] > joined[0]["time"]
            ]
            since = "restarted worker's start" if kind == "kill9" else "SIGCONT"
            if shared:
                out.times[f"{since} -> its first step with the others"] = shared[0] - back
        else:
            out.problems.append(f"member {member} did not rejoin before the run ended")
        if any(r.get("name") == "resumed" for r in runs):
            out.problems.append("a checkpoint was read")
        audit = check_stream(read_trajectory(run_dir), SAMPLES)
        if not audit.exactly_once or audit.gaps or audit.positions != STEPS * 8:
            out.problems.append(f"sample audit: {audit}")
        out.problems += no_processes_left(run_dir)
    finally:
        if victim > 0 and pid_alive(victim):
            os.kill(victim, signal.SIGKILL)
        launch.close()
    out.ok = not out.problems
    return out


def replacement(launch: Launch, member: int, victim: int, within: float = 120.0) -> int:
    """The pid of the worker that the launcher started for the member in place of ``victim``."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and launch.alive():
        pid = launch.inplace_workers().get(member)
        if pid is not None and pid != victim:
            return pid
        time.sleep(0.01)
    raise RuntimeError(f"no worker was restarted for member {member} within {within:.0f}s")


def trial_inplace_kill9(ctx: Context, index: int) -> Outcome:
    return _trial(ctx, index, "kill9")


def trial_inplace_sigstop(ctx: Context, index: int) -> Outcome:
    return _trial(ctx, index, "sigstop")


def trial_inplace_link(ctx: Context, index: int) -> Outcome:
    """Two namespace hosts, one worker each; host 1's link down for 10 s, then up: host 0
    trains on, host 1 rejoins healed (the trial of tests/test_inplace_hosts.py)."""
    from tests.hosts import hosts_unavailable
    from tests.test_inplace_hosts import CUT_S, STEPS, TIMEOUT_S, check_cut, cut_trial

    out = Outcome(ok=False)
    reason = hosts_unavailable()
    if reason:
        out.problems.append(f"no namespace hosts here: {reason}")
        return out
    folder = ctx.new_dir("inplace-link")
    try:
        trial = cut_trial(folder, TIMEOUT_S, STEPS, kill=False)
        first_alone, rejoined, _ = check_cut(trial, TIMEOUT_S, STEPS)
        out.times[f"link down ({CUT_S:.0f} s) -> the other host's next step"] = first_alone
        out.times["link up -> it trains with the other again"] = rejoined
    except AssertionError as exc:
        out.problems.append(f"AssertionError: {str(exc)[-1500:]}")
    out.problems += no_processes_left(folder / "run")
    out.ok = not out.problems
    return out
