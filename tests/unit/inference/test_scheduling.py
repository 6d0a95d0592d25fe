"""Batch planning: pure, so tested for grouping, affinity and the fairness bound."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_inference.scheduling import BatchKey, adapters_wanted, plan_next_batch


@dataclass
class Item:
    key: BatchKey
    images: int = 1
    skipped: int = 0
    ident: int = 0


def key(adapter: str | None, scale: float = 1.0, size: int = 32) -> BatchKey:
    return BatchKey(
        adapter=adapter, scale=scale, width=size, height=size, steps=2, guidance_scale=5.0
    )


def test_empty_queue_plans_nothing() -> None:
    assert plan_next_batch([], set(), max_batch_images=4, max_skips=2, max_adapters=2) is None


def test_batch_fills_with_any_adapters_up_to_the_image_limit() -> None:
    queue = [Item(key("a")), Item(key("b")), Item(key("c"), images=2), Item(key("a"), images=1)]
    plan = plan_next_batch(queue, {"a"}, max_batch_images=3, max_skips=2, max_adapters=2)
    assert plan is not None
    assert plan.members == [0, 1, 3]
    assert not plan.skipped_head


def test_resident_adapters_fill_the_batch_before_ones_that_need_a_load() -> None:
    queue = [Item(key("a")), Item(key("cold")), Item(key("a"), images=2)]
    plan = plan_next_batch(queue, {"a"}, max_batch_images=3, max_skips=2, max_adapters=2)
    assert plan is not None and plan.members == [0, 2]


def test_an_adapter_never_appears_with_two_scales_and_shapes_never_mix() -> None:
    queue = [Item(key("a")), Item(key("a", scale=0.5)), Item(key("a", size=64)), Item(key("a"))]
    plan = plan_next_batch(queue, {"a"}, max_batch_images=8, max_skips=2, max_adapters=2)
    assert plan is not None and plan.members == [0, 3]


def test_a_batch_needs_no_more_adapters_than_slots() -> None:
    queue = [Item(key("a")), Item(key("b")), Item(key("c")), Item(key(None))]
    plan = plan_next_batch(queue, set(), max_batch_images=8, max_skips=2, max_adapters=2)
    assert plan is not None and plan.members == [0, 1, 3]


def test_pinned_adapters_do_not_use_up_the_batch_budget() -> None:
    queue = [Item(key("p")), Item(key("b")), Item(key("c"))]
    plan = plan_next_batch(
        queue, {"p"}, max_batch_images=8, max_skips=2, max_adapters=2, pinned={"p"}
    )
    assert plan is not None and plan.members == [0, 1, 2]


def test_resident_adapter_may_pass_a_cold_head() -> None:
    queue = [Item(key("cold")), Item(key("hot"))]
    plan = plan_next_batch(queue, {"hot"}, max_batch_images=4, max_skips=2, max_adapters=1)
    assert plan is not None and plan.members == [1] and plan.skipped_head


def test_a_cold_head_joins_the_batch_when_a_slot_is_free() -> None:
    queue = [Item(key("cold")), Item(key("hot"))]
    plan = plan_next_batch(queue, {"hot"}, max_batch_images=4, max_skips=2, max_adapters=2)
    assert plan is not None and plan.members == [0, 1] and not plan.skipped_head


def test_base_model_requests_count_as_resident() -> None:
    queue = [Item(key("cold"), images=4), Item(key(None))]
    plan = plan_next_batch(queue, set(), max_batch_images=4, max_skips=2, max_adapters=2)
    assert plan is not None and plan.members == [1] and plan.skipped_head


def test_head_skipped_max_times_goes_next() -> None:
    queue = [Item(key("cold"), skipped=2), Item(key("hot"))]
    plan = plan_next_batch(queue, {"hot"}, max_batch_images=4, max_skips=2, max_adapters=1)
    assert plan is not None and plan.members == [0] and not plan.skipped_head


def test_adapters_wanted_lists_queued_adapters() -> None:
    assert adapters_wanted([Item(key("a")), Item(key(None)), Item(key("b"))]) == {"a", "b"}


@settings(max_examples=150, deadline=None)
@given(
    adapters=st.lists(st.sampled_from(["a", "b", "c", "d", None]), min_size=1, max_size=25),
    resident_pick=st.lists(st.sampled_from(["a", "b", "c", "d"]), max_size=2),
    max_skips=st.integers(0, 3),
)
def test_every_request_is_served_within_the_bound(
    adapters: list[str | None], resident_pick: list[str], max_skips: int
) -> None:
    """Simulate the engine: each request runs within (position + 1) * (max_skips + 1) batches."""
    queue = [Item(key(a), ident=i) for i, a in enumerate(adapters)]
    positions = {item.ident: i for i, item in enumerate(queue)}
    resident = list(dict.fromkeys(resident_pick))
    batches = 0
    served: dict[int, int] = {}
    while queue:
        plan = plan_next_batch(
            queue, set(resident), max_batch_images=2, max_skips=max_skips, max_adapters=2
        )
        assert plan is not None
        if plan.skipped_head:
            queue[0].skipped += 1
        batches += 1
        chosen = [queue[i] for i in plan.members]
        assert len({item.key.shape for item in chosen}) == 1
        needed = list(dict.fromkeys(i.key.adapter for i in chosen if i.key.adapter is not None))
        assert len(needed) <= 2
        for item in chosen:
            served[item.ident] = batches
        # Two GPU slots, LRU: the batch's adapters become the most recent.
        resident = [*(a for a in resident if a not in needed), *needed][-2:]
        queue = [item for i, item in enumerate(queue) if i not in set(plan.members)]
    for ident, batch_number in served.items():
        assert batch_number <= (positions[ident] + 1) * (max_skips + 1)
    assert len(served) == len(adapters)


def alone(adapter: str, scale: float = 1.0) -> BatchKey:
    return BatchKey(
        adapter=adapter, scale=scale, width=32, height=32, steps=2, guidance_scale=5.0, alone=True
    )


@pytest.mark.parametrize(
    ("queue", "batches"),
    [
        pytest.param(
            [alone("m"), key("a"), key(None), alone("m"), key("b")],
            [[0, 3], [1, 2, 4]],
            id="merged-only-first",
        ),
        pytest.param(
            [key("a"), alone("m"), key(None), alone("m")],
            [[0, 2], [1, 3]],
            id="plain-first",
        ),
        pytest.param(
            [alone("m"), alone("n"), alone("m", scale=0.5), alone("n")],
            [[0], [1, 3], [2]],
            id="two-merged-only-adapters-and-two-scales",
        ),
    ],
)
def test_a_merged_only_adapter_is_batched_with_its_own_requests_only(
    queue: list[BatchKey], batches: list[list[int]]
) -> None:
    """Its delta is merged into the base weights for the call: another adapter's image, or the
    base model's, in that call would be drawn through it."""
    items = [Item(k, ident=i) for i, k in enumerate(queue)]
    planned = []
    while items:
        plan = plan_next_batch(
            items, {"a", "b", "m", "n"}, max_batch_images=8, max_skips=2, max_adapters=4
        )
        assert plan is not None
        planned.append([items[i].ident for i in plan.members])
        items = [item for i, item in enumerate(items) if i not in plan.members]
    assert planned == batches
