"""The chaos script's smoke run (one trial of each fault kind through the real CLI). Slow:
`make test-slow` runs it; the default suite runs each kind of fault once in the other tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_quick_passes_every_trial() -> None:
    proc = subprocess.run(
        [sys.executable, "benchmarks/chaos.py", "--quick", "--no-docs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
