"""A loop that leaves ``run.batches()`` before the run's end (a ``break``, a ``return``): fine
where every rank leaves after the same step, a hang where the others go on -- they wait for
this rank in their next step's gradient sync until ``dist.timeout_s``. So it is named instead.

Leaving costs nothing until the rank next talks to the others outside the stream (``main``
returns, or ``run.evaluate``, ``run.save``, ``run.reduce``): then it posts the step it left after
to the job's store and reads every rank's (:class:`~dtrain.fault.peer_words.PeerWords`). Ranks
that left together find each other's words and go on; a rank that went on shows it in its
liveness beat, and the one that left raises a :class:`~dtrain.errors.UserError` naming itself
and the step, which its peers' diagnosis quotes: one line on every rank, no hang. Leaving in the
middle of a step is a mistake on any rank, said at once. Without the job's store nothing is
checked (docs/own-loop.md, "Leaving the loop on some ranks only").
"""

from __future__ import annotations

from dtrain.errors import UserError
from dtrain.fault.liveness import Liveness
from dtrain.fault.peer_words import PeerWords
from dtrain.fault.watchdog import Watchdog

_ADVICE = (
    "stop every rank together with run.stop(reason) (the ranks agree on it within a step), "
    "or leave the loop on every rank after the same step"
)


def check_left(watchdog: Watchdog, step: int, mid_step: bool) -> None:
    """This rank left ``run.batches()`` after ``step`` (``mid_step``: with the next step's
    batch taken, not stepped): return once every rank has; raise a one-line
    :class:`UserError` naming this rank and the step as soon as another rank shows it went on
    to a later step."""
    rank = watchdog.rank
    if mid_step:
        raise UserError(
            f"rank {rank} left run.batches() in the middle of step {step + 1}, before its "
            "run.step(): the other ranks would wait for it in that step's gradient sync; call "
            f"run.step() after each batch's backward, and {_ADVICE}"
        )
    if watchdog.world_size == 1 or watchdog.store is None:
        return

    def went_on(beats: dict[int, Liveness | None]) -> None:
        ahead = sorted(r for r, beat in beats.items() if beat is not None and beat.step > step)
        if ahead:
            others = ", ".join(f"rank {r}" for r in ahead)
            raise UserError(
                f"rank {rank} left run.batches() after step {step} while {others} "
                f"went on to step {step + 1}: they would wait for it in that step's gradient "
                f"sync until dist.timeout_s; {_ADVICE}"
            )

    words = PeerWords(watchdog).gather(
        f"stream-left/{step}", str(step), f"leaving run.batches() after step {step}", went_on
    )
    elsewhere = [r for r, word in enumerate(words) if word != str(step)]
    if elsewhere:  # cannot be where every step's gradient sync joined every rank; said anyway
        raise UserError(
            f"rank {rank} left run.batches() after step {step}, rank {elsewhere[0]} after step "
            f"{words[elsewhere[0]]}: {_ADVICE}"
        )
