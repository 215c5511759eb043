"""Lines of code of the same 60-step GPT-2 job in dtrain's own loop, Hugging Face Accelerate
and Lightning Fabric (issue #41), counted by one rule:

    a line counts when it holds code: not blank, not only a comment, not part of a docstring;
    imports count; a config file's lines count by the same rule (its keys are the job's code).

The job, the same in each: an HF ``GPT2LMHeadModel`` built from a config (examples/hf_gpt2.py's
model and data, imported by all three and not counted), 2 data-parallel processes, shuffled
data split across them, AdamW with a linear warm-up and cosine decay, gradients clipped at 1.0,
the loss averaged over the ranks and printed every 10 steps, a checkpoint every 20 steps and at
the end, and a restart resuming from it (model, optimizer, schedule, step, data position).

What the peers' scripts still leave out of that, and dtrain does (not counted, each would add
lines to them): weight decay on matrices only (dtrain's default), the exact global mean over
the tokens the loss counts (they average per-rank means), an atomic and verified checkpoint,
a save on SIGTERM, exactly-once data across a resume at another world size.

    python benchmarks/loc/count.py [--write-docs]
"""

from __future__ import annotations

import argparse
import ast
import io
import sys
import tokenize
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from _report import ROOT, command_line, update_section  # noqa: E402

SECTION = "bench_loc"
JOBS = {
    "dtrain own loop": [ROOT / "examples/own_loop_hf.py", HERE / "own_loop_hf.toml"],
    "Hugging Face Accelerate": [HERE / "accelerate_gpt2.py"],
    "Lightning Fabric": [HERE / "fabric_gpt2.py"],
}


def python_lines(text: str) -> int:
    """Lines of ``text`` (Python) holding code: tokens other than comments, outside docstrings."""
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or 0) + 1))
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    code: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type not in skip and token.type != tokenize.ENDMARKER:
            code.update(range(token.start[0], token.end[0] + 1))
    return len(code - docstrings)


def config_lines(text: str) -> int:
    """Lines of a TOML file that are neither blank nor a comment."""
    return sum(1 for line in text.splitlines() if line.strip() and not line.strip().startswith("#"))


def count(path: Path) -> int:
    text = path.read_text()
    return python_lines(text) if path.suffix == ".py" else config_lines(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-docs", action="store_true", help="update docs/benchmarks.md")
    args = parser.parse_args()
    lines = ["| job written with | files | lines of code |", "|---|---|---:|"]
    for name, paths in JOBS.items():
        files = ", ".join(f"`{p.relative_to(ROOT)}` ({count(p)})" for p in paths)
        lines.append(f"| {name} | {files} | **{sum(count(p) for p in paths)}** |")
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        body = "\n".join(
            [
                "## Lines of code: the same GPT-2 job in dtrain's own loop, Accelerate, Fabric",
                "",
                f"`{command_line()}`. Rule (benchmarks/loc/count.py): a line counts when it holds",
                "code -- not blank, not only a comment, not in a docstring; imports and the config",
                "file's keys count. The job and what the peers' scripts still leave out: the",
                "script's docstring.",
                "",
                report,
            ]
        )
        print(f"wrote {update_section(SECTION, body)}")


if __name__ == "__main__":
    main()
