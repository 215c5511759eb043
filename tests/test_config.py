from __future__ import annotations

from pathlib import Path

import pytest

from dtrain.config import Config
from dtrain.config.load import build_config, load_config, parse_override
from dtrain.errors import ConfigError
from dtrain.tasks.gpt import GPTTaskConfig


def test_defaults_round_trip_through_toml(tmp_path: Path) -> None:
    cfg = Config()
    path = tmp_path / "c.toml"
    path.write_text(cfg.to_toml())
    again = load_config(path)
    assert again.to_dict() == cfg.to_dict()


def test_file_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[train]\nsteps = 7\n[optim]\nlr = 0.5\n")
    cfg = load_config(path, ["--train.steps=9", "--optim.betas=[0.8, 0.9]", "--run.dir=x y"])
    assert cfg.train.steps == 9
    assert cfg.optim.lr == 0.5
    assert cfg.optim.betas == [0.8, 0.9]
    assert cfg.run.dir == "x y"


def test_integer_accepted_where_a_float_is_expected() -> None:
    assert build_config({"optim": {"lr": 1}}).optim.lr == 1.0


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"train": {"stepz": 3}}, "unknown config key train.stepz (did you mean train.steps?)"),
        ({"trian": {"steps": 3}}, "unknown config section [trian] (did you mean train?)"),
        (
            {"train": {"steps": "many"}},
            "train.steps = 'many' has the wrong type: expected an integer",
        ),
        ({"train": {"steps": 1.5}}, "expected an integer"),
        ({"train": {"steps": True}}, "expected an integer"),
        ({"train": {"steps": 0}}, "train.steps = 0 is out of range: it must be at least 1"),
        ({"optim": {"lr": 0}}, "optim.lr = 0.0 is out of range: it must be greater than 0"),
        ({"optim": {"min_lr_ratio": 2}}, "it must be at most 1"),
        (
            {"optim": {"name": "adam"}},
            "optim.name = 'adam' is not allowed: expected one of 'adamw', 'sgd'",
        ),
        ({"optim": {"betas": [0.9]}}, "optim.betas"),
        ({"optim": {"betas": "x"}}, "expected a list, each item a number"),
        ({"data": {"micro_batches": 9, "global_batch_size": 8}}, "every micro-step needs"),
        ({"train": 3}, "config section [train] must be a table"),
        # A key above every [section] of a file: it was "unknown config section [steps]".
        (
            {"steps": 3},
            "config key steps = 3 is outside any section; put it under [train] (on the "
            "command line: --train.steps=...)",
        ),
        (
            {"every": 3},
            "config key every = 3 is outside any section; put it under [eval] or [checkpoint] "
            "or [balance] (on the command line: --eval.every=...)",
        ),
    ],
)
def test_bad_values_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_config(raw)
    assert message in str(err.value)


def test_task_section_is_validated_by_the_task_config_class() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown config key task\.d_modle \(did you mean "
        r"task\.d_model\?\)",
    ):
        build_config({"task": {"d_modle": 3}}, GPTTaskConfig)
    cfg = build_config({"task": {"d_model": 64}}, GPTTaskConfig)
    assert cfg.task.d_model == 64


def test_missing_and_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a folder"):
        load_config(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps=")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError):
        load_config(binary)


def test_override_parsing() -> None:
    assert parse_override("--a.b=3") == (["a", "b"], 3)
    assert parse_override("--a.b=hello") == (["a", "b"], "hello")
    assert parse_override("--a.b=true") == (["a", "b"], True)
    with pytest.raises(ConfigError, match="has no value"):
        parse_override("--a.b")
    with pytest.raises(ConfigError, match=r"section\.key"):
        parse_override("--steps=3")


def test_docs_config_reference_is_up_to_date() -> None:
    from dtrain.cli.commands import options_markdown
    from tests.conftest import REPO

    assert (REPO / "docs" / "config.md").read_text() == options_markdown(), (
        "docs/config.md is stale: run `dtrain config --markdown > docs/config.md`"
    )


def test_every_toml_block_of_the_docs_is_a_valid_config(tmp_path: Path) -> None:
    # A reader copies them into a file: docs/strategies.md had four alternatives in one block,
    # which is no valid TOML ("Cannot declare ('strategy',) twice").
    import re

    from tests.conftest import REPO

    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    blocks = [
        (page.name, match.group(1))
        for page in pages
        for match in re.finditer(r"```toml\n(.*?)```", page.read_text(), re.S)
    ]
    assert len(blocks) >= 10
    for index, (name, block) in enumerate(blocks):
        path = tmp_path / f"block{index}.toml"
        path.write_text(block)
        try:
            load_config(path)
        except ConfigError as exc:
            raise AssertionError(f"{name}: {exc}\n{block}") from None


def test_preempt_signals_are_signals_that_mean_stop() -> None:
    """SIGCHLD comes whenever a child process ends: it was accepted and stopped a run at step
    1. Only the signals that mean "stop" may make the ranks save and exit; any other is one
    line at load naming the key and every allowed name."""
    stops = ["SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGQUIT", "SIGXCPU"]
    assert build_config({"fault": {"preempt_signals": stops}}).fault.preempt_signals == stops
    for name in ("SIGCHLD", "SIGWINCH", "SIGALRM", "SIGSEGV", "SIGKILL", "TERM", "sigterm"):
        with pytest.raises(ConfigError) as err:
            build_config({"fault": {"preempt_signals": ["SIGTERM", name]}})
        message = str(err.value)
        assert message.startswith("fault.preempt_signals: ") and "\n" not in message
        assert message.endswith("; use any of " + ", ".join(stops)), message
