"""One place says no: every rule of a config -- across keys, across packages, at the job's shape
-- lives in ``dtrain.config``, read from one capability record per strategy; the parent checks
before any worker starts, and a worker trusts the check its launcher made (plain ``torchrun``
runs the same checks once, in the worker)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dtrain.checkpoint.forms import Form
from dtrain.comm.compression import HOOKS
from dtrain.config.capabilities import CAPABILITIES, capabilities
from dtrain.config.checks import SUMMING_COMPRESSIONS
from dtrain.config.job import CHECKED_ENV
from dtrain.errors import ConfigError
from dtrain.parallel import strategy_class, strategy_names
from dtrain.parallel.base import CommHookControl
from dtrain.parallel.sharded import MeshStrategy
from dtrain.worker import load_worker_config
from tests.test_imports import HEAVY, SRC, import_graph, loaded_after, package_graph

# Outside the config package a ConfigError says that what a worker alone sees does not fit the
# config: the task's model (its blocks, its pipeline layers, its tensor-parallel plan, a Hugging
# Face model's architecture), the data set, the machine's devices, or the ranks' configs
# disagreeing. None of them can be checked from the config alone. A new module here is a
# config rule that belongs in dtrain/config/ unless it, too, needs the worker's objects.
WORKER_SIDE_CHECKS = {
    "dtrain/data/build.py",  # data.split = 'tokens' and a data set without sample lengths
    "dtrain/data/partition.py",  # an OrderSpec built by hand with an unknown shuffle
    "dtrain/dist/runtime.py",  # dist.device = 'cuda' on a machine without one
    "dtrain/hf.py",  # a Hugging Face architecture the pipeline cannot cut
    "dtrain/parallel/pipeline/plan.py",  # more stages than the model has layers
    "dtrain/parallel/pipeline/split.py",  # a model that is no chain of layers
    "dtrain/parallel/pipeline/stages.py",  # layer costs and memory limits, measured
    "dtrain/parallel/recipe.py",  # a model without repeated blocks
    "dtrain/parallel/tensor_plan.py",  # a model without a plan, or with dropout
    "dtrain/tasks/gpt.py",  # the task's own [task] section (its dataclass, in the parent)
    "dtrain/train/config_agreement.py",  # ranks started with different configs
}
# An opt-in extension's own options (dtrain.ext), checked in the parent right after the config
# package's rules (comm.transport.check_transport_job): the core does not know them by name.
EXTENSION_CHECKS = {
    "dtrain/comm/transport.py",  # a comm.transport no extension answers to
    "dtrain/ext/shm.py",  # what a shared-memory segment cannot carry
}


def raised_names(path: Path) -> set[str]:
    """The exception classes ``path`` raises by name (``raise X(...)``, ``raise X``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Raise) and node.exc is not None:
            target = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(target, ast.Name):
                names.add(target.id)
    return names


def test_config_errors_are_raised_in_the_config_package_and_where_only_a_worker_can_see() -> None:
    package = SRC / "dtrain"
    raising = {
        str(path.relative_to(SRC))
        for path in package.rglob("*.py")
        if "ConfigError" in raised_names(path)
    }
    inside = {name for name in raising if name.startswith("dtrain/config/")}
    assert {"dtrain/config/checks.py", "dtrain/config/job.py"} <= inside  # it read the tree
    assert raising - inside == WORKER_SIDE_CHECKS | EXTENSION_CHECKS


def test_the_entry_points_and_the_launcher_leave_the_rules_to_the_config_package() -> None:
    # cli.cmd_train, launch/inplace.check_machines and Strategy.validate_config said no on
    # their own once; the parent's command line and launcher now raise no config error.
    for folder in ("cli", "launch", "parallel"):
        for path in (SRC / "dtrain" / folder).rglob("*.py"):
            if str(path.relative_to(SRC)) in WORKER_SIDE_CHECKS:
                continue
            assert "ConfigError" not in raised_names(path), path
    assert "UserError" not in raised_names(SRC / "dtrain" / "cli" / "train.py")


def test_each_strategy_has_a_record_that_agrees_with_its_class() -> None:
    assert sorted(CAPABILITIES) == strategy_names()
    for name in strategy_names():
        cls, can = strategy_class(name), capabilities(name)
        assert can.comm_hooks == issubclass(cls, CommHookControl), name
        assert can.sharded_state == issubclass(cls, MeshStrategy), name
        assert can.sharded_state == (cls.state_form is Form.SHARDED), name
        assert can.on_mesh == issubclass(cls, MeshStrategy), name
        # Gradients meeting once per step is what uneven shares need; comm hooks do that.
        assert not can.uneven_shares or can.comm_hooks, name
    with pytest.raises(ConfigError, match=r"strategy.name = 'zero' is not a strategy; valid: "):
        strategy_class("zero")


def test_the_summing_compressions_are_the_hooks_that_only_sum() -> None:
    assert set(SUMMING_COMPRESSIONS) == {name for name, hook in HOOKS.items() if hook.sums_only}


def test_checking_a_model_parallel_config_imports_no_strategy() -> None:
    # The rules stand below everything they judge: the config package imports only errors.
    assert package_graph(import_graph())["dtrain.config"] == {"dtrain.errors"}
    code = (
        "from dtrain.config.job import JobShape, validate_job\n"
        "from dtrain.config.load import build_config\n"
        "cfg = build_config({'strategy': {'name': 'pipeline', 'pipeline_schedule': 'gpipe'}})\n"
        "validate_job(cfg, JobShape(nproc=4))"
    )
    assert loaded_after(code, (*HEAVY, "torch", "dtrain.parallel")) == set()


BAD = "[strategy]\nname = 'fsdp'\n[comm]\ncompression = 'topk'\n"


def test_a_worker_trusts_the_config_its_launcher_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "job.toml"
    path.write_text(BAD)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(CHECKED_ENV, str(path))
    assert load_worker_config([str(path)]).comm.compression == "topk"  # not checked again
    # Overrides change what the launcher checked; another file was never checked.
    with pytest.raises(ConfigError, match=r"comm.compression = 'topk' does not work with"):
        load_worker_config([str(path), "--train.steps=3"])
    other = tmp_path / "other.toml"
    other.write_text(BAD)
    with pytest.raises(ConfigError, match=r"comm.compression = 'topk' does not work with"):
        load_worker_config([str(other)])


def test_a_worker_no_launcher_checked_for_runs_the_checks_at_its_world_size(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(CHECKED_ENV, raising=False)
    path = tmp_path / "job.toml"
    path.write_text("[strategy]\nname = 'tensor'\ntensor_parallel = 2\n")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match=r"tensor_parallel = 2 does not divide the world size 3"):
        load_worker_config([str(path)])
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert load_worker_config([str(path)]).strategy.tensor_parallel == 2
