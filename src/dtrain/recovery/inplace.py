"""``fault.recovery = 'inplace'``: a worker's life across membership generations.

Each worker runs :func:`train_in_place` instead of one plain training run::

    member = register with the launcher's coordinator (dtrain.recovery.membership)
    loop:
        generation = wait for one that holds this member
        process group of the generation (destroy the old one, init on inplace/gen<g>/pg)
        trainer = a fresh task and Trainer at the generation's rank and world size
                  (a loop of the user's own: its main(run) called again builds them)
        trainer.fit(), or main(run):
            resume: heal -- the rank furthest along sends its state in memory to each
                    rank that holds an older one (no checkpoint file read); nobody holds
                    a state (the job's start): the newest checkpoint, as always
            every step: the parts' state at the step's start is kept (a few small dicts)
            a collective fails (a peer died, or timed out)  -> leave, holding the state:
                in flight (no optimizer step yet): the step is dropped -- model and optimizer
                as they were, data position and counters from the step's start; gradients
                discarded. After the optimizer step: the state as it is.
            a worker waits to join (the coordinator's ``pending``): every rank learns it in
                the step's gradient sync (StepAgreement.regroup) and leaves after the step
        run completed: tell the coordinator (a worker still waiting to join exits)

What a heal sends, and why the math is an uninterrupted run's at the same sequence of world
sizes: docs/fault-tolerance.md, "Recovery in place".
"""

from __future__ import annotations

import contextlib
import copy
import gc
import os
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch
import torch.distributed as dist

from dtrain.comm.plain import all_gather_json
from dtrain.config import DistConfig
from dtrain.dist.runtime import NAMESPACE_ENV, Runtime, init_group, place_worker
from dtrain.fault.peer_failure import is_collective_failure
from dtrain.fault.watchdog import GENERATION_ENV
from dtrain.recovery.handover import recv_state, send_state
from dtrain.recovery.membership import (
    Generation,
    Member,
)
from dtrain.recovery.sever import GenerationLinks


class Trainer(Protocol):
    """What recovery reads and sets of a generation's trainer (``dtrain.train.trainer.Trainer``,
    not imported: the trainer imports this module)."""

    step: int
    state: Any
    strategy: Any
    optimizer: Any
    runtime: Runtime
    loader: Any
    watchdog: Any  # dtrain.fault.watchdog.Watchdog: its thread reads the membership


class Regroup(Exception):
    """Not an error: a worker waits to join, and every rank leaves the generation after the
    step they agreed on."""


@dataclass
class HeldState:
    """A rank's training state between two generations (in memory)."""

    generation: int  # the newest generation it trained in
    step: int
    payload: dict[str, Any]  # "model", "optimizer", "parts": {name: state_dict}
    dropped: bool = False  # the step in flight was dropped


class Recovery:
    """The trainer's seam for in-place recovery, one per generation: what the trainer knows of
    it is :class:`dtrain.train.recovery_seam.RecoverySeam`."""

    def __init__(
        self,
        member: Member,
        generation: Generation,
        held: HeldState | None,
        retired: Retired | None = None,
    ) -> None:
        self.member = member
        self.retired = retired
        self.generation = generation
        self.held = held
        self.healed_from: int | None = None  # the member whose state this rank loaded
        self.healed_s = 0.0  # from the first ask for this generation to the state loaded
        # The step starting, and the parts' state and the model's buffers as it starts.
        self._boundary: tuple[int, dict[str, Any], dict[str, torch.Tensor]] | None = None
        self._buffer_names: list[str] | None = None
        # The connections this generation's process groups open to the other members (made
        # before they are: dtrain.recovery.sever), and those members' processes.
        self.links = GenerationLinks()
        others = [m for m in generation.members if m != member.id]
        self._peers = member.pids(others) if others else []
        # The addresses whose connections were shut down because a machine was cut off, and
        # whether that machine was this one (it learns so once its link is back).
        self.cut_off: list[str] = []
        self.cut_self = False
        member.on_cut = self._cut_off

    # -- in the loop -----------------------------------------------------------------------

    def regroup(self, step: int) -> NoReturn:
        raise Regroup(f"after step {step}")

    def joiner_waiting(self) -> bool:
        """Whether this generation must regroup to admit a worker (as the watchdog's thread
        last read it: no store call here)."""
        return self.member.pending == self.generation.number

    def step_starting(self, trainer: Trainer) -> None:
        """Keep the parts' state as the step starts (scheduler, data position, counters):
        what a dropped step goes back to."""
        self.held = None  # the state this generation started from is loaded by now
        if self.retired is not None:
            self.retired.free_idle()
        parts = {name: part.state_dict() for name, part in trainer.state.parts.items()}
        # The model's saved buffers too (BatchNorm's running statistics): a step's forward
        # changes them before its collectives can fail. Parameters change only in the
        # optimizer step, after the last collective that can drop the step.
        model = trainer.strategy.unwrapped
        if self._buffer_names is None:
            params = {name for name, _ in model.named_parameters()}
            self._buffer_names = [n for n in model.state_dict() if n not in params]
        saved = model.state_dict()
        buffers = {name: saved[name].clone() for name in self._buffer_names}
        self._boundary = (trainer.step, copy.deepcopy(parts), buffers)

    @staticmethod
    def recoverable(error: BaseException) -> bool:
        return isinstance(error, Regroup) or is_collective_failure(error)

    # -- between generations -------------------------------------------------------------

    def sever(self) -> int:
        """After a failed collective: shut down this generation's connections to the other
        members, so that a peer blocked on this rank fails at once instead of at its timeout
        (:mod:`dtrain.recovery.sever`); how many were shut down."""
        return self.links.sever(self._peers)

    def _cut_off(self, generation: int, cut: list[int], addresses: dict[int, str]) -> None:
        """On the membership thread: every worker of some machines fell silent in this
        generation (``cut``: their link is down, or they are gone). Shut down this
        generation's connections to them, so that a collective waiting on them fails now, not
        after ``dist.timeout_s``; the connections to the membership store stay. When this
        worker is among them, its link is back and the others went on without it: shut down
        its connections to them instead, to leave at once and ask to join."""
        if generation != self.generation.number:
            return
        mine = addresses.get(self.member.id)
        self.cut_self = self.member.id in cut
        peers = [m for m in self.generation.members if m not in cut] if self.cut_self else cut
        if far := sorted({addresses[m] for m in peers if m in addresses} - {mine}):
            self.links.sever_addresses(far, int(self.member.address[1]))
            self.cut_off = far

    def hold(self, trainer: Trainer | None) -> HeldState | None:
        """After a failed collective or a regroup: this rank's state, consistent at a step
        boundary. Before the loop's first step: the state this generation started from."""
        if trainer is None or self._boundary is None:
            return self.held
        step, parts_at_start, buffers_at_start = self._boundary
        dropped = trainer.step == step  # the optimizer step of step+1 had not run
        parts, model = parts_at_start, trainer.strategy.model_state_dict()
        if dropped:
            model.update(buffers_at_start)
        else:
            parts = copy.deepcopy({n: p.state_dict() for n, p in trainer.state.parts.items()})
        payload = {
            "model": model,
            "optimizer": trainer.strategy.optimizer_state_dict(trainer.optimizer),
            "parts": parts,
        }
        step = step if dropped else trainer.step
        return HeldState(self.generation.number, step, payload, dropped)

    def heal(self, trainer: Trainer) -> bool:
        """Collective: load the state of the rank furthest along into every rank; False when
        no rank holds one (the job starts: resume from a checkpoint as always). The first call
        of a generation's trainer: from here on, its watchdog's thread reads what the
        coordinator tells the members (a joiner waits, machines are cut off), while the
        training thread may be blocked in a collective, this one's first."""
        trainer.watchdog.on_wake(self.member.look)
        started = time.monotonic()
        held = self.held
        mine = [held.generation, held.step] if held is not None else [-1, -1]
        world, rank = trainer.runtime.world_size, trainer.runtime.rank
        ranks: list[Any] = all_gather_json(mine) if world > 1 else [mine]
        source = max(range(world), key=lambda r: (ranks[r][0], ranks[r][1], -r))
        if ranks[source][0] < 0:
            return False
        # A rank that holds the source's generation and step holds its state: data-parallel
        # replicas are equal bit for bit, and so are the parts (the data position, schedule,
        # counters: global). Only the others -- a joiner, a worker back from a hang, a rank
        # behind by a step -- receive it, tensor by tensor (dtrain.recovery.handover).
        behind = [r for r in range(world) if ranks[r] != ranks[source]]
        device = trainer.runtime.device
        if rank == source:
            assert held is not None
            for other in behind:
                send_state(held.payload, other, device)
        if rank in behind:
            payload = recv_state(source, device)
        else:
            assert held is not None
            payload = held.payload
        trainer.strategy.load_model_state_dict(payload["model"])
        trainer.strategy.load_optimizer_state_dict(trainer.optimizer, payload["optimizer"])
        for name, part in trainer.state.parts.items():
            if name in payload["parts"]:
                part.load_state_dict(payload["parts"][name])
        self.held = HeldState(self.generation.number, trainer.step, payload)
        self.healed_from = self.generation.members[source]
        first_ask = self.generation.asked_at
        self.healed_s = time.time() - first_ask if first_ask else time.monotonic() - started
        return True

    def event(self) -> dict[str, Any] | None:
        """The ``membership`` event's fields (docs/metrics.md), or None for the first
        generation of a job."""
        gen = self.generation
        if gen.number == 0 or self.healed_from is None:
            return None
        return {
            "generation": gen.number,
            "world_size": gen.world_size,
            "members": list(gen.members),
            "left": list(gen.left),
            "joined": list(gen.joined),
            "healed_from": self.healed_from,
            "seconds": round(self.healed_s, 4),
        }


def generation_runtime(cfg: DistConfig, generation: Generation, member: Member) -> Runtime:
    """This process's place in ``generation``: the old process group destroyed, the new one
    initialized on the coordinator's store under the generation's own prefix."""
    rank, world = generation.rank_of(member.id), generation.world_size
    runtime, backend = place_worker(cfg, rank, world, member.local)
    if dist.is_initialized():
        dist.destroy_process_group()
    # The generation's keys in the coordinator's store, for what reads the job's store (the
    # watchdog's beats): none left over from an earlier generation.
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = member.address
    os.environ[NAMESPACE_ENV] = f"inplace/gen{generation.number}/dtrain/"
    os.environ[GENERATION_ENV] = str(generation.number)  # the liveness records' attempt
    if world > 1:
        store = dist.PrefixStore(f"inplace/gen{generation.number}/pg", member.store)  # type: ignore[attr-defined]
        init_group(runtime, backend, store)
    return runtime


def leave(trainer: Trainer | None) -> None:
    """Let go of a generation's trainer and process groups (its peers may be gone); the
    objects themselves are kept a while (:class:`Retired`)."""
    if trainer is not None:
        with contextlib.suppress(Exception):
            trainer.loader.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class Retired:
    """The trainers of earlier generations, kept until their process groups' work threads are
    idle: every collective they ran has failed or timed out (``dist.timeout_s``). Freeing a
    gloo group while one of its threads still holds a collective deadlocks: its destructor
    joins the thread holding the GIL, and the thread needs the GIL to release the collective's
    tensors (seen in a chaos trial). Their sockets stay open meanwhile; after a failure the
    connections to the other members are shut down at once (:meth:`Recovery.sever`), so no
    peer waits on them. Then one collection frees them (quick: older objects are frozen)."""

    def __init__(self, idle_after_s: float) -> None:
        self.idle_after_s = idle_after_s
        self.kept: list[tuple[float, Any]] = []

    def keep(self, trainer: Any) -> None:
        self.kept.append((time.monotonic(), trainer))

    def wait_for_saves(self) -> None:
        """Until no earlier generation's checkpoint save is in flight on this rank."""
        for _, trainer in self.kept:
            trainer.checkpointer.wait()

    def free_idle(self) -> None:
        now = time.monotonic()
        if self.kept and now - self.kept[0][0] > self.idle_after_s:
            self.kept = [(t, obj) for t, obj in self.kept if now - t <= self.idle_after_s]
            gc.collect()
