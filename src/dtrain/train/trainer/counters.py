"""The trainer's own part of the training state: its counters."""

from __future__ import annotations

from typing import Any

from dtrain.train.step import ForwardBackward


class Counters:
    """The trainer's part of the training state (``trainer`` in ``train_state.pt``): how far
    the run got, what the NaN guard skipped and rolled back, and the item count the next step's
    loss scale assumes (:mod:`dtrain.train.step`)."""

    def __init__(self, forward_backward: ForwardBackward) -> None:
        self.step = 0
        self.items_seen = 0
        self.skipped_steps = 0
        self.rollbacks = 0
        self.forward_backward = forward_backward  # holds the expected item count

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "items_seen": self.items_seen,
            "skipped_steps": self.skipped_steps,
            "rollbacks": self.rollbacks,
            "expected_items": self.forward_backward.expected,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.items_seen = int(state["items_seen"])
        self.skipped_steps = int(state["skipped_steps"])
        self.rollbacks = int(state["rollbacks"])
        expected = state["expected_items"]
        self.forward_backward.expected = None if expected is None else int(expected)
