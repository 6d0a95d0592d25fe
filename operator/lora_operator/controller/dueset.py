"""Which adapters an actor's loop must look at: those marked since its last pass, and those due
at a time (a retry, a write planned for later, a pause's end), with one wake-up for both. The
status writer and rollouts each own one; the loop waits (`wait`), then takes what is due (`take`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from lora_operator.controller.seams import Key


class DueSet:
    def __init__(self) -> None:
        self._marked: set[Key] = set()
        self._at: dict[Key, float] = {}  # monotonic time to look again
        self._wake = asyncio.Event()

    def mark(self, key: Key) -> None:
        """Look at `key` in the next pass."""
        self._marked.add(key)
        self._wake.set()

    def poke(self) -> None:
        """Run a pass though nothing is marked: the actor has work of its own for it."""
        self._wake.set()

    def after(self, key: Key, delay: float) -> None:
        """Look at `key` again `delay` seconds from now (replacing a time it had)."""
        self._at[key] = time.monotonic() + delay
        self._wake.set()

    def at(self, key: Key, when: float) -> None:
        """Look at `key` again at monotonic time `when`: from inside a pass, whose loop reads the
        times before it waits again, so nothing needs waking."""
        self._at[key] = when

    def unschedule(self, key: Key) -> float | None:
        """Drop the time `key` was due at, and say what it was."""
        return self._at.pop(key, None)

    def forget(self, key: Key) -> None:
        self._marked.discard(key)
        self._at.pop(key, None)

    async def wait(self) -> None:
        """Until something is marked or the earliest time comes."""
        timeout = max(0.0, min(self._at.values()) - time.monotonic()) if self._at else None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout)
        self._wake.clear()

    def take(self, now: float) -> set[Key]:
        """The keys marked, and those due by `now`; the marks are cleared, the times kept (the
        pass unschedules what it handles)."""
        keys = self._marked | {k for k, t in self._at.items() if t <= now}
        self._marked = set()
        return keys
