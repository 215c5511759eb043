"""train.precision: the forward and loss under bf16 or fp16 autocast for every strategy, with
fp16's dynamic loss scaling; the scaler's overflows are not the NaN guard's divergences; resume
stays bit-identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dtrain.compute.precision import LossScaler
from dtrain.errors import ConfigError
from dtrain.models.gpt import GPT, GPTConfig, attend, project_out
from tests.conftest import tiny_config, tiny_raw
from tests.dist_helpers import crash_then_resume, train_params, train_with_nan
from tests.matrix import MIXED_PRECISION_STRATEGIES, MIXED_PRECISIONS, STRATEGIES
from tests.ranks import run_ranks
from tests.recipe_helpers import train_each
from tests.test_ddp import assert_params_close

# The unit roundoff of each format (half its machine epsilon): how far a loss computed through
# it may stray from float32's, relative to its size.
ROUNDOFF = {"bf16-mixed": 2.0**-8, "fp16-mixed": 2.0**-11}


def losses(result: dict[str, Any]) -> np.ndarray:
    return np.array([result["losses"][step] for step in sorted(result["losses"])])


def run_config(run_dir: Path, precision: str, strategy: str = "ddp", **extra: Any) -> Any:
    """``strategy``: a name of tests/matrix.py's ``STRATEGIES``."""
    train = {"precision": precision, "steps": 10, "log_every": 1, **extra.pop("train", {})}
    return tiny_raw(run_dir, train=train, strategy=dict(STRATEGIES[strategy]), **extra)


def test_the_loss_scaler_halves_on_overflow_and_doubles_after_an_interval() -> None:
    scaler = LossScaler(scale=2.0**10, growth_interval=3)
    scaler.update(overflowed=True)
    assert scaler.scale == 2.0**9
    for _ in range(2):
        scaler.update(overflowed=False)
    assert scaler.scale == 2.0**9
    scaler.update(overflowed=False)
    assert scaler.scale == 2.0**10 and scaler.good_steps == 0
    restored = LossScaler()
    restored.load_state_dict(scaler.state_dict())
    assert (restored.scale, restored.good_steps) == (scaler.scale, scaler.good_steps)
    floor = LossScaler(scale=1.0)
    floor.update(overflowed=True)
    assert floor.scale == 1.0


def test_a_loss_scale_that_is_not_a_power_of_two_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="power of two"):
        tiny_config(tmp_path, train={"loss_scale_init": 1000.0})


def test_each_precision_follows_fp32_within_its_format(tmp_path: Path) -> None:
    names = ["fp32", "bf16-mixed", "fp16-mixed"]
    out = run_ranks(train_each, 1, [run_config(tmp_path / n, n) for n in names])
    fp32, *mixed = [losses(r) for r in out[0]]
    for name, trajectory in zip(names[1:], mixed):
        np.testing.assert_allclose(trajectory, fp32, rtol=ROUNDOFF[name], err_msg=name)
        # ... and the format did change the numbers: autocast was on.
        assert not np.array_equal(trajectory, fp32), name


def test_strategies_compute_one_process_s_numbers_in_mixed_precision(tmp_path: Path) -> None:
    strategies, precisions = MIXED_PRECISION_STRATEGIES, MIXED_PRECISIONS
    # One process two ways: the whole batch at once, and accumulating it in two micro-batches,
    # each one rank's share of the batch under data parallelism.
    accumulating = {"micro_batches": 2, "prefetch": 0}
    singles = [run_config(tmp_path / f"one-{p}", p) for p in precisions]
    singles.append(run_config(tmp_path / "one-acc", "bf16-mixed", data=accumulating))
    one, *_ = run_ranks(train_each, 1, singles)
    *whole_batch, accumulated = one
    configs = [run_config(tmp_path / f"{s}-{p}", p, s) for p in precisions for s in strategies]
    pair = iter(run_ranks(train_each, 2, configs)[0])
    for precision, single in zip(precisions, whole_batch):
        reference = losses(single)
        for strategy, result in zip(strategies, pair):
            trajectory = losses(result)
            # The same parameters give the same loss: the forward is one process's.
            assert abs(trajectory[0] - reference[0]) <= 1e-6, (precision, strategy)
            if precision == "fp16-mixed" or STRATEGIES[strategy]["name"] == "pipeline":
                # fp16 rounds gradients 8x finer than bf16; a pipeline without data
                # parallelism computes every gradient over the whole batch, as one process.
                np.testing.assert_allclose(trajectory, reference, rtol=1e-5)
                continue
            # bf16 rounds each rank's weight gradients, a sum over its own share of the batch,
            # before the ranks add them in float32: one process that rounds the same partial
            # sums (accumulating the same micro-batches) computes the same losses; one that
            # rounds the whole batch's sum once differs by bf16's roundoff of a gradient.
            np.testing.assert_allclose(trajectory, losses(accumulated), rtol=1e-5)
            np.testing.assert_allclose(trajectory, reference, rtol=ROUNDOFF[precision])
            # The weights: float32 arithmetic that differs in the last bit (it does, 4e-8 in
            # fp32) can move a weight's next bfloat16 cast by a whole bfloat16 step, so they
            # agree to within a few such steps of a weight's size (measured: 2.1e-5 at most).
            assert_params_close(result["params"], accumulated["params"], rtol=0, atol=1e-4)


def test_an_fp16_overflow_is_the_scaler_s_and_a_nan_loss_the_nan_guard_s(
    tmp_path: Path,
) -> None:
    # A scale of 2**40 overflows float16 in backward: the first steps are skipped on every
    # rank and the scale halved each time, but none counts towards a rollback.
    scaled = run_config(
        tmp_path / "overflow",
        "fp16-mixed",
        train={"steps": 30, "loss_scale_init": 2.0**40},
        fault={"nan_rollback_after": 2},
    )
    out = run_ranks(train_each, 2, [scaled])
    result = out[0][0]
    overflows = [e for e in result["events"] if e["name"] == "overflow"]
    assert len(overflows) >= 3  # more in a row than nan_rollback_after
    assert [e["loss_scale"] for e in overflows] == [2.0 ** (39 - i) for i in range(len(overflows))]
    assert result["skipped"] == 0
    assert not [e for e in result["events"] if e["name"] in ("step_skipped", "rollback")]
    assert result["scale"] == 2.0 ** (40 - len(overflows))
    assert_params_close(out[0][0]["params"], out[1][0]["params"], rtol=0, atol=0)
    assert all(np.isfinite(v).all() for v in result["params"].values())
    # A NaN loss on one rank is a divergence: the NaN guard skips the step.
    poisoned = run_config(tmp_path / "nan", "fp16-mixed", train={"steps": 12})
    nan = run_ranks(train_with_nan, 2, poisoned, [40], 1)
    assert [o["skipped"] for o in nan] == [1, 1]


@pytest.mark.parametrize("precision", MIXED_PRECISIONS)
def test_resume_is_bit_identical_in_mixed_precision(tmp_path: Path, precision: str) -> None:
    # fp16: the scale starts high enough to overflow, then grows every 3 steps -- it changes
    # before and after the crash, so the scaler's state must come back with the checkpoint.
    train = {"steps": 16, "loss_scale_init": 2.0**22, "loss_scale_growth_interval": 3}
    job = {"checkpoint": {"every": 4}, "train": train}
    straight = run_ranks(train_params, 2, run_config(tmp_path / "straight", precision, **job))
    resumed = run_ranks(crash_then_resume, 2, run_config(tmp_path / "crash", precision, **job), 7)
    assert resumed[0]["start_step"] == 4
    assert_params_close(straight[0], resumed[0]["params"], rtol=0, atol=0)


def test_the_gpt_attends_in_float32_under_cpu_bf16_autocast() -> None:
    # torch's CPU attention is slower in bfloat16 than in float32: the default GPT runs it in
    # float32 under CPU autocast, on the same bfloat16 inputs, and hands back bfloat16.
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8).to(torch.bfloat16) for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attend(q, k, v, 0.0)
        in_bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    exact = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, exact.to(torch.bfloat16))
    assert not torch.equal(in_bf16, out)  # autocast's own choice computes other numbers
    plain = torch.randn(2, 4, 16, 8)  # without autocast: torch's attention as it is
    assert torch.equal(
        attend(plain, plain, plain, 0.0),
        F.scaled_dot_product_attention(plain, plain, plain, is_causal=True),
    )


def test_the_gpt_s_logits_are_float32_under_autocast() -> None:
    # bfloat16 logits cost the default job about 3% of its loss: the output projection runs in
    # float32 under autocast, on the final norm's float32 output and the float32 weight.
    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32))
    idx = torch.randint(0, 256, (2, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(idx)
        x = model.ln_f(torch.randn(2, 16, 32))
        projected = project_out(model.head, x)
        in_bf16 = model.head(x)
    assert logits.dtype == torch.float32
    assert torch.equal(projected, F.linear(x.float(), model.head.weight))
    assert not torch.equal(projected, in_bf16.float())  # ... which autocast alone would round
    layers = model.pipeline_layers()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        chained = idx
        for layer in layers:
            chained = layer(chained)
    assert torch.equal(chained, logits)  # the pipeline's last layer too
