"""Lines of ``src/dtrain`` split into code, docstring, comment and blank (issue #40's size rule).

A line is a docstring line when it lies inside a module, class or function docstring; a comment
line when it holds only a comment; blank when empty; code otherwise. Totals are per package.

    python benchmarks/loc/src_lines.py [--by-package] [ROOT]
"""

from __future__ import annotations

import argparse
import ast
import io
import tokenize
from collections import Counter
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "dtrain"


def docstring_lines(tree: ast.AST) -> set[int]:
    """The line numbers covered by docstrings in ``tree``."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            first = node.body[0] if node.body else None
            value = first.value if isinstance(first, ast.Expr) else None
            if (
                first is not None
                and isinstance(value, ast.Constant)
                and isinstance(value.value, str)
            ):
                lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    return lines


def split_file(path: Path) -> Counter[str]:
    text = path.read_text()
    docs = docstring_lines(ast.parse(text))
    comments: set[int] = set()
    code: set[int] = set()
    kinds = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in kinds:
            code.update(range(tok.start[0], tok.end[0] + 1))
    counts: Counter[str] = Counter()
    for number, line in enumerate(text.splitlines(), start=1):
        if number in docs:
            counts["docstring"] += 1
        elif number in code:
            counts["code"] += 1
        elif number in comments:
            counts["comment"] += 1
        elif not line.strip():
            counts["blank"] += 1
        else:
            counts["code"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", type=Path, default=SRC)
    parser.add_argument("--by-package", action="store_true")
    args = parser.parse_args()
    total: Counter[str] = Counter()
    packages: dict[str, Counter[str]] = {}
    for path in sorted(args.root.rglob("*.py")):
        counts = split_file(path)
        total.update(counts)
        rel = path.relative_to(args.root)
        key = rel.parts[0] if len(rel.parts) > 1 else "(root)"
        packages.setdefault(key, Counter()).update(counts)
    columns = ("code", "docstring", "comment", "blank")
    if args.by_package:
        for name, counts in sorted(packages.items(), key=lambda item: -sum(item[1].values())):
            cells = " ".join(f"{counts[c]:>6}" for c in columns)
            print(f"{name:<12} {sum(counts.values()):>6}  {cells}")
    print(f"total {sum(total.values())}: " + ", ".join(f"{c} {total[c]}" for c in columns))


if __name__ == "__main__":
    main()
