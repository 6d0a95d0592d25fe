"""`GET /v1/models` defined once (`lora_podapi.models`): what the server renders parses back to
itself, and every card a pod of a rolling upgrade may send still parses (version 1 without
`adapter`, the first servers' and vLLM's with the revision's path in `root`)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_podapi import models

SHA = "ab" * 32
NAMES = st.from_regex(r"[a-z][a-z0-9-]{0,11}", fullmatch=True)
SHAS = st.from_regex(r"[0-9a-f]{64}", fullmatch=True)


@st.composite
def adapter_cards(draw: st.DrawFn, base: str) -> models.Card:
    name = draw(NAMES)
    published = draw(st.booleans())
    adapter = draw(NAMES) if published else None
    return models.Card(
        id=name,
        root=adapter or name,
        parent=base,
        created=draw(st.integers(0, 2**40)),
        adapter=adapter,
        revision=draw(SHAS) if published else None,
        scale=draw(st.floats(-10, 10, allow_nan=False)),
        pinned=draw(st.booleans()),
        sha256=draw(SHAS),
        hits=draw(st.integers(0, 10**9)),
        format=draw(st.sampled_from(["lora", "loha", "lokr", "merged"])),
        rank=draw(st.integers(1, 256)),
        trigger_words=tuple(draw(st.lists(st.text(max_size=8), max_size=3))),
    )


@st.composite
def model_lists(draw: st.DrawFn) -> models.ModelList:
    base = draw(NAMES)
    simulated = draw(st.none() | st.just("h100-sdxl"))
    cards = [models.Card(id=base, root=base, created=7, simulated=simulated)]
    cards += draw(st.lists(adapter_cards(base), max_size=4))
    capacity = st.none() | st.integers(0, 64)
    return models.ModelList(tuple(cards), draw(capacity), draw(capacity))


@given(model_lists())
def test_what_the_server_renders_parses_back_to_itself(listed: models.ModelList) -> None:
    assert models.parse(models.render(listed)) == listed


def test_a_published_revisions_card_names_its_adapter_and_revision_and_no_path() -> None:
    card = models.Card(
        id="pixel_abababababab", root="pixel", parent="b", adapter="pixel", revision=SHA
    )
    rendered = models.render_card(card)
    assert rendered["adapter"] == "pixel" and rendered["revision"] == SHA
    assert {"id", "object", "root", "parent"} <= rendered.keys()  # vLLM's card, ours beyond it
    base = models.render_card(models.Card(id="b", root="b"))
    assert base == {"id": "b", "object": "model", "created": 0, "owned_by": "lora-operator"} | {
        "root": "b",
        "parent": None,
    }
    assert models.render(models.ModelList((card,)))["api_version"] == models.VERSION == 2


def published(served: str, **fields: Any) -> tuple[str | None, str | None]:
    card = models.parse_card({"id": served, "parent": "b", **fields})
    return card.adapter, card.revision


PATH = f"/var/lib/lora/adapters/ns/pixel/revisions/{SHA}"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"root": "pixel", "adapter": "pixel", "revision": SHA}, ("pixel", SHA)),  # version 2
        ({"root": "pixel", "revision": SHA}, ("pixel", SHA)),  # version 1: no `adapter`
        ({"root": PATH}, ("pixel", SHA)),  # the first servers', and vLLM's: the path
        ({"root": PATH, "revision": "x" * 64}, ("pixel", SHA)),  # a bad revision: the path
        ({"root": PATH, "revision": 7}, ("pixel", SHA)),
        ({"root": "pixel", "revision": None}, (None, None)),  # not published
        ({"root": "/opt/loras/static"}, (None, None)),  # a path that is no revision
        ({"root": "pixel"}, (None, None)),  # a name alone says no revision
        ({"root": f"/x/pixel/revisions/{SHA[:63]}"}, (None, None)),
        ({"root": 3}, (None, None)),
        ({}, (None, None)),
    ],
    ids=[
        "v2",
        "v1",
        "path",
        "bad-revision-path",
        "revision-not-text",
        "unpublished",
        "static-path",
        "name-only",
        "short-sha",
        "root-not-text",
        "bare",
    ],
)
def test_every_version_of_a_card_says_which_revision_it_is(
    fields: dict[str, Any], expected: tuple[str | None, str | None]
) -> None:
    assert published("pixel", **fields) == expected


def test_a_version_1_list_and_vllms_parse() -> None:
    """The list before `api_version`, and vLLM's (no capacity, no fields of ours)."""
    old = models.parse(
        {
            "object": "list",
            "data": [
                {"id": "b", "root": "b", "parent": None},
                {"id": "x", "root": PATH, "parent": "b", "scale": 0.5, "pinned": True},
            ],
            "max_loras": 4,
        }
    )
    assert old.version == 1 and old.base == "b" and old.max_loras == 4
    assert old.max_cpu_loras is None
    (x,) = old.cards[1:]
    assert (x.adapter, x.revision, x.scale, x.pinned, x.hits) == ("pixel", SHA, 0.5, True, None)
    vllm = models.parse({"data": [{"id": "m", "owned_by": "vllm", "parent": None}]})
    assert vllm.cards == (models.Card(id="m", root="m", owned_by="vllm"),)
    newer = models.parse({"data": [], "api_version": 3, "something": "new"})
    assert newer.version == 3 and newer.cards == ()


@pytest.mark.parametrize(
    "payload",
    [None, [], {"data": 1}, {"data": [{"root": "/x"}]}, {"data": ["a"]}],
    ids=["none", "list", "data-not-list", "card-without-id", "card-not-object"],
)
def test_what_is_not_a_model_list_is_refused(payload: object) -> None:
    with pytest.raises(ValueError, match="GET /v1/models"):
        models.parse(payload)


def test_fields_of_the_wrong_type_read_as_absent() -> None:
    card = models.parse_card(
        {"id": "x", "parent": "b", "scale": True, "pinned": 1, "hits": -1, "rank": "4"}
    )
    assert (card.scale, card.pinned, card.hits, card.rank) == (None, None, None, None)
