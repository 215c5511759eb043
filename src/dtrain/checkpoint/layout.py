"""The on-disk layout of checkpoints: ``checkpoints/step-N/`` folders and the names of the files
in them, one place for every writer and reader (a strategy names none: it gives named state
dicts with their form, :mod:`dtrain.checkpoint.forms`, and :func:`part_file` names their files).

A folder counts only once its completion marker (``COMMITTED.json``) exists and verifies
(:mod:`dtrain.checkpoint.read`); :mod:`dtrain.checkpoint.write` makes it so.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from dtrain.checkpoint.forms import Form
from dtrain.storage.objects import Location, ObjectPath

MARKER = "COMMITTED.json"
META = "meta.json"
SHARDED_DIR = "dcp"  # the sharded model and optimizer state, one file set per rank (DCP)
MODEL_FILE = "model.pt"  # the whole model state (replicated strategies, from rank 0)
OPTIMIZER_FILE = "optimizer.pt"  # the whole optimizer state (replicated strategies)
OUTER_FILE = "outer.pt"  # diloco's anchor and outer optimizer (rank 0)
TRAIN_STATE_FILE = "train_state.pt"  # scheduler, data position, trainer counters (rank 0)
_STEP_RE = re.compile(r"^step-(\d+)$")
# A save writes into .tmp-step-N, renamed step-N before its marker; a prune renames a folder
# .trash-step-N, its marker removed, before deleting it. Neither ever counts.
UNFINISHED_PREFIXES = (".tmp-", ".trash-")

# The marker holds one SHA-256 per piece of this many bytes of each file (the last piece may be
# shorter; an empty file is one empty piece), so that the ranks can verify one large file
# together, each its own pieces.
PIECE_BYTES = 64 * 2**20


def piece_count(size: int, piece_bytes: int = PIECE_BYTES) -> int:
    return max(1, -(-size // piece_bytes))


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def step_of(name: str) -> int | None:
    """The step of a ``step-N`` folder name (None for any other name)."""
    match = _STEP_RE.match(name)
    return int(match.group(1)) if match else None


def is_unfinished_step_dir_name(name: str) -> bool:
    """``.tmp-step-N`` or ``.trash-step-N``: a checkpoint's folder that does not count."""
    return any(
        name.startswith(prefix) and step_of(name[len(prefix) :]) is not None
        for prefix in UNFINISHED_PREFIXES
    )


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.pt"


def part_file(name: str, form: Form, rank: int) -> str:
    """The file of a whole part ``name`` (not sharded): ``<name>.pt`` written by rank 0
    (replicated), ``<name>-rankNNNNN.pt`` by each data-parallel rank (per rank) -- except the
    first rank's model and optimizer, which are the replicated files, so that a replicated
    strategy resumes from localsgd's replicas (rank 0's)."""
    if form is Form.REPLICATED or (rank == 0 and name in ("model", "optimizer")):
        return f"{name}.pt"
    return f"{name}-rank{rank:05d}.pt"


def list_step_dirs(root: Location) -> list[tuple[int, Location]]:
    """``(step, folder)`` of every ``step-N`` folder, newest first (committed or not)."""
    if isinstance(root, ObjectPath) and root.scheme == "s3":
        steps = {step for step in map(step_of, stored_folders(root)) if step is not None}
        return sorted(((step, root / step_dir_name(step)) for step in steps), reverse=True)
    if not root.is_dir():
        return []
    named = ((step_of(entry.name), entry) for entry in root.iterdir())
    return sorted(((s, e) for s, e in named if s is not None and e.is_dir()), reverse=True)


def stored_folders(root: ObjectPath) -> list[str]:
    """The names of the folders (prefixes) directly in an S3 store's ``root``: one listing."""
    try:
        found = root._call("list", lambda: root.fs.ls(root.url, detail=True))
    except FileNotFoundError:
        return []
    return [
        str(e["name"]).rstrip("/").rpartition("/")[2] for e in found if e["type"] == "directory"
    ]


def marker_digest(marker: dict[str, Any]) -> str:
    """SHA-256 of the marker's content (all but its own digest), canonically encoded."""
    rest = {k: v for k, v in marker.items() if k != "marker_sha256"}
    return hashlib.sha256(
        json.dumps(rest, sort_keys=True, separators=(",", ":")).encode()
    ).hexdigest()


def job_of(step_dir: Location) -> str:
    """The job that wrote the checkpoint in ``step_dir`` (its ``meta.json`` says); empty when
    unknown."""
    try:
        meta = json.loads((step_dir / META).read_text())
    except (OSError, ValueError):
        return ""
    return str(meta.get("job", "")) if isinstance(meta, dict) else ""


def committed_steps(root: Location) -> list[int]:
    """The steps whose folder holds a marker, newest first (not yet verified)."""
    if isinstance(root, ObjectPath) and root.scheme == "s3":
        # Every object under root in one flat listing (paged by the store), rather than a
        # request per folder and per marker.
        named = (key.partition("/") for key in root.sizes())
        steps = {step_of(folder) for folder, _, rest in named if rest == MARKER}
        return sorted((step for step in steps if step is not None), reverse=True)
    return [step for step, path in list_step_dirs(root) if (path / MARKER).exists()]
