"""The job's secret: what proves that a value in the job's stores was written by the job.

torch's stores have no authentication: anyone who can reach a store's port may read and
write any key. A value that steers the job (torch's rendezvous state, which its agents
unpickle; dtrain's own membership and stop keys) is therefore sealed with an HMAC-SHA256 of
the job's secret, and one that fails the check is ignored (docs/security.md).

Where it comes from: ``DTRAIN_JOB_SECRET``, ``DTRAIN_JOB_SECRET_FILE`` (owner-only), or on a
single machine one the launcher makes and hands to its workers (docs/security.md). A job across
machines needs the same secret on every machine: a missing one is one line before any worker
starts; one that differs from the rendezvous host's, too
(:func:`dtrain.dist.rendezvous.check_secret`).
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat
from pathlib import Path

from dtrain.errors import UserError

SECRET_ENV = "DTRAIN_JOB_SECRET"
SECRET_FILE_ENV = "DTRAIN_JOB_SECRET_FILE"
MIN_LENGTH = 16  # characters: a 64-bit secret at the least (``openssl rand -hex 32`` gives 64)

_SEAL = b"dtrain-hmac1:"  # sealed value: _SEAL + 64 hex digits of the HMAC + b":" + value
_DIGEST_HEX = 64

HOW_TO = (
    f"make one with `umask 077; openssl rand -hex 32 > ~/.dtrain-secret` and give every "
    f"machine of the job {SECRET_FILE_ENV}=~/.dtrain-secret (or {SECRET_ENV}=<the secret>); "
    "see docs/security.md"
)


class JobSecret:
    """The job's secret; seals values with their key's name, so that a value sealed for one
    key cannot be replayed under another."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def digest(self, name: str, value: bytes) -> bytes:
        # hmac.digest: OpenSSL's one-shot HMAC, no Python object per value (the coordinator
        # opens one record per member when they all ask at once).
        return hmac.digest(self._key, name.encode() + b"\0" + value, "sha256").hex().encode()

    def seal(self, name: str, value: bytes) -> bytes:
        return _SEAL + self.digest(name, value) + b":" + value

    def unseal(self, name: str, sealed: bytes) -> bytes | None:
        """The value sealed under ``name``, or None when ``sealed`` is not such a value (not
        sealed, sealed with another secret or for another key, or altered)."""
        head = len(_SEAL) + _DIGEST_HEX
        if not sealed.startswith(_SEAL) or sealed[head : head + 1] != b":":
            return None
        value = sealed[head + 1 :]
        if not hmac.compare_digest(sealed[len(_SEAL) : head], self.digest(name, value)):
            return None
        return value


def read_secret_file(path: str) -> str:
    """The secret in the file at ``path``; a :class:`UserError` for a file that is missing,
    readable or writable by others than its owner, or too short."""
    where = f"{SECRET_FILE_ENV}={path}"
    try:
        info = os.stat(path)
        text = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{where}: cannot read the job's secret ({exc})") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise UserError(
            f"{where}: the job's secret is readable by other users (mode "
            f"{stat.S_IMODE(info.st_mode):o}); `chmod 600 {path}` and start again"
        )
    return text


def configured_secret() -> str | None:
    """The secret the environment gives (the variable, else the file), or None; a
    :class:`UserError` for one that is unusable."""
    text = os.environ.get(SECRET_ENV, "")
    where = SECRET_ENV
    if not text and os.environ.get(SECRET_FILE_ENV):
        where = f"{SECRET_FILE_ENV}={os.environ[SECRET_FILE_ENV]}"
        text = read_secret_file(os.environ[SECRET_FILE_ENV])
    if not text:
        return None
    if len(text) < MIN_LENGTH:
        raise UserError(
            f"{where}: the job's secret is {len(text)} characters; use at least {MIN_LENGTH} "
            f"({HOW_TO})"
        )
    return text


def launcher_secret(multi_machine: bool) -> JobSecret:
    """The launcher's secret, put in its environment (``DTRAIN_JOB_SECRET``) for the workers
    it starts. A job on one machine makes its own when none is given; one across machines
    must be given one, the same on every machine (a :class:`UserError` otherwise)."""
    text = configured_secret()
    if text is None:
        if multi_machine:
            raise UserError(f"a job across machines needs the job's secret: {HOW_TO}")
        text = secrets.token_hex(32)
    os.environ[SECRET_ENV] = text
    os.environ.pop(SECRET_FILE_ENV, None)  # the workers read the variable
    return JobSecret(text.encode())


def process_secret() -> JobSecret | None:
    """The secret a worker (or ``dtrain rendezvous``) was given, or None where there is none
    (a worker started by plain torchrun without one)."""
    text = configured_secret()
    return JobSecret(text.encode()) if text else None
