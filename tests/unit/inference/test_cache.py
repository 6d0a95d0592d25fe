"""The LRU tier policy: pure, so tested exhaustively and with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_inference.adapters.cache import LRUTier, SlotsExhausted


def filled(capacity: int, *keys: str) -> LRUTier:
    tier = LRUTier("gpu", capacity)
    for key in keys:
        tier.admit(key, evicted=tier.plan_admit(key))
    return tier


def test_admitting_into_free_room_evicts_nothing() -> None:
    tier = filled(3, "a", "b")
    assert tier.plan_admit("c") == []


def test_least_recently_used_goes_first() -> None:
    tier = filled(2, "a", "b")
    tier.touch("a")
    assert tier.plan_admit("c") == ["b"]


def test_admitting_a_present_key_evicts_nothing() -> None:
    tier = filled(2, "a", "b")
    assert tier.plan_admit("a") == []


def test_plan_changes_nothing_until_admit() -> None:
    tier = filled(1, "a")
    assert tier.plan_admit("b") == ["a"]
    assert list(tier) == ["a"]
    tier.admit("b", evicted=["a"])
    assert list(tier) == ["b"]


def test_pinned_keys_are_never_evicted() -> None:
    tier = LRUTier("gpu", 2)
    tier.admit("pinned", pinned=True)
    tier.admit("b")
    tier.touch("pinned")
    tier.touch("b")
    assert tier.plan_admit("c") == ["b"]


def test_protected_keys_are_skipped() -> None:
    tier = filled(2, "a", "b")
    assert tier.plan_admit("c", protected={"a"}) == ["b"]


def test_keys_wanted_by_the_queue_go_last() -> None:
    tier = filled(3, "a", "b", "c")
    assert tier.plan_admit("d", prefer_keep={"a"}) == ["b"]
    assert tier.plan_admit("d", prefer_keep={"a", "b", "c"}) == ["a"]


def test_all_pinned_raises_and_names_them() -> None:
    tier = LRUTier("gpu", 2, label=str.upper)
    tier.admit("a", pinned=True)
    tier.admit("b", pinned=True)
    with pytest.raises(SlotsExhausted, match=r"all 2 slots.*pinned: A, B.*--max-loras"):
        tier.plan_admit("c")


def test_pinning_beyond_capacity_is_refused() -> None:
    tier = LRUTier("gpu", 1)
    tier.admit("a", pinned=True)
    with pytest.raises(SlotsExhausted):
        tier.plan_admit("b", pinned=True)


def test_remove_reports_presence_and_unpins() -> None:
    tier = LRUTier("gpu", 1)
    tier.admit("a", pinned=True)
    assert tier.remove("a") is True
    assert tier.remove("a") is False
    assert tier.pinned() == frozenset()


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        LRUTier("gpu", 0)


operations = st.lists(
    st.tuples(st.sampled_from(["use", "pin", "remove"]), st.sampled_from("abcdefg")), max_size=60
)


@given(capacity=st.integers(1, 4), ops=operations)
def test_invariants_hold_for_any_sequence(capacity: int, ops: list[tuple[str, str]]) -> None:
    """Never over capacity; pinned keys stay; each admit evicts only unpinned keys."""
    tier = LRUTier("gpu", capacity)
    for op, key in ops:
        if op == "remove":
            tier.remove(key)
            continue
        pinned_before = tier.pinned()
        try:
            evicted = tier.plan_admit(key, pinned=op == "pin")
        except SlotsExhausted:
            assert len(pinned_before | ({key} if op == "pin" else set())) >= capacity
            continue
        assert not set(evicted) & pinned_before
        tier.admit(key, pinned=op == "pin", evicted=evicted)
        assert key in tier
        assert pinned_before <= set(tier)
        assert len(tier) <= capacity
        assert list(tier)[-1] == key  # most recently used is last
