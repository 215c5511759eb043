"""dtrain is not on PyPI: every install line the project shows is the clone's (``pip install -e
'.[extra]'``). ``pip install 'dtrain[hf]'`` would install whatever package holds that name."""

from __future__ import annotations

import re

from tests.conftest import REPO

PYPI_FORM = re.compile(r"dtrain\[[a-z0-9_,-]+\]")


def test_no_install_line_names_a_dtrain_package_on_pypi() -> None:
    places = [REPO / "README.md", REPO / "Makefile"]
    for folder, pattern in (
        ("src", "*.py"),
        ("docs", "*.md"),
        ("examples", "*"),
        ("benchmarks", "*.py"),
    ):
        places += sorted(p for p in (REPO / folder).rglob(pattern) if p.is_file())
    found = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in places
        if path.suffix in (".py", ".md", ".toml", ".sh", "")
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
        if PYPI_FORM.search(line)
    ]
    assert not found, "use pip install -e '.[extra]' (from the clone):\n" + "\n".join(found)
