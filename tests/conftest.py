from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from dtrain.config import Config
from dtrain.config.load import build_config

REPO = Path(__file__).resolve().parent.parent

# The job's secret of the tests' multi-machine jobs (docs/security.md): every "machine" of a
# test job is a process started from here, and shares it through the environment. Tests of
# a missing or wrong secret set their own.
os.environ.setdefault("DTRAIN_JOB_SECRET", "dtrain-tests-job-secret-0123456789abcdef")


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


Sections = Mapping[str, Mapping[str, object]]


def tiny_config(
    run_dir: Path, job: Sections | None = None, /, **sections: Mapping[str, object]
) -> Config:
    """A fast config on the tiny test GPT: the defaults below, then ``job`` (a test module's
    own defaults, as ``{"train": {...}, ...}``), then ``sections``, each merged key by key
    into its section (``train={"steps": 6}`` keeps the other train keys)."""
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
    for overrides in (job or {}, sections):
        for name, values in overrides.items():
            raw.setdefault(name, {}).update(values)
    return build_config(raw, TinyOptions)


def tiny_raw(
    run_dir: Path, job: Sections | None = None, /, **sections: Mapping[str, object]
) -> dict[str, Any]:
    """:func:`tiny_config` as the dict a rank builds its config from (what ``run_ranks``
    passes to the ranks), validated here first."""
    return tiny_config(run_dir, job, **sections).to_dict()


@pytest.fixture(scope="session")
def observed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real run for the report and status tests (2 ranks, 12 steps: train records
    every 2 steps, per-rank records every 3, evaluations and checkpoints every 6, TensorBoard
    when installed), made once per session."""
    from tests.report_helpers import make_observed_run

    return make_observed_run(tmp_path_factory.mktemp("observed") / "run")


@pytest.fixture(scope="session")
def hf_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """The Hugging Face runs of tests.hf_helpers (GPT-2 and BERT under ddp, fsdp, pipeline;
    the loss-contract and init_from runs), trained once per session in one launch: (their
    root folder, rank 0's results by name). Needs transformers."""
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from tests.hf_helpers import train_hf_runs

    root = tmp_path_factory.mktemp("hf-runs")
    return root, train_hf_runs(root)


@pytest.fixture(scope="session")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference the exactness tests compare with, trained once per session: the tiny
    job's parameters after its 20 steps of batch 8 in one process (its name to a NumPy
    array). Read it, never change it: several tests share it."""
    from tests.dist_helpers import train_params
    from tests.ranks import run_ranks

    params: dict[str, Any] = run_ranks(train_params, 1, tiny_raw(tmp_path_factory.mktemp("one")))[0]
    return params
