"""The two kinds of failure dtrain tells apart.

A :class:`UserError` is the user's to fix (a bad config key, a missing file): the CLI prints its
one-line message and exits with code 2, with no traceback. Anything else is dtrain's own bug and
keeps its traceback.
"""

from __future__ import annotations

USER_ERROR_EXIT_CODE = 2

# Set by ``dtrain train``'s launcher of a one-machine job for its workers: it says each worker's
# user error itself, in one line for the ranks that failed alike, so a worker does not say it
# too (across machines, under plain ``torchrun`` or in one process, the worker says it).
LAUNCHER_SAYS_ENV = "DTRAIN_LAUNCHER_SAYS_ERRORS"


class UserError(Exception):
    """A mistake in what the user asked for; the message says what, where and what to do."""


class ConfigError(UserError):
    """A config key, value or file that cannot be used."""


class DataError(UserError):
    """A dataset that is missing, malformed or does not match what was asked for."""


class CheckpointError(UserError):
    """A checkpoint that is missing, corrupted or does not fit the job."""
