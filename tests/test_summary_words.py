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
