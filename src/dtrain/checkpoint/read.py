"""Reading checkpoints: finding the newest ``step-N`` folder that verifies against its completion
marker, removing what interrupted saves left, loading files, and checking that a saved model
fits the one being trained.

Loading never runs code from a checkpoint, even one whose marker a writer re-sealed (its
digests are unkeyed): whole files load with ``torch.load(weights_only=True)``, and the sharded
state (``dcp/``) through :mod:`dtrain.checkpoint.safe_dcp`, whose metadata admits only DCP's own
classes and whose items only tensors and plain data, read from the files the marker lists
(:mod:`dtrain.checkpoint.safe_load`). Writing, and the commit protocol that makes a folder count,
are in :mod:`dtrain.checkpoint.write`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dtrain.checkpoint import copies
from dtrain.checkpoint.layout import (
    MARKER,
    META,
    SHARDED_DIR,
    UNFINISHED_PREFIXES,
    committed_steps,
    list_step_dirs,
    marker_digest,
    piece_count,
    step_of,
    stored_folders,
)
from dtrain.checkpoint.safe_load import load_file as load_file
from dtrain.checkpoint.safe_load import open_verified
from dtrain.checkpoint.store import remove_tree, sync_folder
from dtrain.checkpoint.verify import pieces_of, verify_pieces
from dtrain.errors import CheckpointError
from dtrain.storage.objects import Location, ObjectPath

if TYPE_CHECKING:
    from dtrain.checkpoint.safe_dcp import SafeReader

# ---------------------------------------------------------------------------------------------
# Finding and verifying


# The marker's own keys; ``marker_sha256`` is a digest of the others.
_MARKER_KEYS = frozenset({"step", "files", "world_size", "committed", "marker_sha256"})


def read_marker(step_dir: Location) -> dict[str, Any]:
    """The completion marker, checked against its own digest, so that any damage to it (not
    only to the files it lists) makes the checkpoint count as corrupted."""
    path = step_dir / MARKER
    kept = copies.active()
    try:
        if kept is not None and isinstance(path, ObjectPath):  # read once in a resume
            text = kept.read_once(path)
        else:
            text = path.read_bytes()
        marker = json.loads(text.decode())
    except (FileNotFoundError, NotADirectoryError):
        # Looked up only now: a store answers each look-up with a request.
        if not step_dir.is_dir():
            raise CheckpointError(f"checkpoint folder {step_dir} does not exist") from None
        raise CheckpointError(f"{step_dir} has no {MARKER}: the save did not finish") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is corrupted: {exc}") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{path} is corrupted: no file list")
    unknown = sorted(set(marker) - _MARKER_KEYS)
    if unknown:
        raise CheckpointError(f"{path} is corrupted: unexpected key(s) {unknown}")
    if marker.get("marker_sha256") != marker_digest(marker):
        raise CheckpointError(f"{path} fails its own SHA-256 checksum")
    for name, info in marker["files"].items():
        if not _good_entry(info):
            raise CheckpointError(f"{path} is corrupted: bad entry for {name!r}")
    return marker


def _good_entry(info: Any) -> bool:
    """A file's entry: its size, and its pieces' digests."""
    if not isinstance(info, dict) or not isinstance(info.get("bytes"), int):
        return False
    step, pieces = info.get("piece_bytes"), info.get("pieces")
    return (
        isinstance(step, int)
        and step > 0
        and isinstance(pieces, list)
        and all(isinstance(digest, str) for digest in pieces)
        and len(pieces) == piece_count(info["bytes"], step)
    )


def verify_checkpoint(step_dir: Location, on_progress: Callable[[], None] | None = None) -> None:
    """Raise :class:`CheckpointError` naming the first file that does not match the marker,
    checking every file in this process (the ranks of a job share the work instead:
    :func:`dtrain.checkpoint.resume.resolve_resume`); ``on_progress`` is called as the files
    are hashed (after each 8 MiB and each piece)."""
    problem = verify_pieces(step_dir, pieces_of(read_marker(step_dir)), on_progress)
    if problem:
        raise CheckpointError(problem)


def check_marker_and_meta(step_dir: Location) -> None:
    """The cheap part of :func:`verify_checkpoint`: the marker and ``meta.json`` (a few kB),
    not the state's files. What the launcher reads before any worker starts; the workers
    verify every file."""
    meta = [piece for piece in pieces_of(read_marker(step_dir)) if piece.name == META]
    if not meta:
        raise CheckpointError(f"{step_dir / MARKER} lists no {META}")
    problem = verify_pieces(step_dir, meta)
    if problem:
        raise CheckpointError(problem)


def find_latest_valid(
    root: Location, check: Callable[[Location], None] | None = None
) -> tuple[Location | None, list[tuple[Location, str]]]:
    """The newest checkpoint that verifies, and the newer ones skipped with their reason.
    ``check``: what verifying is (default: :func:`verify_checkpoint`, every file)."""
    skipped: list[tuple[Location, str]] = []
    for _, path in list_step_dirs(root):
        try:
            (check or verify_checkpoint)(path)
        except CheckpointError as exc:
            skipped.append((path, str(exc)))
            continue
        return path, skipped
    return None, skipped


def remove_leftovers(root: Location) -> list[Location]:
    """Delete what interrupted saves and prunes left: temp folders and uncommitted ``step-N``
    folders. Call on rank 0 before anything else writes checkpoints."""
    removed: list[Location] = []
    if isinstance(root, ObjectPath) and root.scheme == "s3":  # two listings, not 2 per entry
        committed = set(committed_steps(root))
        for name in stored_folders(root):
            step = step_of(name)
            if name.startswith(UNFINISHED_PREFIXES) or (step is not None and step not in committed):
                removed += _removed(root / name)
        return removed
    if not root.is_dir():
        return removed
    for entry in root.iterdir():
        stale = entry.name.startswith(UNFINISHED_PREFIXES)
        uncommitted = step_of(entry.name) is not None and not (entry / MARKER).exists()
        if entry.is_dir() and (stale or uncommitted):
            removed += _removed(entry)
    if removed:
        sync_folder(root)
    return removed


def _removed(folder: Location) -> list[Location]:
    """``[folder]`` once deleted; none where a store failed it (it never counts, and the next
    start tries again)."""
    try:
        remove_tree(folder)
    except OSError:
        return []
    return [folder]


def load_meta(step_dir: Location) -> dict[str, Any]:
    try:
        with open_verified(step_dir / META) as fh:  # a resume's copy, where it keeps one
            return json.loads(fh.read().decode())
    except FileNotFoundError:
        raise CheckpointError(f"{step_dir / META} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{step_dir / META} is corrupted: {exc}") from None


# torch's list of groups, flattened by DCP: each group's parameter names under this key.
_GROUP_PARAMS = re.compile(r"optimizer\.param_groups\.(\d+)\.params")


@dataclass(frozen=True)
class ShardedIndex:
    """What a checkpoint's sharded state holds, from DCP's metadata (read once: every rank
    reads it, and it grows with the model and the number of ranks that saved it)."""

    keys: frozenset[str]  # as DCP flattened them: model.<name>, optimizer.state.<name>.<key>
    # Every model tensor by name, of its global shape and dtype, on the meta device.
    model: dict[str, torch.Tensor]

    @property
    def param_groups(self) -> int:
        """How many optimizer parameter groups it holds as torch's list of groups (0 where it
        keeps its settings per parameter: :attr:`settings_per_name`)."""
        return len({m.group(1) for m in map(_GROUP_PARAMS.fullmatch, self.keys) if m})

    @property
    def settings_per_name(self) -> bool:
        """Whether its optimizer keeps its settings parameter by parameter
        (``optimizer.param_groups.<name>.<setting>``: pipeline's, where each stage holds
        other parameters) rather than as torch's list of groups (fsdp's, tensor's)."""
        groups = [key for key in self.keys if key.startswith("optimizer.param_groups.")]
        return bool(groups) and not any(_GROUP_PARAMS.fullmatch(key) for key in groups)


def sharded_reader(step_dir: Location) -> SafeReader:
    """DCP's reader of the sharded state in ``step_dir``, as data only, which opens only the
    files in ``dcp/`` that the completion marker lists."""
    from dtrain.checkpoint.safe_dcp import SafeReader

    prefix = f"{SHARDED_DIR}/"
    listed = read_marker(step_dir)["files"]
    return SafeReader(
        step_dir, {name.removeprefix(prefix) for name in listed if name.startswith(prefix)}
    )


def sharded_index(step_dir: Location, reader: SafeReader | None = None) -> ShardedIndex:
    """What the sharded state in ``step_dir`` holds, from its metadata (checked: a crafted
    ``dcp/.metadata`` is one line naming it); ``reader``: one that read it already."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = (reader or sharded_reader(step_dir)).read_metadata()
    model = {
        key.removeprefix("model."): torch.empty(
            item.size, dtype=item.properties.dtype, device="meta"
        )
        for key, item in metadata.state_dict_metadata.items()
        if key.startswith("model.") and isinstance(item, TensorStorageMetadata)
    }
    return ShardedIndex(frozenset(metadata.state_dict_metadata), model)


def load_sharded(step_dir: Location, template: dict[str, Any]) -> None:
    """Fill ``template`` (this rank's sharded state, at this world size) in place from the
    checkpoint, resharding as needed, as tensors and plain data only. Collective: every rank
    calls it (and each refuses a crafted file with the same line)."""
    from dtrain.checkpoint.safe_dcp import load_sharded as load

    load(template, sharded_reader(step_dir))


# ---------------------------------------------------------------------------------------------
# Does the saved model fit?


def state_dict_mismatches(
    expected: Mapping[str, Any],
    found: Mapping[str, Any],
    source: str = "checkpoint",
    tied: Iterable[set[str]] = (),
) -> list[str]:
    """Why ``found`` does not fit the model of ``expected``: missing and unexpected keys,
    other shapes (``source`` names ``found`` in them). A group of ``tied`` names is one tensor:
    given under any of its names, none of them is missing."""
    missing = set(expected) - set(found)
    for group in tied:
        if group & set(found):
            missing -= group
    problems = [f"missing {key}" for key in sorted(missing)]
    problems += [f"unexpected {key}" for key in sorted(set(found) - set(expected))]
    for key in sorted(set(expected) & set(found)):
        want, got = _shape(expected[key]), _shape(found[key])
        if want is not None and got is not None and want != got:
            problems.append(f"{key}: {source} {got}, model {want}")
    return problems


def _shape(value: Any) -> tuple[int, ...] | None:
    """A tensor's shape, or a shape given as a tuple; None for anything else."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    if isinstance(value, tuple):
        return value
    return None


def first_problems(problems: list[str]) -> str:
    """The first eight problems, and how many more there are."""
    more = len(problems) - 8
    return "; ".join(problems[:8]) + (f"; ... {more} more" if more > 0 else "")


def check_model_fits(
    expected: Mapping[str, Any], found: Mapping[str, Any], where: Location
) -> None:
    problems = state_dict_mismatches(expected, found)
    if problems:
        raise CheckpointError(
            f"checkpoint {where} is from a different model: {first_problems(problems)}"
        )
