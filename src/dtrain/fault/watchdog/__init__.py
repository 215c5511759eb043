"""Hang and failure detection that names the rank at fault, and where it was.

The training thread writes where it is into its liveness record (:mod:`dtrain.fault.liveness`)
and never waits on the store; the watchdog's daemon thread stamps the record alive, mirrors it
into the job's store as ``dtrain/hb/<rank>`` (sealed: :mod:`dtrain.dist.sealed_store`) and backs
up the collective timeout: a record whose phase and progress have not moved for twice the
timeout ends the process with the diagnosis as its error. When a collective fails,
:meth:`Watchdog.diagnose` names who is missing and where, reading only the index of posted
findings and the beats of two watched ranks, and every store call is bounded in time, so a
frozen store never hangs a rank. What is named, from what, and why a long phase or a rank
waiting on rank 0 is no hang: docs/fault-tolerance.md, "Hangs and failures name the rank".

==============  =============================================================================
``dog``         :class:`Watchdog`: phases, the liveness thread, the hang backstop, diagnosis
``records``     what it posts to the store and reads back (failures, dead ranks, attempts)
==============  =============================================================================
"""

from dtrain.fault.watchdog.dog import InPhase, Watchdog
from dtrain.fault.watchdog.records import GENERATION_ENV, failure_text, liveness_attempt

__all__ = ["GENERATION_ENV", "InPhase", "Watchdog", "failure_text", "liveness_attempt"]
