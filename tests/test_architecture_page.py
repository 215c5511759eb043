"""docs/architecture.md's package table is the packages' own docstrings: a package added,
renamed or redescribed without rerunning ``python scripts/architecture.py`` fails here."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("architecture", ROOT / "scripts/architecture.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_lists_every_package_as_its_docstring_says() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert generator().render(page) == page, "run: python scripts/architecture.py"


def test_a_new_package_changes_the_table(tmp_path: Path) -> None:
    # The check can fail: a package the page does not know yet makes the rendered page differ.
    architecture = generator()
    package = tmp_path / "dtrain"
    docs = [("alpha", "Alpha, in the parent: one line. More."), ("beta", "Beta: a list:")]
    for name, doc in docs:
        (package / name).mkdir(parents=True)
        (package / name / "__init__.py").write_text(f'"""{doc}\n\nDetails."""\n')
    lines = architecture.package_lines(package)
    assert lines[2:] == [
        "| `alpha/` | Alpha, in the parent: one line. |",
        "| `beta/` | Beta: a list. |",
    ]
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert architecture.render(page, package) != page
