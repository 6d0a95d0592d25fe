"""Which queued requests run together next.

Purely computational. A batch holds requests that agree on everything the pipeline call takes
once for all images (adapter, scale, size, steps, guidance); prompts, negative prompts and seeds
vary per image. The oldest request normally anchors the next batch. To save adapter switches, a
request whose adapter is already resident may go first, but the oldest request can be passed over
at most `max_skips` times, so every request waits behind a bounded number of batches:
at most (position in queue + 1) x (max_skips + 1).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BatchKey:
    adapter: str | None  # the adapter's pipeline key, None for the base model
    scale: float
    width: int
    height: int
    steps: int
    guidance_scale: float


class Queued(Protocol):
    @property
    def key(self) -> BatchKey: ...

    @property
    def images(self) -> int: ...

    @property
    def skipped(self) -> int: ...


@dataclass(frozen=True)
class BatchPlan:
    members: list[int]  # indexes into the queue, oldest first
    skipped_head: bool  # the oldest request was passed over for this batch


def plan_next_batch(
    queue: Sequence[Queued],
    resident: Collection[str],
    *,
    max_batch_images: int,
    max_skips: int,
) -> BatchPlan | None:
    """Choose the next batch from `queue` (oldest first); None when the queue is empty."""
    if not queue:
        return None
    head = queue[0]
    anchor = 0
    if (
        head.key.adapter is not None
        and head.key.adapter not in resident
        and head.skipped < max_skips
    ):
        for i, item in enumerate(queue):
            if item.key.adapter is None or item.key.adapter in resident:
                anchor = i
                break
    key = queue[anchor].key
    members = [anchor]
    total = queue[anchor].images
    for i in range(anchor + 1, len(queue)):
        item = queue[i]
        if item.key == key and total + item.images <= max_batch_images:
            members.append(i)
            total += item.images
    return BatchPlan(members=members, skipped_head=anchor != 0)


def adapters_wanted(queue: Sequence[Queued]) -> set[str]:
    """Adapters that queued requests will need: evicted last."""
    return {item.key.adapter for item in queue if item.key.adapter is not None}
