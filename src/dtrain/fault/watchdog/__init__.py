"""Hang and failure detection that names the rank at fault, and where it was.

Each rank's liveness is one record (:mod:`dtrain.fault.liveness`): step, phase, progress
inside the phase, alive stamp and speed, in ``RUN_DIR/liveness/rankN``. The training thread
writes where it is (:meth:`Watchdog.in_phase` around each phase, :meth:`Watchdog.tick` as
a long phase progresses) into the file's shared memory, without a system call. This module's
daemon thread does the rest: it stamps the record alive, measures the rank's speed, and mirrors
the record into the job's key-value store (hosted by rank 0 under ``dtrain train``, by torch's
agent under plain ``torchrun``) as ``dtrain/hb/<rank>``, every ``heartbeat_s`` seconds and soon
(within ~0.4 s) after the rank enters a step or phase that lasts. The training thread never
waits on the store. A rank that raises posts ``dtrain/failed/<rank>`` before it exits. Both
records are sealed with the job's secret (:mod:`dtrain.dist.sealed_store`): one that fails
its seal (a stranger's, who reached the store's port) is read as none, with one warning.

When a collective fails on a rank -- a peer's socket closed, or the collective timeout
(``dist.timeout_s``) expired because a peer stopped responding -- :meth:`Watchdog.diagnose`
reads the store and names who is missing, and where. It reads the index of what the ranks
posted and the beats of two watched ranks (the next on its machine, its place on the next
machine), never every rank's: a rank that finds a watched one gone or silent posts it to the
index, where the others read it -- a few calls and keys per rank at any world size. It names:

- a rank that posted a failure: its error, and the step and phase it raised in;
- a rank of this machine whose process is gone (``kill -9``, the OOM killer): the exact step
  and phase it died in, from its liveness file (a beat in the store may be many steps behind
  in a run whose steps take milliseconds); without a readable file, the step is said to be
  unknown and the last beat is given with its age;
- a rank whose beat is stale (stopped, hung, or on a machine that was cut off): how long it has
  made no progress and where, from its file on this machine; elsewhere, its last beat with
  its age -- never a stale step presented as where it is;
- a rank that never beat;
- when the store itself is gone or frozen with rank 0: rank 0, by its last beat (kept while the
  store answered) or its file. Every store call is bounded in time, so a frozen store never
  hangs a rank.

The trainer raises that as a :class:`~dtrain.fault.peer_failure.PeerFailure`.

As a backstop for hangs outside a collective with a timeout, the thread also watches this
rank's record: when neither its phase nor its progress has moved for twice the collective
timeout, it writes the diagnosis as this worker's error and ends the process, so the launcher
stops (or restarts) the group instead of hanging. A long phase is no hang as long as it ticks:
an evaluation per batch, a blocking save per file written, rank 0's resume check per file
hashed. A rank other than 0 is also not hung while rank 0's record moves: the work only one
rank does (the resume check, a checkpoint's commit, writing the whole-model files) is rank
0's, and the others wait for it in a collective. Were such a rank stuck on its own, rank 0
would soon wait for it in a collective, stop moving, and name it when that times out.

==============  =============================================================================
``dog``         :class:`Watchdog`: phases, the liveness thread, the hang backstop, diagnosis
``records``     what it posts to the store and reads back (failures, dead ranks, attempts)
==============  =============================================================================
"""

from dtrain.fault.watchdog.dog import InPhase, Watchdog
from dtrain.fault.watchdog.records import GENERATION_ENV, failure_text, liveness_attempt

__all__ = ["GENERATION_ENV", "InPhase", "Watchdog", "failure_text", "liveness_attempt"]
