"""No module under ``dtrain/parallel/`` reads or writes a file (docs/architecture.md): a strategy
gives and takes named state dicts with their form, and ``dtrain.checkpoint`` alone opens the
checkpoint's files and converts one form into another. An AST scan of every module, so that a
file opened in a branch no test takes is caught too."""

from __future__ import annotations

import ast
from pathlib import Path

PARALLEL = Path(__file__).resolve().parent.parent / "src" / "dtrain" / "parallel"

# The checkpoint modules that name, open, read or write files (``checkpoint.forms``, the forms
# a strategy's state takes, is plain data and is allowed).
FILE_MODULES = {
    f"dtrain.checkpoint.{name}"
    for name in (
        *("read", "layout", "safe_load", "safe_dcp", "write", "stream"),
        *("cross_form", "model_state", "state_form", "consolidate", "state"),
    )
}
# Calls that open or parse a file, by their last names (``torch.save``, ``json.load``,
# ``path.read_text()``, ``dcp.load``, ``open``).
FILE_CALLS = {"open", "torch_load", "load_file", "load_meta"}
FILE_ATTRIBUTES = {
    ("torch", "save"),
    ("torch", "load"),
    ("json", "load"),
    ("json", "dump"),
    ("dcp", "save"),
    ("dcp", "load"),
}
PATH_METHODS = {"read_text", "read_bytes", "write_text", "write_bytes", "open", "exists", "is_dir"}


def touches_files(module: str) -> bool:
    """Whether importing ``module`` (or a name from it) brings in file access: dtrain's file
    modules, or DCP's reader and writer (its ``state_dict`` API only moves state in memory)."""
    dcp = "torch.distributed.checkpoint"
    if module == dcp or (
        module.startswith(f"{dcp}.") and not module.startswith(f"{dcp}.state_dict")
    ):
        return True
    return any(module == name or module.startswith(f"{name}.") for name in FILE_MODULES)


def file_uses(source: str) -> list[str]:
    """What in ``source`` touches the disk, one line each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [f"{node.module or ''}.{alias.name}" for alias in node.names]
        else:
            names = []
        found += [f"line {node.lineno}: imports {n}" for n in names if touches_files(n)]
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Name) and func.id in FILE_CALLS:
            found.append(f"line {node.lineno}: calls {func.id}()")
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else ""
            if (owner, func.attr) in FILE_ATTRIBUTES or func.attr in PATH_METHODS:
                found.append(f"line {node.lineno}: calls {owner or '...'}.{func.attr}()")
            elif func.attr in FILE_CALLS:
                found.append(f"line {node.lineno}: calls .{func.attr}()")
    return found


def test_no_strategy_module_reads_or_writes_a_file() -> None:
    modules = sorted(PARALLEL.rglob("*.py"))
    assert len(modules) > 20  # it read the tree
    touching = {
        str(path.relative_to(PARALLEL)): uses
        for path in modules
        if (uses := file_uses(path.read_text()))
    }
    assert touching == {}, touching


def test_the_scan_finds_each_kind_of_file_access() -> None:
    # Each line alone is caught: a scan that cannot see one of them would pass the tree above
    # whatever it held.
    lines = [
        "from dtrain.checkpoint import read as ckread",
        "from dtrain.checkpoint.layout import MODEL_FILE",
        "import dtrain.checkpoint.safe_dcp",
        "from dtrain.checkpoint.safe_load import torch_load",
        "from dtrain.checkpoint import write",
        "from dtrain.checkpoint.stream import write_file",
        "from dtrain.checkpoint.cross_form import regroup",
        "import torch.distributed.checkpoint as dcp",
        "from torch.distributed import checkpoint",
        "open('model.pt')",
        "torch.save(state, path)",
        "torch.load(path)",
        "torch_load(path)",
        "json.load(stream)",
        "path.read_text()",
        "path.write_bytes(data)",
        "(step_dir / 'model.pt').exists()",
        "dcp.load(state, checkpoint_id=path)",
        "ckread.load_file(step_dir, 'model.pt')",
        "ckread.load_meta(step_dir)",
    ]
    assert [line for line in lines if not file_uses(line)] == []
    # ... and what a strategy does with its state is not.
    allowed = [
        "from dtrain.checkpoint.forms import Form, Part",
        "from torch.distributed.checkpoint.state_dict import get_state_dict",
        "model.load_state_dict(state)",
        "optimizer.state_dict()",
    ]
    assert [line for line in allowed if file_uses(line)] == []
