"""An own loop's evaluation and early stop (``run.evaluate``, ``run.reduce``, ``run.stop``;
docs/own-loop.md): the evaluation's means count every item of the set once at any world size
(2 ranks equal one process, for a set that does not divide evenly), the reductions are over
the ranks, and one rank's wish to stop stops every rank after the same step, completed and
saved; a rank that leaves the stream while the others go on is named on every rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import tiny_raw
from tests.own_loops import (
    early_stop_example,
    evaluate_and_reduce,
    evaluation_mistake,
    leave_stream,
    stop_on_one_rank,
)
from tests.ranks import run_ranks
from tests.test_fault import JOB

# 7 + 6 samples on 2 ranks, in batches of 3 (3 + 3 + 1 and 3 + 3): shares and batches uneven;
# under fsdp (a forward with collectives) rank 1 runs a padding batch, not counted.
SAMPLES = 13


def eval_records(run_dir: Path) -> list[dict[str, object]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == "eval"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_an_own_evaluation_on_two_ranks_equals_one_process(tmp_path: Path, strategy: str) -> None:
    from tests.tasks import RandomTokens

    sections = {"train": {"steps": 2}, "strategy": {"name": strategy}}
    raws = {n: tiny_raw(tmp_path / str(n), **sections) for n in (1, 2)}
    one = run_ranks(evaluate_and_reduce, 1, raws[1], SAMPLES)[0]
    two = run_ranks(evaluate_and_reduce, 2, raws[2], SAMPLES)
    assert two[0]["eval"] == two[1]["eval"]  # every rank has the reduced values
    assert abs(two[0]["eval"]["loss"] - one["eval"]["loss"]) <= 1e-6
    # The targets' mean is the data's: each of the set's items counted exactly once.
    seq_len = raws[1]["task"]["seq_len"]
    data = RandomTokens(max(8, raws[1]["task"]["samples"] // 8), seq_len, seed=2)
    targets = np.concatenate([np.asarray(data[i])[1:] for i in range(SAMPLES)])
    for result in (one, two[0]):
        assert result["eval"]["token"] == pytest.approx(targets.mean(), abs=1e-12)
    for run_dir in (tmp_path / "1", tmp_path / "2"):
        (record,) = eval_records(run_dir)
        assert record["step"] == 0 and record["val_items"] == SAMPLES * seq_len
        assert record["val_loss"] == pytest.approx(one["eval"]["loss"], abs=1e-6)
    # run.reduce over the ranks: rank r holds r + 1.
    assert two[0]["reduce"] == two[1]["reduce"] == {"sum": 3, "mean": 1.5, "max": 2, "min": 1}
    assert two[1]["reduce_tensor"] == [3.0, 3.0]
    assert one["reduce"] == {"sum": 1, "mean": 1, "max": 1, "min": 1}
    lines = (tmp_path / "2" / "metrics.jsonl").read_text().splitlines()
    (logged,) = [r for r in map(json.loads, lines) if r.get("name") == "log"]
    assert (logged["kind"], logged["step"], logged["ranks_summed"]) == ("event", 2, 3)


def test_one_rank_s_stop_stops_every_rank_after_the_same_step_saved(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    raw = tiny_raw(run_dir, JOB)  # 16 steps, checkpoints every 4
    ended = run_ranks(stop_on_one_rank, 2, raw, 1, 6)
    assert [e["steps"] for e in ended] == [6, 6]
    assert [e["stopped"] for e in ended] == ["rank 1 had enough"] * 2
    assert [e["preempted"] for e in ended] == ["", ""]
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["state"], status["step"]) == ("completed", 6)
    assert (run_dir / "checkpoints/step-00000006/COMMITTED.json").exists()
    assert not (run_dir / "checkpoints/step-00000008").exists()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (summary,) = [r for r in records if r.get("kind") == "summary"]
    assert (summary["state"], summary["step"]) == ("completed", 6)
    assert summary["stopped"] == "rank 1 had enough"


def test_a_rank_that_leaves_the_stream_alone_is_named_on_every_rank(tmp_path: Path) -> None:
    # Rank 1 breaks out of run.batches() after step 3, rank 0 goes on: rank 1 learns it from
    # rank 0's beat and says so; rank 0's gradient sync of step 4 fails at once, quoting it.
    # (Before: both waited until the collective timeout, then blamed a checkpoint's commit.)
    raw = tiny_raw(tmp_path / "run", train={"steps": 5})
    said = [r["said"] for r in run_ranks(leave_stream, 2, raw, [1], 3)]
    words = "rank 1 left run.batches() after step 3 while rank 0 went on to step 4"
    assert said[1].startswith(words) and "run.stop(reason)" in said[1]
    assert said[0].startswith("rank 0 (") and "at step 4 in forward_backward" in said[0]
    assert words in said[0]
    assert "\n" not in said[0] + said[1]
    # Every rank leaving after the same step is no mistake: the run ends there, saved.
    raw = tiny_raw(tmp_path / "both", train={"steps": 5})
    together = run_ranks(leave_stream, 2, raw, [0, 1], 3)
    assert [(r["said"], r["steps"], r["preempted"]) for r in together] == [("", 3, "")] * 2
    assert (tmp_path / "both/checkpoints/step-00000003/COMMITTED.json").exists()


def test_the_early_stop_example_stops_every_rank_after_the_step_that_follows_its_decision(
    tmp_path: Path,
) -> None:
    # Evaluations every 3 steps; no loss betters the first by 1.0, so the second (step 6)
    # asks to stop, on every rank alike: every rank stops after step 7, saved.
    run_dir = tmp_path / "run"
    raw = tiny_raw(run_dir, JOB, eval={"every": 3, "max_samples": 0})
    ended = run_ranks(early_stop_example, 2, raw, 1, 1.0)
    assert [e["steps"] for e in ended] == [7, 7]
    assert ended[0]["stopped"] == ended[1]["stopped"]
    assert ended[0]["stopped"].endswith("not bettered in the last 1 evaluation(s)")
    assert ended[0]["evaluations"] == ended[1]["evaluations"]
    assert len(ended[0]["evaluations"]) == 2
    assert (run_dir / "checkpoints/step-00000007/COMMITTED.json").exists()
    records = eval_records(run_dir)
    assert [r["step"] for r in records] == [3, 6]
    assert [r["val_accuracy"] for r in records] == [e["accuracy"] for e in ended[0]["evaluations"]]
    assert json.loads((run_dir / "status.json").read_text())["state"] == "completed"


@pytest.mark.parametrize(
    ("kind", "says"),
    [
        ("no loss", "fn returned dict: return the batch's per-item losses"),
        ("a number", "fn's 'loss' is a float: give a tensor of per-item values"),
        ("reserved name", "'items' cannot name a value"),
    ],
)
def test_an_evaluation_s_mistake_is_one_line(tmp_path: Path, kind: str, says: str) -> None:
    said = run_ranks(evaluation_mistake, 1, tiny_raw(tmp_path / "run"), kind)[0]
    assert says in said and "\n" not in said
