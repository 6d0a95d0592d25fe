"""Count-based LRU policy for one tier of adapters (GPU slots or the CPU cache).

Purely computational: the cache decides which keys to evict and returns them; the caller does the
evicting (deletes the adapter from the pipeline, drops a state dict). Pinned keys are never
evicted, nor are keys the caller marks as protected (the batch being prepared). When no key can be
evicted the cache raises instead of overflowing, and the message says why.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator

from lora_inference import errors


class SlotsExhausted(errors.AdapterConflict):
    """Every slot holds a pinned or protected adapter."""


class LRUTier:
    def __init__(self, name: str, capacity: int, *, label: Callable[[str], str] = str) -> None:
        if capacity < 1:
            raise ValueError(f"{name} capacity must be at least 1, got {capacity}")
        self.name = name
        self.capacity = capacity
        self._label = label  # how a key is named in error messages
        self._order: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._pinned: set[str] = set()

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[str]:
        return iter(self._order)

    def touch(self, key: str) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def pinned(self) -> frozenset[str]:
        return frozenset(self._pinned)

    def plan_admit(
        self,
        key: str,
        *,
        pinned: bool = False,
        protected: Collection[str] = (),
        prefer_keep: Collection[str] = (),
    ) -> list[str]:
        """Which keys must go for `key` to fit (pure: changes nothing).

        Least recently used first, skipping pinned and protected keys; keys in `prefer_keep`
        (adapters that queued requests will ask for next) go only when nothing else can.
        """
        if key in self._order:
            if pinned and key not in self._pinned and self._pinned_full(excluding=key):
                raise self._exhausted(key)
            return []
        if pinned and self._pinned_full():
            raise self._exhausted(key)
        overflow = len(self._order) + 1 - self.capacity
        if overflow <= 0:
            return []
        evictable = [k for k in self._order if k not in self._pinned and k not in protected]
        ordered = [k for k in evictable if k not in prefer_keep] + [
            k for k in evictable if k in prefer_keep
        ]
        if len(ordered) < overflow:
            raise self._exhausted(key)
        return ordered[:overflow]

    def admit(self, key: str, *, pinned: bool = False, evicted: Collection[str] = ()) -> None:
        """Record `key` as present (most recently used), after the caller evicted `evicted`."""
        for old in evicted:
            self.remove(old)
        if len(self._order) >= self.capacity and key not in self._order:
            raise self._exhausted(key)
        self._order[key] = None
        self._order.move_to_end(key)
        if pinned:
            self._pinned.add(key)

    def remove(self, key: str) -> bool:
        """Forget `key`; return whether it was present."""
        self._pinned.discard(key)
        if key not in self._order:
            return False
        del self._order[key]
        return True

    def _pinned_full(self, excluding: str | None = None) -> bool:
        return len(self._pinned - {excluding}) >= self.capacity

    def _exhausted(self, key: str) -> SlotsExhausted:
        pinned = sorted(self._label(k) for k in self._pinned)
        return SlotsExhausted(
            f"cannot make room for adapter {self._label(key)!r} in the {self.name} tier: "
            f"all {self.capacity} "
            f"slots are pinned or in use (pinned: {', '.join(pinned) or 'none'}); unpin or unload "
            f"one, or raise the tier's size (--max-loras / --max-cpu-loras)",
        )
