"""benchmarks/gpu_check.py, the check prepared for a GPU machine, runs here on CPU (gloo): its
rows pass against one process, and a row is judged by its format's tolerance."""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from tests.conftest import REPO


@pytest.fixture(scope="module")
def gpu_check() -> Iterator[ModuleType]:
    # Importable by name, also in the ranks (they pickle its functions by module name).
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        yield importlib.import_module("gpu_check")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


def test_each_row_is_judged_by_its_format_s_tolerance(gpu_check: ModuleType) -> None:
    Row, Outcome = gpu_check.Row, gpu_check.Outcome
    assert Row("ddp", "fp32", False).tolerance == 1e-5
    assert Row("ddp", "fp16-mixed", False).tolerance == 1e-5
    assert Row("ddp", "fp16-mixed", True).tolerance == 2.0**-11  # compiled: shape-specialized
    # 2-rank data parallelism in bf16 against one process accumulating the ranks' shares.
    assert Row("fsdp", "bf16-mixed", False).tolerance == 1e-5
    assert Row("fsdp", "bf16-mixed", False).reference_micro_batches == 2
    assert Row("tensor", "bf16-mixed", False).tolerance == 2.0**-8
    assert Row("tensor", "bf16-mixed", False).reference_micro_batches == 1
    assert Row("pipeline", "bf16-mixed", False).tolerance == 1e-5  # the same split
    # A fused row's reference runs the fused kernel too.
    assert Row("ddp", "fp32", False, fused=True).reference_key == ("fp32", False, 1, True)
    reference = {1: 4.0, 2: 3.0}
    assert gpu_check.largest_difference({1: 4.0, 2: 3.0003}, reference) == pytest.approx(1e-4)
    assert gpu_check.largest_difference({1: 4.0}, reference) == math.inf  # a step missing
    assert gpu_check.largest_difference({1: 4.0, 2: math.nan}, reference) == math.inf
    bf16 = Row("tensor", "bf16-mixed", False)
    assert Outcome(bf16, "gloo", difference=1e-3).passed
    assert not Outcome(bf16, "gloo", difference=1e-2).passed
    assert not Outcome(bf16, "gloo", error="RuntimeError: boom").passed
    assert Outcome(bf16, "gloo", skipped="no GPUs").passed
    assert gpu_check.choose_backend("cpu", 4, "auto") == "gloo"


def test_the_gpu_check_passes_on_cpu(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--device", "cpu", "--strategies", "ddp,fsdp", "--precisions", "bf16-mixed"]
    code = gpu_check.main([*args, "--compile", "off", "--steps", "3"])
    out = capsys.readouterr().out
    assert code == 0, out
    # ddp's row also with the fused optimizer kernel; fsdp has none (DTensor parameters).
    assert "ddp / bf16-mixed / compile off / fused" in out
    assert "fsdp / bf16-mixed / compile off / fused" not in out
    assert "ddp / bf16-mixed / compile off" in out and "3 passed, 0 failed" in out


@pytest.mark.slow
def test_every_strategy_of_the_gpu_check_passes_on_cpu(
    gpu_check: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every strategy in each precision, eager; compile on for ddp (inductor's CPU backend).
    code = gpu_check.main(["--device", "cpu", "--compile", "off", "--steps", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    code = gpu_check.main(["--device", "cpu", "--strategies", "ddp", "--compile", "on"])
    out = capsys.readouterr().out
    assert code == 0, out
