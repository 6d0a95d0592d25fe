"""Which Events the operator posts about an adapter, and when a repeat joins a series (pure).

One Event per adapter per transition: when the status written for an adapter changes its
(phase, reason), one Event says so, with the pods summarised ("Loaded on 10/10 pods", "Failed
on 2/10 pods: ..."); the detail per pod is in `status.pods`. Starting work (Staging, waiting to
be staged) is no news and raises none. An Event that repeats one posted within `window_s`
(same adapter, type, reason and note: a pod restarting, a source flapping) becomes the next
count of that Event's `series` (events.k8s.io/v1) instead of a new object.

Nothing here does I/O; the controller posts what `plan_event` returns, through `Series`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lora_operator.rules.status import Headline, Summary, same_headline

MAX_NOTE_CHARS = 1024  # the API server refuses longer notes
QUIET = (("Staging", "Staging"), ("Pending", "NotStaged"))


@dataclass(frozen=True)
class Note:
    type: Literal["Normal", "Warning"]
    reason: str
    note: str


def plan_event(previous: Headline | None, summary: Summary) -> Note | None:
    """The Event a status write announces, or None. `previous`: the headline of the status the
    object had (None: none; after a restart or a takeover only a new phase is news)."""
    if same_headline(previous, summary) or summary.headline in QUIET:
        return None
    return Note(
        type="Warning" if summary.warning else "Normal",
        reason=summary.reason,
        note=summary.message[:MAX_NOTE_CHARS],
    )


SeriesKey = tuple[str, str, str, str]  # (the adapter's uid, type, reason, note)


@dataclass
class _Posted:
    name: str
    count: int
    last: float  # monotonic seconds


class Series:
    """The Events posted lately, so that a repeat counts into the first one's series."""

    def __init__(self, window_s: float = 600.0) -> None:
        self.window_s = window_s
        self._posted: dict[SeriesKey, _Posted] = {}
        # The keys of each adapter's Events: deleting ten thousand adapters forgets each one's
        # own keys, not a scan of every Event posted (K x K).
        self._by_uid: dict[str, set[SeriesKey]] = {}
        self._expired_at = 0.0

    def record(self, key: SeriesKey, now: float, name: str) -> tuple[str, int]:
        """(the Event's name, its count): count 1 means create an Event named `name`; more
        means patch that count into the series of the Event returned."""
        posted = self._posted.get(key)
        if posted is None or now - posted.last > self.window_s:
            self._expire(now)
            self._posted[key] = _Posted(name, 1, now)
            self._by_uid.setdefault(key[0], set()).add(key)
            return name, 1
        posted.count += 1
        posted.last = now
        return posted.name, posted.count

    def forget(self, uid: str) -> None:
        """Drop what is remembered about one adapter (deleted)."""
        for key in self._by_uid.pop(uid, ()):
            self._posted.pop(key, None)

    def __len__(self) -> int:
        return len(self._posted)

    def _expire(self, now: float) -> None:
        if now - self._expired_at < self.window_s / 10:
            return  # a sweep now and then keeps a create O(1)
        self._expired_at = now
        for key in [k for k, p in self._posted.items() if now - p.last > self.window_s]:
            del self._posted[key]
            keys = self._by_uid.get(key[0])
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_uid[key[0]]
