"""Rank 0 hosts the job's key-value store (unless the launcher does), so its process ending
ends the store. When rank 0 fails because a peer failed, the other ranks are diagnosing the
same failure at the same moment, through that store (whose beats went stale, who posted what):
a store gone a few milliseconds early makes each of them name rank 0, "died", instead of the
peer at fault. So rank 0 keeps its process, and the store, up until every other rank has
posted its own failure, for at most as long as their diagnosis can take."""

from __future__ import annotations

import os
import time

from dtrain.dist.runtime import store_hosted_by_launcher
from dtrain.dist.store_link import job_store_link
from dtrain.fault.diagnosis import POSTS_GRACE_S, stale_after_s
from dtrain.fault.watchdog.records import failed_ranks

_LOOK_S = 0.1  # how often the failures' index is read meanwhile


def hold_store_for_peers(heartbeat_s: float) -> None:
    """On rank 0 hosting the job's store (else nothing): return once every other rank has
    posted its failure, or after the longest diagnosis (``fault.heartbeat_s`` gives it), or at
    once if the store cannot be read."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if os.environ.get("RANK") != "0" or world <= 1 or store_hosted_by_launcher():
        return
    link = job_store_link(1.0, 1.0)
    if link is None:
        return
    # A peer's diagnosis waits for a beat to go stale and reads its watchers' posts a little
    # longer; it began when its collective failed, about when this rank's did.
    deadline = time.monotonic() + stale_after_s(heartbeat_s) + POSTS_GRACE_S + 1.0
    others = set(range(1, world))
    while time.monotonic() < deadline:
        try:
            if others <= failed_ranks(link, 1.0):  # a stranger's entries only end it early
                return
        except Exception:
            return
        time.sleep(_LOOK_S)
