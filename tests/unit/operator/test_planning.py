"""Pure decisions of the reconciler: reading /v1/models, and the calls that fix a pod."""

from __future__ import annotations

from pathlib import PurePosixPath

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_operator.rules import planning
from lora_operator.rules.planning import Card, Conflict, Load, PodReport, Unload, Want
from lora_podapi import models

SHA1, SHA2 = "1" * 64, "2" * 64


def card(
    name: str, sha: str | None, scale: float | None = 1.0, pinned: bool | None = False
) -> Card:
    return Card(name=name, revision=sha, scale=scale, pinned=pinned)


def report(*cards: Card) -> PodReport:
    return PodReport(base_model="base", cards={c.name: c for c in cards})


def want(name: str, sha: str = SHA1, scale: float = 1.0, pinned: bool = False) -> Want:
    return Want(name=name, sha256=sha, scale=scale, pinned=pinned)


def adapter_card(
    served: str, adapter: str, sha: str, shape: str, **extra: object
) -> dict[str, object]:
    """A `/v1/models` adapter card for the revision `sha` of `adapter`, served as `served`, as
    the server renders it now (`lora_podapi.models`, version 2: `adapter` and `revision`), as
    servers of version 1 did (`revision`, `root` the adapter's name) or as older ones (and vLLM)
    did: `root` the revision directory's path on the pod."""
    if shape == "card":
        card = models.Card(served, adapter, "base", adapter=adapter, revision=sha)
        return {**models.render_card(card), **extra}
    if shape == "v1-card":
        fields: dict[str, object] = {"root": adapter, "revision": sha}
    else:
        fields = {"root": f"/var/lib/lora/adapters/ns/{adapter}/revisions/{sha}"}
    return {"id": served, "object": "model", "parent": "base", **fields, **extra}


SHAPES = pytest.mark.parametrize("shape", ["card", "v1-card", "old-card"])


@SHAPES
def test_parse_models_tells_managed_from_static_adapters(shape: str) -> None:
    payload = {
        "data": [
            {"id": "base", "root": "base", "parent": None},
            adapter_card("ours", "ours", SHA1, shape, scale=-0.5, pinned=True),
            # What the server shows for an adapter that is no published revision.
            {"id": "static", "root": "static", "revision": None, "parent": "base"},
            {"id": "old-static", "root": "/opt/loras/static", "parent": "base"},
            # Someone else's revision under another name is not ours to manage.
            adapter_card("alias", "ours", SHA1, shape),
        ]
    }
    r = planning.parse_models(payload)
    assert r.base_model == "base"
    assert r.cards["ours"] == Card("ours", SHA1, -0.5, True, adapter="ours")
    assert not any(r.cards[n].managed for n in ("static", "old-static", "alias"))
    assert r.managed() == {"ours": SHA1}


@SHAPES
def test_a_rollouts_alias_is_a_revision_of_its_adapter(shape: str) -> None:
    payload = {
        "data": [
            {"id": "base", "parent": None},
            adapter_card("ours", "ours", SHA1, shape),
            adapter_card(f"ours_{SHA2[:12]}", "ours", SHA2, shape),
            # An alias whose prefix is another revision's is someone else's.
            adapter_card(f"ours_{SHA1[:12]}", "ours", SHA2, shape),
        ]
    }
    r = planning.parse_models(payload)
    assert r.managed() == {"ours": SHA1, f"ours_{SHA2[:12]}": SHA2}
    assert r.revisions() == {("ours", SHA1), ("ours", SHA2)}
    assert r.holds("ours") and not r.holds(f"ours_{SHA2[:12]}")
    # The load call names the alias and the adapter's own revision directory.
    canary = Want(f"ours_{SHA2[:12]}", SHA2, 1.0, False, adapter="ours")
    assert planning.load_path(PurePosixPath("/v/ns"), canary) == f"/v/ns/ours/revisions/{SHA2}"


def test_a_rolling_upgrade_reads_old_and_new_pods_alike() -> None:
    """Pods of the release before (the path in `root`) and after (no path) report the same
    adapters: the operator takes both for its own, at the same revisions."""
    old, v1, new = (
        planning.parse_models({"data": [adapter_card("ours", "ours", SHA1, shape)]})
        for shape in ("old-card", "v1-card", "card")
    )
    assert old.cards == v1.cards == new.cards and new.managed() == {"ours": SHA1}
    # A card with both reads its fields, not the path; a bad revision field falls back to it.
    both = adapter_card("ours", "ours", SHA2, "v1-card")
    assert planning.parse_models({"data": [both]}).managed() == {"ours": SHA2}
    for revision in ("x" * 64, "A" * 64, 7):
        broken = {**adapter_card("ours", "ours", SHA1, "old-card"), "revision": revision}
        assert planning.parse_models({"data": [broken]}).managed() == {"ours": SHA1}
    # Neither a path nor a name makes `root` a revision without a valid `revision`.
    for root in (None, 3, "ours", f"/x/ours/revisions/{SHA1[:63]}"):
        card = {"id": "ours", "parent": "base", "root": root}
        assert planning.parse_models({"data": [card]}).managed() == {}


def test_parse_models_accepts_vllm_cards_without_our_fields() -> None:
    r = planning.parse_models(
        {
            "data": [
                {"id": "b", "parent": None},
                {"id": "x", "root": f"/a/x/revisions/{SHA2}", "parent": "b"},
            ]
        }
    )
    assert r.cards["x"] == Card("x", SHA2, None, None, adapter="x")
    assert planning.satisfied(want("x", SHA2, scale=3.0, pinned=True), r.cards["x"])


@pytest.mark.parametrize("payload", [None, [], {"data": 1}, {"data": [{"root": "/x"}]}])
def test_parse_models_refuses_what_is_not_a_models_list(payload: object) -> None:
    with pytest.raises(ValueError):
        planning.parse_models(payload)


def test_missing_adapters_are_loaded_and_present_ones_left_alone() -> None:
    actions = planning.plan_pod({"a": want("a"), "b": want("b")}, report(card("a", SHA1)))
    assert actions == [Load(want("b"), inplace=False)]


def test_a_new_revision_scale_or_pin_is_swapped_in_place() -> None:
    r = report(card("a", SHA1), card("b", SHA1), card("c", SHA1))
    wants = {"a": want("a", SHA2), "b": want("b", scale=0.5), "c": want("c", pinned=True)}
    assert planning.plan_pod(wants, r) == [
        Load(wants["a"], inplace=True),
        Load(wants["b"], inplace=True),
        Load(wants["c"], inplace=True),
    ]


def test_unwanted_managed_adapters_are_unloaded_first_and_static_ones_never() -> None:
    r = report(card("old", SHA1), card("static", None))
    assert planning.plan_pod({"new": want("new")}, r) == [
        Unload("old"),
        Load(want("new"), inplace=False),
    ]


def test_adapters_kept_as_they_are_are_neither_loaded_nor_unloaded() -> None:
    # Being staged, or deleted but not unpublished yet: what the pod holds of them stays.
    r = report(card("restaging", SHA1), card("deleting", SHA1), card("gone", SHA1))
    assert planning.plan_pod({}, r, keep={"restaging", "deleting"}) == [Unload("gone")]


def test_a_plan_among_some_adapters_leaves_the_others_cards_alone() -> None:
    # A pass woken for one adapter plans it (and its canary alias), not the pod's others.
    r = report(
        Card("a", SHA1, 1.0, False, adapter="a"),
        Card("a_222222", SHA2, 1.0, False, adapter="a"),  # a's canary alias, no longer wanted
        Card("b", SHA1, 1.0, False, adapter="b"),  # not wanted either, but not among
    )
    assert planning.plan_pod({"a": want("a", SHA2)}, r, among={"a"}) == [
        Unload("a_222222"),
        Load(want("a", SHA2), inplace=True),
    ]
    assert planning.plan_pod({"a": want("a", SHA2)}, r) == [
        Unload("a_222222"),
        Unload("b"),
        Load(want("a", SHA2), inplace=True),
    ]


def test_the_adapters_whose_cards_changed_between_two_reports() -> None:
    before = report(
        Card("a", SHA1, 1.0, False, adapter="a"),
        Card("b", SHA1, 1.0, False, adapter="b"),
        Card("c_111111", SHA1, 1.0, False, adapter="c"),
        card("static", None),
    )
    after = report(
        Card("a", SHA1, 1.0, False, adapter="a"),  # the same
        Card("b", SHA2, 1.0, False, adapter="b"),  # another revision
        card("static", None, scale=0.5),  # not the operator's: by its served name
        Card("d", SHA1, 1.0, False, adapter="d"),  # new
    )  # c's alias is gone
    assert planning.changed_adapters(before, after) == {"b", "c", "d", "static"}
    assert planning.changed_adapters(after, after) == set()


def test_a_static_adapter_with_the_wanted_name_is_a_conflict_not_a_replacement() -> None:
    assert planning.plan_pod({"s": want("s")}, report(card("s", None))) == [Conflict(want("s"))]


def test_load_path_is_the_revision_directory_as_the_pod_sees_it() -> None:
    root = PurePosixPath("/var/lib/lora/adapters/team-a")
    assert (
        planning.load_path(root, want("a", SHA1))
        == f"/var/lib/lora/adapters/team-a/a/revisions/{SHA1}"
    )


# -- a report kept card by card ----------------------------------------------------------------

# A call's answer for a served name: the operator's card of an adapter (under its own name or
# a canary alias, pinned or not), a card not the operator's, or an unload (None).
_ANSWER = st.one_of(
    st.none(),
    st.builds(
        lambda adapter, alias, rev, pinned: Card(
            f"{adapter}_{rev}" if alias else adapter, rev, 1.0, pinned, adapter=adapter
        ),
        st.sampled_from(["a", "b", "c"]),
        st.booleans(),
        st.sampled_from(["1" * 12, "2" * 12]),
        st.booleans(),
    ),
    st.builds(
        lambda name, pinned: Card(name, None, None, pinned),
        st.sampled_from(["a", "static", "b_111111111111"]),
        st.booleans(),
    ),
)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c", "static"]), _ANSWER), max_size=30))
def test_a_report_after_answered_calls_tells_what_one_read_of_its_cards_would(
    calls: list[tuple[str, Card | None]],
) -> None:
    """`answered` updates what a report derives from its cards card by card; the result is what
    a report read with the same cards derives."""
    kept = report()
    for name, answer in calls:
        served = answer.name if answer is not None else name
        kept = kept.answered(served, answer)
    read = PodReport(kept.base_model, dict(kept.cards))
    assert kept.managed() == read.managed()
    assert kept.foreign() == read.foreign()
    assert set(kept.aliases()) == set(read.aliases())
    for adapter in ("a", "b", "c", "static"):
        assert kept.holds(adapter) == read.holds(adapter)
    # Planning some adapters unloads what planning every one would, of those adapters.
    for among in ({"a"}, {"b", "c"}):
        full = [a for a in planning.plan_pod({}, read) if read.cards[a.name].adapter in among]
        assert planning.plan_pod({}, kept, among=among) == full
