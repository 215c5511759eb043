"""Which keys a resumed run may change: those that do not change what is being trained. A
checkpoint's config (its ``meta.json``) against the config resuming it, key by key; the parent
checks before any worker starts (:mod:`dtrain.checkpoint.rundir` reads the checkpoint's)."""

from __future__ import annotations

from typing import Any

from dtrain.config.load import tomllib
from dtrain.config.sections import Config
from dtrain.errors import ConfigError

# Keys a resumed run may change without changing what is being trained.
SAFE_TO_CHANGE = (
    "run.dir",
    "run.local_dir",  # where this machine keeps its liveness and logs
    "run.resume",
    "run.init_from",  # the weights of step 0: a resumed run loads its checkpoint
    "train.steps",
    "train.log_every",
    "train.compile",  # the same numbers, within rounding; the same names
    "train.activation_checkpointing",  # the same numbers, bit for bit
    "eval.",
    "checkpoint.",
    "dist.",
    "data.num_workers",
    "data.prefetch",
    # The data position is one count of samples: a step takes the same global batch however
    # it is cut into micro-batches, and its gradient is that batch's mean for any cut (up to
    # rounding, as at another world size). A pipeline needs more of them than ddp does.
    "data.micro_batches",
    "strategy.",
    "metrics.",
    "comm.transport",  # how sums travel, not what they are
)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The keys that differ and may not (a key only one of them has differs: every config a
    run saves holds every key)."""
    before, after = flatten(saved), flatten(current)
    return [
        f"{key}: {before.get(key, '(unset)')!r} -> {after.get(key, '(unset)')!r}"
        for key in sorted(set(before) | set(after))
        if not key.startswith(SAFE_TO_CHANGE) and before.get(key) != after.get(key)
    ]


def check_resumed_config(saved_toml: str, cfg: Config, where: object) -> None:
    """A one-line error where ``cfg`` changes a key of the config the checkpoint at ``where``
    was made with (``saved_toml``, its text; unreadable: every key differs)."""
    try:
        saved = tomllib.loads(saved_toml)
    except tomllib.TOMLDecodeError:
        saved = {}
    diffs = config_differences(saved, cfg.to_dict())
    if diffs:
        shown = "; ".join(diffs[:10]) + (f"; ... {len(diffs) - 10} more" if len(diffs) > 10 else "")
        raise ConfigError(
            f"{where} was made with a different config ({shown}); use a new "
            "run.dir, or pass --force to resume anyway"
        )
