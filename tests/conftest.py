from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dtrain.config import Config, build_config

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    # Never let a test write into the user's ~/.cache; share one cache across the session.
    cache = tmp_path_factory.getbasetemp() / "xdg-cache"
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(cache)
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


def tiny_config(run_dir: Path, **sections: dict[str, object]) -> Config:
    """A fast config on the tiny test GPT; keyword arguments override whole sections' keys."""
    from tests.tasks import TinyOptions

    raw: dict[str, dict[str, object]] = {
        "run": {"dir": str(run_dir), "task": "tests.tasks:tiny_gpt", "seed": 0},
        "data": {"global_batch_size": 8, "prefetch": 0},
        "train": {"steps": 20, "log_every": 5},
        # SGD: its update is linear in the gradient, so parameters compare at rtol 1e-5. (Adam
        # divides by sqrt(v); where a gradient is ~0 that turns last-bit summation-order
        # differences into visible ones, which would test rounding, not the math.)
        "optim": {"name": "sgd", "lr": 0.5, "warmup_steps": 2},
        "eval": {"every": 0, "batch_size": 8},
        "checkpoint": {"every": 0},
        "task": {},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return build_config(raw, TinyOptions)
