"""From TOML files and ``--section.key=value`` overrides to a checked :class:`Config`: unknown
sections and keys (with the nearest known name), wrong types and values out of range are each a
one-line :class:`ConfigError` naming the key. The schema lives in :mod:`dtrain.config`."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import sys
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from dtrain.config import Config, validate_cross_fields
from dtrain.errors import ConfigError

# The one place that picks the TOML reader (dtrain.config.resume reads through it too).
if sys.version_info >= (3, 11):
    import tomllib as tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib


def read_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist")
    if path.is_dir():
        raise ConfigError(f"config file {path} is a folder; give a .toml file")
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except PermissionError as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {path} is not UTF-8 text") from None


def parse_override(arg: str) -> tuple[list[str], Any]:
    """``--section.key=value`` to (['section', 'key'], value); the value is read as TOML when it
    parses as TOML (numbers, booleans, lists), else taken as a plain string."""
    body = arg[2:] if arg.startswith("--") else arg
    if "=" not in body:
        raise ConfigError(f"override {arg!r} has no value; write it as --section.key=value")
    dotted, raw = body.split("=", 1)
    keys = dotted.split(".")
    if len(keys) < 2 or not all(keys):
        raise ConfigError(f"override {arg!r}: the key must be section.key, e.g. --train.steps=100")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return keys, value


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    for arg in overrides:
        keys, value = parse_override(arg)
        node = raw
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {arg!r}: {key} is a value, not a section")
            node = child
        node[keys[-1]] = value
    return raw


def load_config(
    path: str | Path | None, overrides: Sequence[str] = (), task_config_class: type | None = None
) -> Config:
    raw = read_toml(path) if path is not None else {}
    raw = apply_overrides(raw, overrides)
    return build_config(raw, task_config_class)


def build_config(raw: Mapping[str, Any], task_config_class: type | None = None) -> Config:
    """A validated :class:`Config` from nested plain data; raises :class:`ConfigError`."""
    cfg = Config()
    sections = {f.name: f for f in dataclasses.fields(Config)}
    for name, values in raw.items():
        if name not in sections:
            homes = [
                s
                for s in sections
                if s != "task" and name in {f.name for f in dataclasses.fields(getattr(cfg, s))}
            ]
            if homes and not isinstance(values, Mapping):
                # A key above every [section] of the file (or written --steps=3 style).
                raise ConfigError(
                    f"config key {name} = {values!r} is outside any section; put it under "
                    f"{' or '.join(f'[{h}]' for h in homes)} (on the command line: "
                    f"--{homes[0]}.{name}=...)"
                )
            raise ConfigError(f"unknown config section [{name}]{_suggest(name, sections)}")
        if not isinstance(values, Mapping):
            raise ConfigError(f"config section [{name}] must be a table of keys, got {values!r}")
        if name == "task":
            cfg.task = dict(values)
            continue
        setattr(cfg, name, _build_section(name, type(getattr(cfg, name)), values))
    if task_config_class is not None:
        cfg.task = _build_section("task", task_config_class, cfg.task)
    validate_cross_fields(cfg)
    return cfg


def _build_section(section: str, cls: type, values: Mapping[str, Any]) -> Any:
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in values.items():
        if key not in known:
            raise ConfigError(
                f"unknown config key {section}.{key}{_suggest(key, known, prefix=section + '.')}"
            )
        kwargs[key] = _check_value(f"{section}.{key}", hints[key], value, known[key].metadata)
    return cls(**kwargs)


def _suggest(name: str, options: Mapping[str, Any] | Sequence[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(name, list(options), n=1, cutoff=0.5)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin is list:
        return f"a list, each item {_type_name(typing.get_args(tp)[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return {
        int: "an integer",
        float: "a number",
        bool: "true or false",
        str: "a string",
        type(None): "none",
    }.get(tp, str(tp))


def _check_value(key: str, tp: Any, value: Any, meta: Mapping[str, Any]) -> Any:
    value = _coerce(key, tp, value)
    low, high = meta.get("min"), meta.get("max")
    if isinstance(value, float) and not math.isfinite(value):
        # NaN passes every comparison as false, and infinity every lower bound: neither is a
        # setting (a NaN learning rate fails in torch's optimizer inside every worker).
        raise ConfigError(f"{key} = {value!r} is not a finite number")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if low is not None and (value < low or (meta.get("min_exclusive") and value == low)):
            relation = "greater than" if meta.get("min_exclusive") else "at least"
            raise ConfigError(f"{key} = {value!r} is out of range: it must be {relation} {low}")
        if high is not None and value > high:
            raise ConfigError(f"{key} = {value!r} is out of range: it must be at most {high}")
    return value


def _coerce(key: str, tp: Any, value: Any) -> Any:
    origin = typing.get_origin(tp)
    wrong = ConfigError(f"{key} = {value!r} has the wrong type: expected {_type_name(tp)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key} = {value!r} is not allowed: expected {_type_name(tp)}")
        return value
    if origin in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            with contextlib.suppress(ConfigError):
                return _coerce(key, arg, value)
        raise wrong
    if origin is list:
        (item,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise wrong
        return [_coerce(f"{key}[{i}]", item, v) for i, v in enumerate(value)]
    if tp in _PLAIN:
        # bool is an int to Python, never to a config: true is not 1.
        plain = isinstance(value, _PLAIN[tp]) and (tp is bool or not isinstance(value, bool))
        if not plain:
            raise wrong
        return float(value) if tp is float else value
    return value


# What each plain type of a key takes from TOML (a float key takes an integer too).
_PLAIN: dict[Any, type | tuple[type, ...]] = {
    bool: bool,
    int: int,
    float: (int, float),
    str: str,
    type(None): type(None),
}
