"""Where a command writes what it makes (``dtrain export``'s file, ``dtrain report``'s page,
``dtrain prepare``'s dataset, ``dtrain train``'s run folder): checked before any of the work,
so that a path the user cannot write is one line naming it instead of a traceback at the
end."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from dtrain.errors import UserError


def require_output_folder(folder: Path, label: str, choose: str = "path") -> None:
    """``folder`` exists (made with its parents if need be) and takes a new file; otherwise a
    :class:`UserError` that starts with ``label`` (what the user gave, e.g. ``"OUT x.pt"``) and
    asks for another ``choose`` (e.g. ``"run.dir"``)."""
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:  # the folder is, or runs through, a file
        raise UserError(f"{label}: {blocker} is a file, not a folder; choose another {choose}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".dtrain-write-check-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise UserError(
            f"{label}: cannot write in {folder} ({exc.strerror or exc}); choose a {choose} where "
            "this user may write"
        ) from None
