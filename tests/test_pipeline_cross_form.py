"""Pipeline's checkpoints resumed by the other strategies and theirs by pipeline, optimizer state
included: the same parameters as a run that never changed strategy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.matrix import PIPELINE_RESUMES, Resume, cases
from tests.test_cross_form import resume_equals_unchanged

# 2 micro-batches (tests/test_cross_form.py's DATA): 1F1B on 2 stages (the tiny GPT's 4
# layers: embedding, 2 blocks, head); tests/matrix.py says why the split is uniform.


@pytest.mark.parametrize("row", cases(PIPELINE_RESUMES))
def test_pipeline_and_the_other_strategies_resume_each_other(tmp_path: Path, row: Resume) -> None:
    # Each was refused before launch: pipeline keys its optimizer settings per parameter.
    resume_equals_unchanged(tmp_path, row)
