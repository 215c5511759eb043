"""train.compile: the blocks compiled on their own compute the eager numbers, keep their
names, and a run saved compiled resumes eager and the other way round."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tests.conftest import tiny_raw
from tests.dist_helpers import crash_then_resume, make_trainer, params_of
from tests.ranks import run_ranks


def compiled_and_eager(raws: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """In one process (the compiled graph is made once and used by every compiled run):
    straight runs eager and compiled, and each crashed at step 5 and resumed the other way."""
    out: dict[str, Any] = {}
    for name in ("eager", "compiled"):
        trainer = make_trainer(raws[name])
        summary = trainer.fit()
        out[name] = params_of(trainer)
        out[f"{name}_names"] = list(trainer.strategy.model_state_dict())
        out[f"{name}_loss"] = summary.train_loss
    for saved, resumed in (("compiled", "eager"), ("eager", "compiled")):
        crash = raws[f"{saved}_then_{resumed}"]
        # The first attempt trains as `saved`, the resumed one as `resumed`.
        attempts = [crash, {**crash, "train": raws[resumed]["train"]}]
        out[f"{saved}_then_{resumed}"] = crash_then_resume(attempts[0], 5, resume_raw=attempts[1])
    return out


def test_compiled_blocks_train_as_eager_and_resume_either_way(tmp_path: Path) -> None:
    train = {"steps": 8}
    job = {"checkpoint": {"every": 4}}

    def raw(name: str, compile_: bool) -> dict[str, Any]:
        return tiny_raw(tmp_path / name, train={**train, "compile": compile_}, **job)

    raws = {
        "eager": raw("eager", False),
        "compiled": raw("compiled", True),
        "compiled_then_eager": raw("c2e", True),
        "eager_then_compiled": raw("e2c", False),
    }
    out = run_ranks(compiled_and_eager, 1, raws)[0]
    assert out["compiled_names"] == out["eager_names"]  # no `_orig_mod.` prefixes
    assert abs(out["compiled_loss"] - out["eager_loss"]) <= 1e-5
    for key, value in out["eager"].items():
        np.testing.assert_allclose(out["compiled"][key], value, rtol=1e-5, atol=1e-6)
        for crossed in ("compiled_then_eager", "eager_then_compiled"):
            assert out[crossed]["start_step"] == 4
            np.testing.assert_allclose(
                out[crossed]["params"][key], value, rtol=1e-5, atol=1e-6, err_msg=crossed
            )
