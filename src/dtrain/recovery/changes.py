"""What the in-place coordinator knows of the membership, kept in memory and read back from the
store by what changed (:class:`Changes`), not by reading every member's keys at every poll.

A poster of a member's record (:func:`dtrain.recovery.membership.post`: a member registering or
asking, a machine's launcher posting a state) appends the record's name to ``inplace/changes``
after writing it. A poll reads, in one ``multi_get``: that log, a slice of ``SWEEP_KEYS`` member
keys in turn, and every ``VOICE_S`` the other machines' launchers' counters; it empties the log
(``compare_set``: a name appended meanwhile stays) and reads at most ``BATCH`` of the records
named since, in one more call; the rest wait in :attr:`Changes.behind` for the next polls. So a
poll costs at most ``SWEEP_KEYS + BATCH`` keys, not O(members) nor O(changes): at 4,096 members
the poll that read every member's keys took 1.2 s against its 10 ms interval, and the one that
read all 4,096 asks of a regroup at once 0.1-0.4 s, while every other call to the store waited
behind it. The sweep keeps what nobody announced within reach: a stranger's write (read,
found forged, warned of once) and a post whose poster was killed between its two calls.
"""

from __future__ import annotations

import itertools
from typing import Any

from dtrain.dist.sealed_store import warn_once
from dtrain.recovery.membership import CHANGES, PREFIX
from dtrain.recovery.node_claim import BUMP_S, alive_key

# How often the other machines' counters are read: a machine falls silent over stale_s
# (seconds), so reading them every poll (10 ms) bought nothing.
VOICE_S = BUMP_S / 2
# Member keys a poll reads back besides those posted since the last: all of them up to 32
# members, a full round every W/32 polls beyond.
SWEEP_KEYS = 96
# Keys never seen set that one poll looks for one by one (multi_get waits on them), while the
# members are few enough for a poll to read all of theirs.
CHECKS = 16
# Posted records a poll reads, and members the coordinator looks at again: what one poll does
# is bounded by this, not by the members. About 17 us each (read, seal checked, parsed,
# decided on; a loaded 2-core machine): a poll of ~2-5 ms of CPU at most; the 4,096 asks of a
# regroup at 4,096 members are read over 32 polls (in one poll: 0.1-0.4 s).
BATCH = 128
# Proofs of a generation a poll writes (about 5 us each: sealed, sent in one multi_set).
PROOFS = 512
PARTS = ("info", "want", "state")


def member_key(member: int, part: str) -> str:
    """The store key of a member's ``part`` (info, want, state)."""
    return f"{PREFIX}member/{member}/{part}"


def counter_value(key: str, raw: bytes | None) -> int:
    """A counter's value (``store.add``: not sealed); 0 while unset, and for one a stranger
    made no number (warned once)."""
    if raw is None:
        return 0
    try:
        return int(bytes(raw))
    except ValueError:
        warn_once(key, "it is malformed (not a counter)")
        return 0


class Changes:
    """The raw values of ``keys`` (member records) and of the counters of machines ``others``
    as last read (:attr:`raw`), and when each counter last moved (:attr:`voices`)."""

    def __init__(self, store: Any, members: int, keys: list[str], others: list[int]) -> None:
        self.store = store
        self.members = members
        self._keys = keys
        self._alive_keys = [alive_key(node) for node in others]
        # Each machine's counter as last read, and when it last moved (-1: never read).
        self.voices: dict[int, tuple[int, float]] = {node: (-1, 0.0) for node in others}
        # The counters and the log exist from here on: one multi_get reads them (it would
        # wait on a key never set).
        for key in self._alive_keys:
            store.add(key, 0)
        store.append(PREFIX + CHANGES, b"")
        self.raw: dict[str, bytes | None] = dict.fromkeys([*keys, *self._alive_keys])
        self._known: set[str] = set(self._alive_keys)  # keys set (none is ever removed)
        self._sweep = 0  # where the next poll's slice of member keys starts
        self._checks = 0  # where its looks for keys never seen set start
        self._voiced_at: float | None = None
        self.changed: set[str] = set()  # the keys whose value the last read found changed
        # Records named in the log and not read yet (in the order named; at most one entry a
        # key however often it was posted): BATCH of them are read a poll.
        self._backlog: dict[str, None] = {}
        # Each line a log may hold, and the key it names: a log of thousands of lines is
        # checked by set operations, not line by line in Python (6 ms at 4,096 lines).
        self._line_key = {
            f"{key.split('/')[-2]}/{key.split('/')[-1]}".encode(): key
            for key in keys
            if key.startswith(PREFIX + "member/")
        }

    @property
    def behind(self) -> int:
        """How many posted records wait to be read by the next polls."""
        return len(self._backlog)

    def read(self, now: float) -> bool:
        """Read what changed since the last call into :attr:`raw`; whether anything did."""
        log_key = PREFIX + CHANGES
        window = self._window()
        # Taking turns over a few members at a time, a key never set (a member that never
        # registered) is looked for with the others only: known from its post when it comes.
        few = len(self._keys) <= SWEEP_KEYS
        self._learn([key for key in window if key not in self._known], CHECKS if few else 0)
        keys = [log_key]
        if self._voiced_at is None or now - self._voiced_at >= VOICE_S:
            self._voiced_at = now
            keys += self._alive_keys
        keys += [key for key in window if key in self._known]
        values: dict[str, bytes] = dict(zip(keys, self.store.multi_get(keys), strict=True))
        self._backlog.update(dict.fromkeys(self._posted(bytes(values.pop(log_key)))))
        taken = list(itertools.islice(self._backlog, BATCH))
        for key in taken:
            del self._backlog[key]
        posted = [key for key in taken if key not in values]  # (the slice's are read)
        self._learn([key for key in posted if key not in self._known], None)
        if extra := [key for key in posted if key in self._known]:
            values.update(zip(extra, self.store.multi_get(extra), strict=True))
        self.changed = set()
        for key, raw in values.items():
            if self.raw[key] != bytes(raw):
                self.raw[key] = bytes(raw)
                self.changed.add(key)
        for node, key in zip(self.voices, self._alive_keys, strict=True):
            count = counter_value(key, self.raw[key])
            if count != self.voices[node][0]:
                self.voices[node] = (count, now)
        return bool(self.changed)

    def _window(self) -> list[str]:
        """The next slice of member keys (all of them while they are few)."""
        if len(self._keys) <= SWEEP_KEYS:
            return self._keys
        start, end = self._sweep, self._sweep + SWEEP_KEYS
        self._sweep = end % len(self._keys)
        return self._keys[start:end] + self._keys[: max(0, end - len(self._keys))]

    def _learn(self, keys: list[str], limit: int | None) -> None:
        """Mark those of ``keys`` that are set as known: one ``check`` for all, else one
        each (at most ``limit`` a poll, taking turns; None: all)."""
        if not keys:
            return
        if self.store.check(keys):
            self._known.update(keys)
            return
        if limit is not None and len(keys) > limit:
            start = self._checks % len(keys)
            self._checks += limit
            keys = (keys + keys)[start : start + limit]
        self._known.update(key for key in keys if self.store.check([key]))

    def _posted(self, log: bytes) -> list[str]:
        """The member keys the change log names, the log emptied (``compare_set``: a name
        appended meanwhile stays for the next poll; a name read twice is read again, no
        harm). A line that names no member's record (a stranger's) is ignored, warned once."""
        log_key = PREFIX + CHANGES
        lines: dict[bytes, None] = {}  # in the order posted, each once
        for _ in range(3):  # appends racing the emptying: the rest waits for the next poll
            if not log:
                break
            lines.update(dict.fromkeys(log.split(b"\n")))
            log = bytes(self.store.compare_set(log_key, log, b""))
        lines.pop(b"", None)
        names: list[str] = []
        for line in lines:
            if (key := self._line_key.get(line)) is not None:
                names.append(key)
                continue
            # A record this coordinator does not read (this machine's members' states, which
            # it takes from /proc) is no stranger's; anything else is.
            member, _, part = line.decode(errors="replace").partition("/")
            if not (member.isdigit() and int(member) < self.members and part in PARTS):
                warn_once(log_key, "it is malformed (names no member's record)")
        return names
