"""The summary a finished run prints: its duration in words a newcomer reads right."""

from __future__ import annotations

import pytest

from dtrain.metrics.summary import Summary, print_summary


@pytest.mark.parametrize(
    ("wall_s", "said"), [(0.84, "in 0.8s"), (8.26, "in 8.3s"), (148.0, "in 2m28s")]
)
def test_the_duration_of_a_short_run_is_not_zero(
    capsys: pytest.CaptureFixture[str], wall_s: float, said: str
) -> None:
    # A 20-step run that trained for 0.84 s said "in 0m00s" (whole seconds, cut down).
    summary = Summary(steps=20, wall_s=wall_s, train_loss=1.5, items=4096, checkpoint="c")
    print_summary(summary, "tokens", 2)
    head = capsys.readouterr().out.strip().splitlines()[0]
    assert head == f"done: 20 steps (20 this run) on 2 rank(s) {said}", head


def test_a_preempted_run_says_it_stopped_and_saved_in_one_clause(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # It said "stopped by SIGINT at step 32, saved (32 this run) on 2 rank(s) in 0m13s".
    summary = Summary(steps=32, wall_s=13.04, train_loss=2.9, items=65536, preempted="SIGINT")
    print_summary(summary, "tokens", 2)
    head = capsys.readouterr().out.strip().splitlines()[0]
    assert head == "stopped by SIGINT and saved at step 32 (32 this run) on 2 rank(s) in 13.0s"
