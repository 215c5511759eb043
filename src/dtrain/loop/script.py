"""``run.script``: the Python file whose ``main(run)`` is a worker's own loop."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dtrain.errors import UserError
from dtrain.task import raised_on_import


def load_main(script: str) -> Callable[[Any], object]:
    """The ``main`` of the file ``script``, imported as a module named by its stem (so that
    what it defines pickles by name, as a data loader's worker processes need); a failure is
    the user's, said in one line."""
    path = Path(script)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if not path.is_file() or spec is None or spec.loader is None:
        raise UserError(f"run.script = {script!r}: no such Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise raised_on_import(f"run.script = {script!r}: importing it", exc) from None
    main = getattr(module, "main", None)
    if not callable(main):
        raise UserError(
            f"run.script = {script!r} defines no main(run): the own loop's entry, given a "
            "dtrain.Run (docs/own-loop.md)"
        )
    return main
