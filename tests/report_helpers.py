"""Runs and run folders for tests/test_report.py and tests/test_status.py."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path
from typing import Any

from dtrain.report.plots import Plot
from tests.conftest import tiny_raw
from tests.dist_helpers import train_params
from tests.ranks import run_ranks

OBSERVED = {
    "train": {"steps": 12, "log_every": 2},
    "eval": {"every": 6},
    "checkpoint": {"every": 6},
    "balance": {"every": 3, "window_s": 0},  # per-rank records at steps 3, 6, 9, 12
}


def make_observed_run(run_dir: Path) -> Path:
    tensorboard = importlib.util.find_spec("tensorboard") is not None
    raw = tiny_raw(run_dir, OBSERVED, metrics={"tensorboard": tensorboard})
    run_ranks(train_params, 2, raw)
    # What `dtrain train` writes beside it (the report shows it).
    from dtrain.config.load import build_config

    (run_dir / "config.toml").write_text(build_config(raw).to_toml())
    return run_dir


def records_of(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (which must come first)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def legend_labels(plot: Plot) -> list[str]:
    """The labelled series of a plot (its legend's entries)."""
    out: list[str] = []
    for ax in plot.figure.axes:
        legend: Any = ax.get_legend()
        if legend is not None:
            out += [t.get_text() for t in legend.get_texts()]
    return out
