"""`GET /v1/adapters` defined once (`lora_podapi.adapters`): both forms parse back to what was
rendered, the listing reads as the residency view says it, and an older server's answers (no
`api_version`, no capacity, entries without a tier) still parse."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_podapi import adapters

NAMES = st.lists(st.from_regex(r"[a-z][a-z0-9-]{0,7}", fullmatch=True), max_size=4)
COUNTS = st.none() | st.integers(0, 1000)
CAPACITIES = st.builds(
    adapters.Capacity,
    model=st.none() | st.just("sdxl"),
    max_loras=COUNTS,
    max_cpu_loras=COUNTS,
    waiting=COUNTS,
    running=COUNTS,
)
ENTRIES = st.builds(
    adapters.Entry,
    id=st.from_regex(r"[a-z][a-z0-9-]{0,7}", fullmatch=True),
    tier=st.sampled_from(adapters.TIERS),
    path=st.none() | st.just("/v/ns/a/revisions/x"),
    pinned=st.none() | st.booleans(),
    origin=st.none() | st.sampled_from(["static", "api", "resolver", "request"]),
    hits=COUNTS,
    last_used=st.none() | st.floats(0, 2e9),
    size_bytes=COUNTS,
    sha256=st.none() | st.just("0" * 64),
    rank=COUNTS,
    format=st.none() | st.just("lora"),
    merged_only=st.none() | st.booleans(),
    targets=st.lists(st.just("unet")).map(tuple),
    trigger_words=st.lists(st.text(max_size=5), max_size=2).map(tuple),
)


@given(NAMES, NAMES, NAMES, CAPACITIES)
def test_the_residency_view_parses_back_to_itself(
    gpu: list[str], cpu: list[str], disk: list[str], capacity: adapters.Capacity
) -> None:
    residency = adapters.Residency(tuple(gpu), tuple(cpu), tuple(disk), capacity)
    rendered = adapters.render_residency(residency)
    assert rendered["object"] == "residency" and rendered["api_version"] == adapters.VERSION
    assert adapters.parse_residency(rendered) == residency


@given(st.lists(ENTRIES, max_size=4), CAPACITIES)
def test_the_listing_parses_back_to_itself_and_reads_as_its_residency(
    entries: list[adapters.Entry], capacity: adapters.Capacity
) -> None:
    listing = adapters.Listing(tuple(entries), capacity)
    rendered = adapters.render_listing(listing)
    assert adapters.parse_listing(rendered) == listing
    assert adapters.parse_residency(rendered) == listing.residency()
    residency = listing.residency()
    assert sorted(residency.gpu + residency.cpu + residency.disk) == sorted(e.id for e in entries)


def test_an_older_servers_answers_still_parse() -> None:
    old = adapters.parse_residency(
        {"data": [{"id": "a", "tier": "gpu"}, {"id": "b", "tier": "cpu"}, {"id": "c"}]}
    )
    assert (old.gpu, old.cpu, old.disk) == (("a",), ("b",), ("c",))
    assert old.capacity == adapters.Capacity() and old.version == 1
    view = {"object": "residency", "gpu": [], "cpu": [], "disk": ["x"], "max_loras": 2}
    assert adapters.parse_residency(view).capacity.max_loras == 2
    assert adapters.Capacity(waiting=1).queue is None  # the queue needs both counts
    assert adapters.Capacity(waiting=1, running=2).queue == 3


@pytest.mark.parametrize(
    "payload",
    [
        [],
        {"data": None},
        {"data": [{"tier": "gpu"}]},
        {"data": ["a"]},
        {"object": "residency", "gpu": ["a"], "cpu": [1], "disk": []},
        {"object": "residency", "gpu": [], "cpu": []},
    ],
    ids=["list", "no-data", "no-id", "entry-not-object", "name-not-text", "tier-missing"],
)
def test_what_is_neither_form_is_refused(payload: object) -> None:
    with pytest.raises(ValueError, match="GET /v1/adapters"):
        adapters.parse_residency(payload)
