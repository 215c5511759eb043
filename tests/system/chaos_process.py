"""Chaos trials on processes: kill -9 with restarts, a worker that always fails, SIGSTOP,
an exception before a collective or during a save (see chaos.py)."""

from __future__ import annotations

import os
import re
import signal
import time

from dtrain.checkpoint import layout
from dtrain.checkpoint import read as ckread
from tests.processes import Launch, pid_alive, rank_of
from tests.system.chaos_checks import (
    REPO,
    STARTED,
    STEPS,
    Context,
    Outcome,
    injected_at,
    metrics_step,
    no_processes_left,
    same_run,
    sections,
    wait_exit_tracking,
    wait_for_step,
    write_config,
)


def trial_kill9(ctx: Context, index: int) -> Outcome:
    nproc = 4
    secs = sections()
    reference = ctx.reference(nproc, secs)
    folder = ctx.new_dir("kill9")
    run_dir = folder / "run"
    launch = Launch(
        write_config(folder / "job.toml", run_dir, **secs), nproc, "--max-restarts=3", cwd=REPO
    )
    out = Outcome(ok=False)
    try:
        wait_for_step(run_dir, ctx.rng.randint(2, STEPS - 2), launch)
        victim = ctx.rng.choice(launch.workers())
        rank = rank_of(victim)
        out.tags["killed"] = f"rank {rank} at step {metrics_step(run_dir)}"
        killed = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(600)
        named = launch.first(rf"PeerFailure: .*rank {rank} \([^)]*\) died: its process is gone")
        out.tags["a survivor's error names the killed rank"] = "yes" if named else "no"
        if code != 0:
            out.problems.append(f"exit code {code}")
        starts = [t for t, line in launch.lines if re.search(STARTED, line)]
        if len(starts) != 2:
            out.problems.append(f"{len(starts)} starts of the group (expected 2)")
        else:
            out.times["kill -> group resumed training"] = starts[1] - killed
        out.times["whole run"] = (launch.ended or time.monotonic()) - launch.started
        out.problems += same_run(reference, run_dir)
        out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_always_fails(ctx: Context, index: int) -> Outcome:
    nproc = 2
    fail_rank = index % nproc
    fail_step = ctx.rng.randint(1, 6)
    secs = sections("tests.tasks:failing_gpt", fail_rank=fail_rank, fail_at_step=fail_step)
    secs["task"]["slow_ms"] = 0
    folder = ctx.new_dir("always-fails")
    run_dir = folder / "run"
    launch = Launch(
        write_config(folder / "job.toml", run_dir, **secs), nproc, "--max-restarts=2", cwd=REPO
    )
    out = Outcome(ok=False, tags={"failing": f"rank {fail_rank} at step {fail_step}"})
    try:
        code = launch.wait(600)
        out.times["start -> launcher exit"] = (launch.ended or time.monotonic()) - launch.started
        if code in (0, None):
            out.problems.append(f"exit code {code} (expected a failure)")
        try:
            attempts = (run_dir / "attempts.log").read_text().split()[0::2].count(str(fail_rank))
        except OSError:
            attempts = 0
        if attempts != 3:
            out.problems.append(f"{attempts} attempts (expected 3)")
        named = launch.first(
            rf"^\s+rank {fail_rank} \(pid \d+, exit code \d+\): .*injected failure at step "
            rf"{fail_step}"
        )
        if named is None:
            out.problems.append(f"no error line naming rank {fail_rank} and its failure")
        gone = time.monotonic()
        out.problems += no_processes_left(run_dir)
        out.times["launcher exit -> no process left"] = time.monotonic() - gone
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_sigstop(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s = 4, 5.0
    secs = sections(steps=400, timeout_s=timeout_s, grace_s=2.0)
    folder = ctx.new_dir("sigstop")
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc, cwd=REPO)
    out = Outcome(ok=False)
    victim = -1
    try:
        wait_for_step(run_dir, ctx.rng.randint(3, 12), launch)
        # Every rank in turn: rank 0 differs (it hosts the job's store under `dtrain train`).
        workers = {rank_of(pid): pid for pid in launch.workers()}
        rank = index % nproc if index % nproc in workers else min(workers)
        victim = workers[rank]
        out.tags["stopped"] = f"rank {rank} at step {metrics_step(run_dir)}"
        stopped = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        code = launch.wait(180)
        if code is None:
            out.problems.append("STUCK: the launcher had not exited 180 s after the SIGSTOP")
            out.tags["stuck"] = "yes"
        else:
            out.times["SIGSTOP -> launcher exit"] = (launch.ended or 0) - stopped
        # Every other rank's PeerFailure must name the stopped one.
        named: dict[int, float] = {}
        # A rank says it as a PeerFailure (a collective failed), or in its hang line (`dtrain:
        # error: rank N (...) made no progress ...`) when the hang check fires first.
        pattern = (
            rf"(?:PeerFailure: |dtrain: error: )rank (\d+) \(.*rank {rank} \([^)]*\) "
            "stopped responding"
        )
        for arrived, line in launch.lines:
            match = re.search(pattern, line)
            if match and arrived >= stopped:
                named.setdefault(int(match.group(1)), arrived - stopped)
        others = set(range(nproc)) - {rank}
        if set(named) != others:
            missing = sorted(others - set(named))
            out.problems.append(f"rank(s) {missing} did not raise a PeerFailure naming rank {rank}")
        if named:
            out.times["SIGSTOP -> first rank names it"] = min(named.values())
            out.times["SIGSTOP -> last rank names it"] = max(named.values())
            if max(named.values()) > 10.0:
                out.problems.append(
                    f"the others named it only after {max(named.values()):.1f}s (target 10s)"
                )
        if code is not None:
            out.problems += no_processes_left(run_dir)
    finally:
        if victim > 0 and pid_alive(victim):
            os.kill(victim, signal.SIGKILL)
        launch.close()
    out.ok = not out.problems
    return out


def _raise_trial(
    ctx: Context,
    name: str,
    secs: dict[str, dict[str, object]],
    nproc: int,
    timeout_s: float,
    save_step: int = 0,
    failed_save: bool = False,
) -> Outcome:
    folder = ctx.new_dir(name)
    run_dir = folder / "run"
    launch = Launch(write_config(folder / "job.toml", run_dir, **secs), nproc, cwd=REPO)
    out = Outcome(ok=False)
    try:
        wait_for_step(run_dir, 1, launch)
        launch.workers()
        code, all_gone = wait_exit_tracking(launch, 180)
        raised = injected_at(run_dir, 0)
        if code is None:
            out.problems.append("STUCK: the launcher had not exited 180 s after starting")
        elif code == 0:
            out.problems.append("exit code 0 (expected a failure)")
        if raised is None:
            out.problems.append("the fault was not injected")
        elif all_gone is None:
            out.problems.append("workers still alive")
        else:
            took = all_gone - raised
            out.times["raise -> every worker exited"] = took
            if launch.ended_wall is not None:
                out.times["raise -> launcher exit"] = launch.ended_wall - raised
            if took > 2 * timeout_s:
                out.problems.append(f"the ranks exited {took:.1f}s after the raise (> 2 x timeout)")
        others = [r for r in range(1, nproc)]
        for r in others:
            # A failed synchronous save is every rank's error, in rank 0's words (every rank
            # acts on rank 0's word on a commit): a user-facing error, which the launcher of a
            # one-machine job says once for the ranks that failed alike ("ranks 0, 1 (pids
            # ...): checkpoint ..."); any other failure is a peer's, named by the rank itself.
            named = (
                rf"(rank {r}|ranks (\d+, )*{r}\b.*\)): checkpoint step-\d+ was not committed: "
                r"rank 0: "
                if failed_save
                else rf"PeerFailure: rank {r} \(.*rank 0 \("
            )
            if launch.first(named) is None:
                out.problems.append(f"rank {r}'s error does not name rank 0")
        folder_k = run_dir / "checkpoints" / layout.step_dir_name(save_step)
        if save_step and failed_save and (folder_k / layout.MARKER).exists():
            out.problems.append(f"the failed save of step {save_step} was committed")
        elif save_step and (folder_k / layout.MARKER).exists():
            # The save itself went well (its snapshot was taken before the raise): it may
            # commit while the process goes down, but only whole.
            try:
                ckread.verify_checkpoint(folder_k)
            except Exception as exc:
                out.problems.append(f"a committed checkpoint does not verify: {exc}")
        if code is not None:
            out.problems += no_processes_left(run_dir)
    finally:
        launch.close()
    out.ok = not out.problems
    return out


def trial_raise_collective(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s = 2, 5.0
    step = ctx.rng.randint(2, 12)
    secs = sections(
        "tests.tasks:chaos_gpt", steps=40, timeout_s=timeout_s, raise_rank=0, raise_at_step=step
    )
    out = _raise_trial(ctx, "raise-collective", secs, nproc, timeout_s)
    out.tags["raised"] = f"forward of step {step}"
    return out


def trial_raise_save(ctx: Context, index: int) -> Outcome:
    nproc, timeout_s, every = 2, 5.0, 4
    step = every * ctx.rng.randint(1, 3)
    if index % 2 == 0:  # synchronous save: the write raises on rank 0 and so does the save
        secs = sections(
            "tests.tasks:chaos_gpt",
            steps=40,
            timeout_s=timeout_s,
            every=every,
            async_save=False,
            raise_rank=0,
            raise_in_save_step=step,
        )
        kind = "sync save, in a file write"
    else:  # asynchronous: rank 0's main thread raises while its background write runs
        secs = sections(
            "tests.tasks:chaos_gpt",
            steps=40,
            timeout_s=timeout_s,
            every=every,
            raise_rank=0,
            raise_while_saving_step=step,
            save_slow_ms=300,
            save_slow_rank=0,
        )
        kind = "async save in flight, main thread"
    out = _raise_trial(
        ctx, "raise-save", secs, nproc, timeout_s, save_step=step, failed_save=index % 2 == 0
    )
    out.tags["raised"] = f"{kind}, step {step}"
    return out
