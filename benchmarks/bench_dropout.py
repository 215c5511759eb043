"""How far data parallelism with dropout is from one process, measured.

Each rank draws its dropout masks from its own seeded stream (``rank_seed``), so a 2-rank run
does not draw the masks one process draws for the same global batch: its loss curve is
another sample of the same random process, not the same numbers. How far apart, against two
yardsticks measured in the same run:

- the control: the same 2-rank run without dropout (the data-parallel math itself: rounding);
- the noise of dropout itself: one process against one process whose dropout masks come from
  another stream (``run.seed`` changes only the RNG streams here: every run starts from the
  same weights, through ``run.init_from``, and reads the samples in stored order).

Printed: per-step relative difference of the training loss (max and mean over the steps) and
of the final validation loss. The tiny test GPT (2 layers, d_model 32), dropout 0.1, SGD.

    .venv/bin/python benchmarks/bench_dropout.py              # prints the figures
    .venv/bin/python benchmarks/bench_dropout.py --write-docs # also updates docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _report import ROOT, write_report_section

sys.path.insert(0, str(ROOT))  # tests/: the test aids of a source checkout
from tests.ranks import run_ranks

ROOT = Path(__file__).resolve().parent.parent


def losses(raw: dict[str, Any]) -> list[float]:
    from tests.dist_helpers import make_trainer

    trainer = make_trainer(raw)
    summary = trainer.fit()
    lines = (Path(raw["run"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    train = [r["loss"] for r in map(json.loads, lines) if r.get("kind") == "train"]
    return [*train, summary.val_loss]


def initial_weights(path: Path, dropout: float) -> Path:
    """The tiny GPT's weights at seed 0, as a file run.init_from loads."""
    from tests.conftest import tiny_raw
    from tests.tasks import TinyOptions, tiny_gpt

    from dtrain.checkpoint.rng import seed_everything
    from dtrain.config.load import build_config

    seed_everything(0)
    cfg = build_config(tiny_raw(path.parent, task={"dropout": dropout}), TinyOptions)
    torch.save(tiny_gpt(cfg).model.state_dict(), path)
    return path


def differences(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """(max, mean) relative difference of the training losses, and of the validation loss."""
    x, y = np.asarray(a[:-1]), np.asarray(b[:-1])
    rel = np.abs(x - y) / np.abs(y)
    return float(rel.max()), float(rel.mean()), abs(a[-1] - b[-1]) / abs(b[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))  # the tests' tiny GPT
    from tests.conftest import tiny_raw

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        weights = initial_weights(root / "init.pt", args.dropout)

        def raw(name: str, dropout: float, seed: int = 0) -> dict[str, Any]:
            return tiny_raw(
                root / name,
                run={"seed": seed, "init_from": str(weights)},
                train={"steps": args.steps, "log_every": 1},
                # The same samples in the same order in every run: only the masks differ.
                data={"global_batch_size": 16, "shuffle": "none"},
                task={"dropout": dropout},
            )

        one = run_ranks(losses, 1, raw("one", args.dropout))[0]
        other_masks = run_ranks(losses, 1, raw("one-seed1", args.dropout, seed=1))[0]
        two = run_ranks(losses, 2, raw("two", args.dropout))[0]
        one_plain = run_ranks(losses, 1, raw("one-plain", 0.0))[0]
        two_plain = run_ranks(losses, 2, raw("two-plain", 0.0))[0]
    rows = [
        ("2 ranks vs 1 process, dropout 0.0 (control)", differences(two_plain, one_plain)),
        (f"2 ranks vs 1 process, dropout {args.dropout}", differences(two, one)),
        (
            f"1 process vs 1 process, other masks, dropout {args.dropout}",
            differences(other_masks, one),
        ),
    ]
    lines = [
        f"tiny GPT, global batch 16, {args.steps} SGD steps; relative difference of the loss",
        f"{'':58s} {'train max':>10s} {'train mean':>11s} {'val':>9s}",
    ]
    for label, (high, mean, val) in rows:
        lines.append(f"{label:58s} {high:10.2e} {mean:11.2e} {val:9.2e}")
    report = "\n".join(lines)
    print(report)
    if args.write_docs:
        write_report_section("dropout", "Dropout on 2 ranks against one process", report)


if __name__ == "__main__":
    main()
