"""The chaos run's smoke form (one trial of each fault kind through the real CLI; the system
test itself is ``tests/system/chaos.py``, ``make chaos``). Slow: `make test-slow` runs it; the
default suite runs each kind of fault once in the other tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_chaos_quick_passes_every_trial() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.system.chaos", "--quick", "--no-docs"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout
