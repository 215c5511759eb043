"""The trainer's narrow collaborators, without processes: the NaN guard's decisions, a phase of
the loop as a context manager, the load balancer's rule in the config package."""

from __future__ import annotations

import math

import pytest

from dtrain.balance.balancer import loader_weights
from dtrain.config import Config, validate_strategy
from dtrain.config.capabilities import CAPABILITIES
from dtrain.errors import ConfigError
from dtrain.fault.watchdog import Watchdog
from dtrain.train.nan_guard import Decision, NanGuard

NAN = math.nan


def test_the_nan_guard_skips_then_rolls_back_before_the_streak_and_a_finite_step_ends_it() -> None:
    guard = NanGuard(rollback_after=3)
    assert guard.decide(1, 0.5, False, (0, 8)) == Decision("continue")
    assert guard.decide(2, NAN, False, (8, 16)) == Decision("skip", 1)
    assert guard.decide(3, 1.0, False, (16, 24)) == Decision("continue")  # the streak ends
    assert guard.decide(4, NAN, False, (24, 32)) == Decision("skip", 1)
    assert guard.decide(5, math.inf, False, (32, 40)) == Decision("skip", 2)
    rollback = guard.decide(6, NAN, False, (40, 48))
    assert rollback == Decision("rollback", 3, first_bad=4, bad=((24, 32), (32, 40), (40, 48)))
    assert guard.streak == []  # the next bad step starts a new streak
    assert guard.decide(7, NAN, False, (48, 56)) == Decision("skip", 1)


def test_an_overflow_of_the_loss_scale_is_no_part_of_a_streak_and_0_never_rolls_back() -> None:
    guard = NanGuard(rollback_after=2)
    assert guard.decide(1, NAN, False, (0, 8)) == Decision("skip", 1)
    assert guard.decide(2, NAN, True, (8, 16)) == Decision("overflow")
    assert guard.decide(3, NAN, False, (16, 24)).action == "rollback"
    never = NanGuard(rollback_after=0)
    decisions = [never.decide(step, NAN, False, (step, step + 1)) for step in range(1, 6)]
    assert [d.action for d in decisions] == ["skip"] * 5
    assert decisions[-1].in_a_row == 5


def test_a_phase_is_left_for_the_one_it_was_entered_from_and_an_error_keeps_it() -> None:
    watchdog = Watchdog(0, 1, heartbeat_s=30.0, timeout_s=60.0)
    try:
        with watchdog.in_phase("train"):
            with watchdog.in_phase("data", 7):
                assert watchdog.liveness.record().where() == "at step 7 in data"
            assert watchdog.liveness.record().where() == "at step 7 in train"
            with pytest.raises(ValueError), watchdog.in_phase("forward_backward"):
                raise ValueError("in the forward")
            # Where the error was raised: what the rank's report and its peers name.
            assert (watchdog.step, watchdog.phase) == (7, "forward_backward")
        assert watchdog.phase == "start"  # "train" left normally: the phase before it
    finally:
        watchdog.liveness.close()


def test_throughput_balancing_needs_every_rank_to_be_a_data_parallel_rank() -> None:
    # The config package's rule (balance needs uneven shares) covers it: every strategy that
    # takes uneven shares lays out no mesh, so each of its ranks is a data-parallel rank.
    for name, can in CAPABILITIES.items():
        assert not can.uneven_shares or not can.mesh, name
    cfg = Config()
    cfg.balance.mode = "throughput"
    cfg.strategy.name, cfg.strategy.tensor_parallel = "tensor", 2
    with pytest.raises(ConfigError, match=r"balance.mode = 'throughput' does not work with"):
        validate_strategy(cfg, 4)


def test_equal_weights_are_the_loader_s_unweighted_cut() -> None:
    assert loader_weights([1.0, 1.0, 1.0]) is None
    assert loader_weights([1.0, 0.5]) == [1.0, 0.5]
