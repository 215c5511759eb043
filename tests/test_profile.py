"""``train.profile``: a torch.profiler trace per rank of the chosen steps, with the model's
forward and backward and the gradients' all-reduce in it, the losses unchanged bit for bit;
through a loop of the user's own too; `dtrain report` lists the traces; a range outside the
run is one line before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dtrain.config.load import build_config
from dtrain.errors import ConfigError
from dtrain.metrics.traces import list_traces
from tests.conftest import tiny_raw
from tests.dist_helpers import train_losses
from tests.ranks import run_ranks
from tests.test_cli import run_cli

JOB = {"train": {"steps": 5, "log_every": 1}}


def trained(raws: list[dict[str, Any]], own: dict[str, Any]) -> dict[str, Any]:
    """In each rank: every config of ``raws`` trained by dtrain's loop (their losses), then
    ``own`` by the own-loop example (its losses)."""
    from tests.own_loops import train_own_loop

    losses = [train_losses(raw) for raw in raws]
    train_own_loop(own)
    return {"losses": losses, "own": train_losses_of(own)}


def train_losses_of(raw: dict[str, Any]) -> list[float]:
    lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One launch of 2 ranks: the tiny job plain, the same profiled at steps 3-4, and the
    own-loop example profiled at step 2."""
    root = tmp_path_factory.mktemp("profile")
    plain = tiny_raw(root / "plain", JOB)
    profiled = tiny_raw(root / "profiled", JOB, train={**JOB["train"], "profile": "steps:3-4"})
    own = tiny_raw(root / "own", JOB, train={**JOB["train"], "profile": "steps:2"})
    results = run_ranks(trained, 2, [plain, profiled], own, timeout=240)
    return root, results[0]


def event_names(path: Path) -> set[str]:
    trace = json.loads(path.read_text())  # a valid Chrome trace: JSON with its events
    return {str(event.get("name")) for event in trace["traceEvents"]}


def test_a_profiled_run_writes_a_trace_per_rank_of_its_steps_with_unchanged_losses(
    profiled: tuple[Path, dict[str, Any]],
) -> None:
    root, result = profiled
    plain, with_profile = result["losses"]
    assert len(plain) == 5 and plain == with_profile  # the same bits
    traces = list_traces(root / "profiled")
    assert [(t.rank, t.first, t.last) for t in traces] == [(0, 3, 4), (1, 3, 4)]
    assert [t.path.name for t in traces] == ["rank0-steps3-4.json", "rank1-steps3-4.json"]
    assert sorted(p.name for p in (root / "profiled" / "traces").iterdir()) == [
        t.path.name for t in traces
    ]  # nothing half-written left beside them
    for trace in traces:
        names = event_names(trace.path)
        # Exactly the window's steps, each one range.
        assert {n for n in names if n.startswith("dtrain step")} == {
            "dtrain step 3",
            "dtrain step 4",
        }
        assert "DistributedDataParallel.forward" in names  # the model's forward, under ddp
        assert "aten::addmm" in names or "aten::mm" in names  # its matrix products
        assert any(n.startswith("autograd::engine::evaluate_function") for n in names)  # backward
        assert any("Backward0" in n for n in names)
        assert "gloo:all_reduce" in names  # the gradients' sync
        assert "Optimizer.step#SGD.step" in names
    assert list_traces(root / "plain") == []


def test_an_own_loop_is_profiled_through_the_same_step_ends(
    profiled: tuple[Path, dict[str, Any]],
) -> None:
    root, result = profiled
    assert result["own"] == result["losses"][0]  # the example's losses, dtrain's loop's
    traces = list_traces(root / "own")
    assert [(t.rank, t.first, t.last, t.steps) for t in traces] == [
        (0, 2, 2, "2"),
        (1, 2, 2, "2"),
    ]
    names = event_names(traces[0].path)
    assert {n for n in names if n.startswith("dtrain step")} == {"dtrain step 2"}
    assert "gloo:all_reduce" in names


def test_the_report_page_lists_the_traces(profiled: tuple[Path, dict[str, Any]]) -> None:
    from dtrain.report.page import render
    from dtrain.report.read import read_runs

    root, _ = profiled
    page = render(read_runs([root / "profiled"]), [], [])
    assert "Profiler traces" in page
    for rank in (0, 1):
        assert f"traces/rank{rank}-steps3-4.json" in page
    assert "Profiler traces" not in render(read_runs([root / "plain"]), [], [])


def test_no_profiler_is_alive_outside_the_window(tmp_path: Path) -> None:
    """The window's steps only: before step A and after step B nothing records (torch's
    profiler is off, and the loop holds no profiler object)."""
    import torch

    from dtrain.train.profile import StepProfiler

    cfg = build_config(tiny_raw(tmp_path, JOB, train={**JOB["train"], "profile": "steps:2-3"}))
    profiler = StepProfiler(cfg, rank=0, device=torch.device("cpu"))
    seen = []
    for step in range(1, 6):
        profiler.step_starting(step)
        torch.ones(4).sum()
        seen.append(torch.autograd.profiler._is_profiler_enabled)
        written = profiler.step_ended(step, stopping=False)
        assert (written is not None) == (step == 3)
        seen.append(profiler._profiler is not None)
    # (recording during step, alive after step) for steps 1 to 5
    assert seen == [False, False, True, True, True, False, False, False, False, False]
    names = event_names(tmp_path / "traces" / "rank0-steps2-3.json")
    assert {n for n in names if n.startswith("dtrain step")} == {"dtrain step 2", "dtrain step 3"}
    assert "aten::ones" in names


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("steps:4-3", r"train.profile = 'steps:4-3': steps 4 to 3; expected 'steps:A-B'"),
        ("steps:0-2", r"steps 0 to 2; expected"),
        ("steps:3-9", r"step 9 is past the run's last \(train.steps = 5\)"),
        ("3-4", r"train.profile = '3-4': expected 'steps:A-B'"),
        ("steps:a-b", r"expected 'steps:A-B'"),
        ("steps:3-", r"expected 'steps:A-B'"),
    ],
)
def test_a_range_outside_the_run_is_one_line(tmp_path: Path, value: str, message: str) -> None:
    raw = tiny_raw(tmp_path, JOB)
    raw["train"]["profile"] = value
    with pytest.raises(ConfigError, match=message):
        build_config(raw)


def test_the_command_line_refuses_a_range_before_any_worker_starts(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        "train",
        "--nproc",
        "2",
        f"--run.dir={run_dir}",
        "--train.steps=5",
        "--train.profile=steps:2-8",
    )
    assert result.returncode == 2, result.stderr
    assert "train.profile = 'steps:2-8': step 8 is past the run's last" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (run_dir / "traces").exists() and not (run_dir / "metrics.jsonl").exists()
