"""Which queued requests run together next.

Purely computational. A batch holds requests that agree on what the pipeline call takes once for
all images (size, steps, guidance); prompts, negative prompts, seeds and adapters vary per image.
Requests for different adapters share a batch through peft's per-sample adapter routing, as long
as the batch needs no more adapters than there are GPU slots and each adapter appears with one
scale (a scale is per adapter inside the pipeline, not per image).

A merged-only adapter (LoKr with a full w2, `.diff` files, kohya DoRA: `BatchKey.alone`) is
merged whole into the base weights for its call, so its batches hold its own requests only: no
other adapter and no base-model image ever shares one (`_may_join`).

A batch is planned from the requests queued now; one that is not full never waits for a request
still being admitted (its adapter read for its first use): on a GPU a call costs about its images'
time, so a place left free costs less than holding every image of the batch for a read.

The oldest request normally anchors the next batch. To save adapter loads, a request whose adapter
is already resident may anchor instead, but the oldest request can be passed over at most
`max_skips` times, so every request waits behind a bounded number of batches:
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
    alone: bool = False  # a merged-only adapter: batched with its own requests only

    @property
    def shape(self) -> tuple[int, int, int, float]:
        """What every image of one pipeline call must share."""
        return (self.width, self.height, self.steps, self.guidance_scale)


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
    max_adapters: int,
    pinned: Collection[str] = (),
) -> BatchPlan | None:
    """Choose the next batch from `queue` (oldest first); None when the queue is empty.

    `max_adapters` bounds the adapters a batch may need besides the `pinned` ones, which are
    always resident: every adapter of a batch must be resident at once while it runs.
    """
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
    first = queue[anchor]
    scales: dict[str, float] = {}
    if first.key.adapter is not None:
        scales[first.key.adapter] = first.key.scale
    members = [anchor]
    total = first.images
    # Fill with requests whose adapters cost nothing first (resident, or already in the batch),
    # then with ones that need a load, so a batch does not evict adapters it could have used.
    candidates = [
        i
        for i, item in enumerate(queue)
        if i != anchor and item.key.shape == first.key.shape and _may_join(first.key, item.key)
    ]
    free = [i for i in candidates if _costs_nothing(queue[i].key.adapter, resident, scales)]
    costly = [i for i in candidates if i not in set(free)]
    for i in free + costly:
        item = queue[i]
        if total + item.images > max_batch_images:
            continue
        adapter = item.key.adapter
        if adapter is not None:
            if adapter in scales:
                if scales[adapter] != item.key.scale:
                    continue
            elif sum(1 for a in scales if a not in pinned) + (adapter not in pinned) > max_adapters:
                continue
            scales[adapter] = item.key.scale
        members.append(i)
        total += item.images
    members.sort()
    return BatchPlan(members=members, skipped_head=members[0] != 0)


def _may_join(anchor: BatchKey, item: BatchKey) -> bool:
    """Whether `item` may share the batch `anchor` starts: a merged-only adapter's requests go
    only with requests for that same adapter, and no other request goes with them."""
    if anchor.alone or item.alone:
        return anchor.adapter == item.adapter
    return True


def _costs_nothing(adapter: str | None, resident: Collection[str], batch: Collection[str]) -> bool:
    return adapter is None or adapter in resident or adapter in batch


def adapters_wanted(queue: Sequence[Queued]) -> set[str]:
    """Adapters that queued requests will need: evicted last."""
    return {item.key.adapter for item in queue if item.key.adapter is not None}
