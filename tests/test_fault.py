"""Fault tolerance inside the ranks: exact resume, preemption, NaN guard, hang detection."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.audit import read_trajectory
from tests.conftest import tiny_raw
from tests.dist_helpers import (
    crash_then_resume,
    damage_then_resume_slowly,
    fail_commit_then_preempt,
    fit_summary,
    losses_by_step,
    raise_before_collective,
    signal_self_at_step,
    threads_left_by_worker_train,
    train_params,
    train_with_nan,
    two_jobs_then_crash,
)
from tests.ranks import RankFailed, run_ranks

# This module's job: 16 AdamW steps, a checkpoint every 4, every step logged.
JOB = {
    "train": {"steps": 16, "log_every": 1},
    "checkpoint": {"every": 4},
    "optim": {"name": "adamw", "lr": 3e-3, "warmup_steps": 2},
}


def assert_bit_equal(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert np.array_equal(a[key], b[key]), key


def test_resume_after_a_crash_is_bit_identical_with_dropout(tmp_path: Path) -> None:
    task = {"dropout": 0.2}
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", JOB, task=task))
    crashed = run_ranks(crash_then_resume, 2, tiny_raw(tmp_path / "crash", JOB, task=task), 11)
    assert crashed[0]["start_step"] == 8  # resumed from the last checkpoint before the crash
    assert_bit_equal(reference[0], crashed[0]["params"])
    assert_bit_equal(reference[1], crashed[1]["params"])
    ref_losses = losses_by_step(str(tmp_path / "ref"))
    assert losses_by_step(str(tmp_path / "crash")) == ref_losses  # RNG restored on every rank


def test_resume_with_a_count_that_changes_every_step_is_bit_identical(tmp_path: Path) -> None:
    # Variable-length sequences: each step's item count differs from the one its loss scale
    # assumed (the step before's), and its gradients are rescaled once the count is agreed.
    # A resumed run must assume what the uninterrupted one assumed at that step.
    task = {"variable": True}
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", JOB, task=task))
    crashed = run_ranks(crash_then_resume, 2, tiny_raw(tmp_path / "crash", JOB, task=task), 11)
    assert crashed[0]["start_step"] == 8
    assert_bit_equal(reference[0], crashed[0]["params"])
    assert_bit_equal(reference[1], crashed[1]["params"])


def test_async_checkpoint_equals_the_state_at_its_step(tmp_path: Path) -> None:
    # A run that saves step 8 synchronously (the loop waits for the write) ...
    sync_dir = tmp_path / "sync"
    run_ranks(
        train_params, 2, tiny_raw(sync_dir, JOB, checkpoint={"every": 8, "async_save": False})
    )
    # ... and one that saves it in the background while training goes on to step 16.
    async_dir = tmp_path / "async"
    run_ranks(
        train_params, 2, tiny_raw(async_dir, JOB, checkpoint={"every": 8, "async_save": True})
    )
    import torch

    for name in ("model.pt", "optimizer.pt"):
        a = torch.load(sync_dir / "checkpoints/step-00000008" / name, weights_only=True)
        b = torch.load(async_dir / "checkpoints/step-00000008" / name, weights_only=True)
        flat_a, flat_b = _flatten(a), _flatten(b)
        assert flat_a.keys() == flat_b.keys()
        for key in flat_a:
            assert torch.equal(flat_a[key], flat_b[key]), (name, key)


def _flatten(tree: object, prefix: str = "") -> dict[str, object]:
    import torch

    out: dict[str, object] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(_flatten(v, f"{prefix}{k}/"))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(_flatten(v, f"{prefix}{i}/"))
    elif isinstance(tree, torch.Tensor):
        out[prefix] = tree
    else:
        out[prefix] = (
            torch.tensor(float(tree)) if isinstance(tree, (int, float)) else torch.tensor(0.0)
        )
    return out


def test_sigterm_saves_at_the_next_step_and_resume_is_bit_identical(tmp_path: Path) -> None:
    reference = run_ranks(train_params, 2, tiny_raw(tmp_path / "ref", JOB))
    run_dir = tmp_path / "pre"
    # SIGTERM reaches only rank 1; both ranks must stop at the same step.
    stopped = run_ranks(signal_self_at_step, 2, tiny_raw(run_dir, JOB), 1, 6, "SIGTERM")
    assert [s["preempted"] for s in stopped] == ["a peer's signal", "SIGTERM"]
    assert stopped[0]["steps"] == stopped[1]["steps"] == 6
    assert json.loads((run_dir / "status.json").read_text())["state"] == "preempted"
    assert (run_dir / "checkpoints/step-00000006/COMMITTED.json").exists()
    resumed = run_ranks(train_params, 2, tiny_raw(run_dir, JOB))
    assert_bit_equal(reference[0], resumed[0])


def test_a_failed_commit_is_known_to_every_rank_before_the_final_save(tmp_path: Path) -> None:
    # Rank 0's commit of step 4 fails; then a stop reaches rank 0 alone. Every rank must know
    # that step 4 was not saved, and enter the final save together (a rank that believed it
    # saved would skip it, and leave the others waiting in it until the timeout).
    run_dir = tmp_path / "commit"
    raw = tiny_raw(run_dir, JOB, checkpoint={"async_save": True}, dist={"timeout_s": 15})
    out = run_ranks(fail_commit_then_preempt, 2, raw, 4)
    assert [o.get("error") for o in out] == [None, None], out
    assert [o["preempted"] for o in out] == ["SIGTERM", "a peer's signal"]
    steps = out[0]["steps"]
    assert out[1]["steps"] == steps and steps in (4, 5)
    assert_bit_equal(out[0]["params"], out[1]["params"])
    assert (run_dir / f"checkpoints/step-{steps:08d}/COMMITTED.json").exists()
    assert json.loads((run_dir / "status.json").read_text()) == {
        "state": "preempted",
        "step": steps,
        "signal": "SIGTERM",
    }


def test_one_nan_step_is_skipped_on_every_rank(tmp_path: Path) -> None:
    # The batch at stream position 40 (step 6 with a global batch of 8) is bad on rank 1 only.
    out = run_ranks(train_with_nan, 2, tiny_raw(tmp_path / "nan", JOB), [40], 1)
    assert [o["skipped"] for o in out] == [1, 1]
    assert [o["rollbacks"] for o in out] == [0, 0]
    assert_bit_equal(out[0]["params"], out[1]["params"])  # the replicas stayed in step
    assert all(np.isfinite(v).all() for v in out[0]["params"].values())


def test_persistent_nan_rolls_back_and_never_sees_those_batches_again(tmp_path: Path) -> None:
    run_dir = tmp_path / "nan"
    config = tiny_raw(run_dir, JOB, fault={"nan_rollback_after": 3, "audit_sample_ids": True})
    bad = [80, 88, 96]  # steps 11-13: three in a row after the checkpoint at step 8
    out = run_ranks(train_with_nan, 2, config, bad, 0)
    assert [o["rollbacks"] for o in out] == [1, 1]
    assert out[0]["steps"] == 16 and out[0]["skipped"] == 3
    assert all(np.isfinite(v).all() for v in out[0]["params"].values())
    # The final trajectory never delivered the bad batches' samples and delivered each other
    # sample of the stream it walked exactly once.
    trajectory = read_trajectory(run_dir)  # re-run steps replaced by their newest attempt
    assert sorted(trajectory) == list(range(1, 17))
    starts = sorted(record.start for record in trajectory.values())
    assert not set(bad) & set(starts)
    assert starts == [s for s in range(0, 19 * 8, 8) if s not in bad][:16]


def test_nan_without_a_checkpoint_to_roll_back_to_is_a_clear_error(tmp_path: Path) -> None:
    config = tiny_raw(
        tmp_path / "nan", JOB, checkpoint={"every": 0}, fault={"nan_rollback_after": 2}
    )
    out = run_ranks(train_with_nan, 2, config, [16, 24], 0)
    assert all("no checkpoint to roll back to" in o["error"] for o in out)


def test_a_stopped_peer_is_named_when_the_collective_times_out(tmp_path: Path) -> None:
    # The ranks' collectives time out after 5 s (run_ranks' process group); the hang backstop
    # (2 x dist.timeout_s = 120 s) and run_ranks' own 90 s are far behind: only the
    # collective's timeout and the diagnosis that follows it can name the peer in this test.
    config = tiny_raw(tmp_path / "hang", JOB, dist={"timeout_s": 60.0})
    out = run_ranks(
        signal_self_at_step,
        2,
        config,
        1,
        5,
        "SIGSTOP",
        timeout=90,
        raise_on_failure=False,
        collective_timeout=5.0,
    )
    survivor = out[0]
    assert not isinstance(survivor, RankFailed), survivor
    assert isinstance(out[1], RankFailed)  # the stopped rank never answered and was killed
    assert "rank 1" in survivor["error"] and "stopped responding" in survivor["error"]
    assert "(collective error: Timed out waiting 5000ms" in survivor["error"], survivor


def test_a_killed_peer_is_named_as_gone(tmp_path: Path) -> None:
    # kill -9: the peer's last heartbeat is still fresh, but its process is gone. The
    # survivor learns it from the closed connection at once, not from its collective's
    # timeout (60 s; the backstop 120 s), and names it from this machine's view of the process.
    config = tiny_raw(tmp_path / "killed", JOB, dist={"timeout_s": 60.0})
    out = run_ranks(
        signal_self_at_step,
        2,
        config,
        1,
        5,
        "SIGKILL",
        timeout=90,
        raise_on_failure=False,
        collective_timeout=60.0,
    )
    survivor = out[0]
    assert not isinstance(survivor, RankFailed), survivor
    assert isinstance(out[1], RankFailed)
    assert "rank 1" in survivor["error"] and "died: its process is gone" in survivor["error"]
    assert_closed_connection(survivor)


def assert_closed_connection(result: dict[str, Any]) -> None:
    """The collective whose failure named the peer failed as the peer's connection closed
    (reset or closed by peer), not at its timeout: gloo's words, quoted in the error."""
    cause = result["error"].rsplit("(collective error: ", 1)[-1]
    assert re.match(r".*Connection (reset|closed) by peer", cause), result
    assert "Timed out" not in cause, result


# The hang backstop ends a rank that has not moved for 2 x dist.timeout_s: 2 s here. The ranks'
# own process group is run_ranks' (60 s), so only the backstop could end these runs.
LONG_PHASE = {"dist": {"timeout_s": 1.0}, "train": {"steps": 4}, "checkpoint": {"every": 0}}


def test_a_long_evaluation_that_makes_progress_is_not_taken_for_a_hang(tmp_path: Path) -> None:
    # The final evaluation: 16 samples a rank in 8 batches of 2, each forward 0.4 s, so at
    # least 3.2 s in `evaluate`, never 2 s without a batch done.
    config = tiny_raw(
        tmp_path / "eval",
        JOB,
        **LONG_PHASE,
        eval={"every": 0, "batch_size": 2},
        task={"samples": 256, "slow_eval_ms": 400},
    )
    out = run_ranks(fit_summary, 2, config, timeout=120)
    assert [o["steps"] for o in out] == [4, 4]
    assert out[0]["val_loss"] == out[1]["val_loss"] and np.isfinite(out[0]["val_loss"])


def test_a_damaged_file_is_named_and_skipped_with_verification_spread_over_the_ranks(
    tmp_path: Path,
) -> None:
    # Steps 4 and 8 saved; a piece of step 8's optimizer.pt that rank 1 verifies damaged; then
    # a resume, rank 1 verifying slowly: longer than the ranks' own collective timeout (2.5 s)
    # and than the hang backstop (2 x dist.timeout_s = 2 s). Rank 0 waits for it as long as it
    # makes progress.
    run_dir = tmp_path / "resume"
    phase = {**LONG_PHASE, "train": {"steps": 8}, "checkpoint": {"every": 4}}
    phase["fault"] = {"heartbeat_s": 0.2}
    first = tiny_raw(run_dir, JOB, **phase)
    longer = tiny_raw(run_dir, JOB, **{**phase, "train": {"steps": 10}})
    out = run_ranks(
        damage_then_resume_slowly, 2, first, longer, 1, 0.12, timeout=180, collective_timeout=2.5
    )
    assert [o["summary"]["start_step"] for o in out] == [4, 4]
    assert [o["summary"]["steps"] for o in out] == [10, 10]
    victim, step8 = out[0]["victim"], run_dir / "checkpoints/step-00000008"
    warning = (
        f"warning: skipping checkpoint step-00000008: {step8 / 'optimizer.pt'} fails its "
        f"SHA-256 checksum (bytes {victim.start}-{victim.start + victim.length - 1} of "
        f"{victim.file_bytes})"
    )
    assert warning in out[0]["logged"]
    # Step 4 was verified whole, each piece by one rank: its share, rank 1's own file its own.
    shares = [{(n, i) for n, i in o["verified"] if n.startswith("step-00000004/")} for o in out]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert ("step-00000004/rng-rank00001.pt", 0) in shares[1]
    pieces = len(shares[0] | shares[1])
    assert pieces > 40 and min(len(share) for share in shares) >= pieces // 3
    assert out[1]["slept"] > 3.0  # rank 1 took longer than any collective could wait


def test_a_finished_worker_leaves_no_thread_of_ours_behind(tmp_path: Path) -> None:
    # A prefetch thread still freeing its last batch while Python shuts down aborts the process
    # (SIGABRT) after a successful run; the chaos trials caught it about 1 run in 30.
    config = tiny_raw(tmp_path / "run", JOB, data={"prefetch": 2}, train={"steps": 6})
    for left in run_ranks(threads_left_by_worker_train, 2, config):
        assert left == []


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_exception_on_one_rank_fails_the_others_fast_naming_it(
    tmp_path: Path, bad_rank: int
) -> None:
    # Fast: the other rank's collective fails as the failed rank's connection closes, not
    # when it times out (60 s; the backstop 2 x dist.timeout_s = 120 s).
    config = tiny_raw(tmp_path / "boom", JOB, dist={"timeout_s": 60.0})
    out = run_ranks(
        raise_before_collective, 2, config, bad_rank, 4, timeout=40, collective_timeout=60.0
    )
    other = out[1 - bad_rank]
    assert "injected failure before a collective" in out[bad_rank]["error"]
    assert f"rank {bad_rank}" in other["error"] and "injected failure" in other["error"]
    assert_closed_connection(other)


def test_resume_on_three_ranks_is_bit_identical(tmp_path: Path) -> None:
    # With 3+ ranks the order in which DDP adds the ranks' gradients depends on its bucket
    # layout, which it rebuilds after the first backward of every new process: the first step
    # after a resume must not be summed in another layout than the uninterrupted run's.
    reference = run_ranks(train_params, 3, tiny_raw(tmp_path / "ref", JOB))
    crashed = run_ranks(crash_then_resume, 3, tiny_raw(tmp_path / "crash", JOB), 11)
    assert crashed[0]["start_step"] == 8
    assert_bit_equal(reference[0], crashed[0]["params"])


def test_a_restart_after_resume_path_goes_on_from_this_job_s_checkpoints(tmp_path: Path) -> None:
    # An earlier job left steps 4, 8, 10, 12 (keep_every 4). This job resumes from step 4
    # (run.resume = PATH), saves step 6, crashes at step 7, and restarts with the same config:
    # it must go on from its own step 6, which retention kept -- not back to step 4 (retention
    # pruned step 6 in favour of the earlier job's higher steps, and the restart went back to
    # PATH).
    run_dir = tmp_path / "run"
    keep = {"every": 2, "keep_last": 2, "keep_every": 4}
    earlier = tiny_raw(run_dir, JOB, train={"steps": 12}, checkpoint=keep)
    again = tiny_raw(run_dir, JOB, train={"steps": 12}, checkpoint=keep)
    again["run"]["resume"] = str(run_dir / "checkpoints/step-00000004")
    out = run_ranks(two_jobs_then_crash, 2, earlier, again, 7)
    assert out[0]["left"] == [12, 10, 8, 4]
    assert [o["start_step"] for o in out] == [6, 6]


def test_a_peer_lost_outside_the_loop_is_said_as_such() -> None:
    # A rank whose peer was killed during a resume said only "DistNetworkError: Broken pipe".
    import torch.distributed as dist

    from dtrain.fault.peer_failure import PeerFailure
    from dtrain.worker import lost_peer_words

    words = lost_peer_words(dist.DistNetworkError("Broken pipe"), "DistNetworkError: Broken pipe")
    assert words == (
        "lost a peer outside the training loop (starting, resuming or ending: DistNetworkError: "
        "Broken pipe): a rank of the job ended or was killed; its own line, or the launcher's, "
        "says why"
    )
    # The loop's own diagnosis, a timeout and this rank's own error stand as they are.
    for error in (
        PeerFailure("rank 1 (h) at step 3 in forward_backward: a collective failed: broken pipe"),
        dist.DistNetworkError("timed out after 30s"),
        ValueError("broken pipe in the user's own code"),
    ):
        assert lost_peer_words(error, "as it was") == "as it was"
