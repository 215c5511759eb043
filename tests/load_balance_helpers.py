"""Functions the ranks of tests/test_load_balance.py run (importable by the worker processes)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from dtrain.balance.timing import INDEX
from dtrain.fault.failpoints import failpoints
from tests.dist_helpers import make_trainer, params_of


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class ShapeRecorder:
    """Forwards to a RankLoader and records, per step, this rank's micro-steps and samples."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.shapes: list[tuple[int, int]] = []

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.shapes.append((len(batch.micro), sum(len(ids) for ids in batch.ids)))
        return batch

    def __iter__(self) -> ShapeRecorder:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def train_with_weights(raw: dict[str, Any], weights: list[float] | None) -> dict[str, Any]:
    """Train with fixed per-rank weights (loaded into the controller, as a resume would; the
    config's balance.every is beyond the run, so the controller never moves them). Returns
    the parameters and the micro-steps and samples this rank ran in each step."""
    trainer = make_trainer(raw)
    if weights is not None:
        trainer.balance.load_state_dict(
            {"world_size": len(weights), "controller": {"weights": weights, "smoothed": None}}
        )
    recorder = ShapeRecorder(trainer.loader)
    trainer.loader = recorder  # type: ignore[assignment]
    trainer.fit()
    return {"params": params_of(trainer), "shapes": recorder.shapes}


def _injector(per_item: dict[int, list[float]], every: int) -> Any:
    """A fail-point handler that replaces this rank's measured time per item in the timing
    window ending at step ``every x (k + 1)`` by ``per_item[rank][k]`` (the last value
    repeats), so that the controller sees exact, reproducible input. By step, not by count:
    a resumed run sees what the uninterrupted one saw at the same step."""
    times = per_item[_rank()]

    def handler(name: str, **args: Any) -> None:
        if name != "balance.timing":
            return
        window = args["window"]
        value = times[min(args["step"] // every - 1, len(times) - 1)]
        window[INDEX["time_per_item_s"]] = value
        window[INDEX["compute_s"]] = value * window[INDEX["items"]]
        window[INDEX["data_s"]] = 0.0

    return handler


class _Crash(RuntimeError):
    pass


def train_with_timings(
    raw: dict[str, Any], per_item: dict[int, list[float]], crash_step: int = 0
) -> dict[str, Any]:
    """Train with the controller fed ``per_item`` (see :func:`_injector`); with
    ``crash_step``, every rank raises at the start of that step and a fresh trainer resumes
    from the newest checkpoint and finishes. Returns the parameters, the ``balance``,
    ``ranks`` and ``straggler`` records, the start step of the last run and its final weights."""
    inject = _injector(per_item, raw["balance"]["every"])
    crashed: list[int] = []

    def handler(name: str, **args: Any) -> None:
        inject(name, **args)
        if name == "train.step" and args["step"] == crash_step and not crashed:
            crashed.append(crash_step)
            raise _Crash(f"injected crash at step {crash_step}")

    with failpoints(handler):
        trainer = make_trainer(raw)
        if crash_step:
            try:
                trainer.fit()
            except _Crash:
                pass
            trainer.checkpointer.wait()
            trainer = make_trainer(raw)
        summary = trainer.fit()
    records = [
        json.loads(line)
        for line in (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    ]
    return {
        "params": params_of(trainer),
        "balance": [r for r in records if r["kind"] == "balance"],
        "ranks": [r for r in records if r["kind"] == "ranks"],
        "stragglers": [r for r in records if r["kind"] == "straggler"],
        "start_step": summary.start_step,
        "final_weights": list(trainer.balance.weights),
    }


def train_saving_without_balance_part(raw: dict[str, Any]) -> dict[str, Any]:
    """Train and checkpoint without the ``balance`` part in train_state.pt, then resume from
    it with balancing on: the error that refuses it."""
    trainer = make_trainer(raw)
    parts = {k: v for k, v in trainer.state.parts.items() if k != "balance"}
    trainer.state = dataclasses.replace(trainer.state, parts=parts, optional=frozenset())
    trainer.fit()
    import torch

    from dtrain.checkpoint import layout

    step_dir = Path(raw["run"]["dir"]) / "checkpoints" / layout.step_dir_name(trainer.step)
    saved = torch.load(step_dir / layout.TRAIN_STATE_FILE, weights_only=True)
    resumed_raw = {**raw, "balance": {**raw["balance"], "mode": "throughput"}}
    resumed_raw["train"] = {**raw["train"], "steps": raw["train"]["steps"] + 4}
    from dtrain.errors import CheckpointError

    try:
        make_trainer(resumed_raw).fit()
    except CheckpointError as error:
        return {"saved_parts": sorted(saved), "error": str(error)}
    return {"saved_parts": sorted(saved), "error": ""}


def shares_by_step(run_dir: str) -> dict[int, list[float]]:
    """step -> each rank's share of the global batch over the timing window ending there."""
    out: dict[int, list[float]] = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "ranks":
            out[record["step"]] = record["share"]
    return out


def train_and_read_records(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Train; return every record of metrics.jsonl (rank 0's file)."""
    trainer = make_trainer(raw)
    trainer.fit()
    path = Path(raw["run"]["dir"]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if _rank() == 0 else []


def train_with_step_time(raw: dict[str, Any], step_s: float) -> list[dict[str, Any]]:
    """Train with every timing window reporting exactly ``step_s`` seconds a step (the
    fail point before the gather), so that the spacing of the windows is known; return rank
    0's metrics records."""

    def handler(name: str, **args: Any) -> None:
        if name == "balance.timing":
            window = args["window"]
            window[INDEX["step_s"]] = step_s * window[INDEX["steps"]]

    with failpoints(handler):
        return train_and_read_records(raw)
