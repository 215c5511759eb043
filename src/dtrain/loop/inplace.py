"""A loop of the user's own under ``fault.recovery = 'inplace'``: ``main(run)`` trains one
membership generation (:mod:`dtrain.train.inplace_worker` runs the generations).

In each generation ``main`` is called again, on a fresh :class:`~dtrain.loop.run.Run` whose
trainer is given the generation's recovery seam, as dtrain's loop's trainer is: its first
``run.batches()`` heals the state from the survivors' memory (the main model, its optimizer,
the schedule, the data position, the counters and everything ``run.register`` holds), each
step keeps its start, a failed collective or a regroup raises out of ``main`` to the worker.
What ``main`` holds outside ``run.register`` starts afresh in each generation (its locals, a
``run.stop()`` not yet carried by a step): docs/own-loop.md says so."""

from __future__ import annotations

from collections.abc import Callable

from dtrain.checkpoint.rng import seed_everything
from dtrain.config import Config
from dtrain.dist.runtime import Runtime
from dtrain.loop.run import Run
from dtrain.metrics.summary import Summary
from dtrain.train.inplace_worker import GenerationLoop, Halt, StartLoop
from dtrain.train.recovery_seam import RecoverySeam
from dtrain.train.trainer import Trainer


class OwnLoop:
    """``main(run)`` in one generation (a :class:`~dtrain.train.inplace_worker.GenerationLoop`)."""

    def __init__(
        self,
        main: Callable[[Run], object],
        cfg: Config,
        runtime: Runtime,
        recovery: RecoverySeam,
        halt: Halt | None,
    ) -> None:
        seed_everything(cfg.run.seed)  # as Run.join: the model main builds starts equal
        self.run = Run(cfg, runtime, recovery=recovery, before_resume=halt)
        self.main = main

    @property
    def trainer(self) -> Trainer | None:
        return self.run.built

    def fit(self) -> Summary:
        return self.run.train(self.main)


def start_own_loop(main: Callable[[Run], object]) -> StartLoop:
    """How the in-place worker starts ``main`` in each generation."""

    def start(
        cfg: Config, runtime: Runtime, recovery: RecoverySeam, halt: Halt | None
    ) -> GenerationLoop:
        return OwnLoop(main, cfg, runtime, recovery, halt)

    return start
