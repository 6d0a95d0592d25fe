"""Which pods an adapter is for: selectors, targets and pod labels, pure and exhaustive."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lora_volume import targeting
from lora_volume.targeting import Target, parse_selector

POD = {"lora.dev/inference": "true", "tier": "gpu"}


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    return {"matchExpressions": [{"key": key, "operator": operator, "values": list(values)}]}


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        pytest.param({}, True, id="empty-matches-all"),
        pytest.param({"matchLabels": {"tier": "gpu"}}, True, id="labels"),
        pytest.param({"matchLabels": {"tier": "cpu"}}, False, id="labels-other-value"),
        pytest.param({"matchLabels": {"zone": "a"}}, False, id="labels-missing-key"),
        pytest.param(expr("tier", "In", "gpu", "x"), True, id="in"),
        pytest.param(expr("tier", "In", "cpu"), False, id="in-other-value"),
        pytest.param(expr("zone", "In", "a"), False, id="in-missing-key"),
        pytest.param(expr("tier", "NotIn", "gpu"), False, id="notin"),
        pytest.param(expr("tier", "NotIn", "cpu"), True, id="notin-other-value"),
        pytest.param(expr("zone", "NotIn", "a"), True, id="notin-missing-key"),
        pytest.param(expr("tier", "Exists"), True, id="exists"),
        pytest.param(expr("zone", "Exists"), False, id="exists-missing"),
        pytest.param(expr("tier", "DoesNotExist"), False, id="doesnotexist"),
        pytest.param(expr("zone", "DoesNotExist"), True, id="doesnotexist-missing"),
        pytest.param(
            {"matchLabels": {"tier": "gpu"}, **expr("zone", "Exists")}, False, id="all-must-hold"
        ),
        pytest.param(
            {
                "matchLabels": {"tier": "gpu"},
                "matchExpressions": [
                    {"key": "lora.dev/inference", "operator": "Exists"},
                    {"key": "zone", "operator": "DoesNotExist"},
                ],
            },
            True,
            id="labels-and-expressions",
        ),
    ],
)
def test_label_selectors(selector: dict[str, Any], matches: bool) -> None:
    assert parse_selector(selector).matches(POD) is matches


def test_an_unknown_operator_is_refused() -> None:
    with pytest.raises(ValueError, match="Gt"):
        parse_selector(expr("tier", "Gt", "1")).matches(POD)


_keys = st.sampled_from(["tier", "zone", "app.kubernetes.io/name"])
_values = st.sampled_from(["gpu", "cpu", "a", ""])
_selectors = st.builds(
    lambda labels, exprs: {
        "matchLabels": labels,
        "matchExpressions": [{"key": k, "operator": o, "values": v} for k, o, v in exprs],
    },
    st.dictionaries(_keys, _values, max_size=2),
    st.lists(
        st.tuples(
            _keys,
            st.sampled_from(["In", "NotIn", "Exists", "DoesNotExist"]),
            st.lists(_values, max_size=2),
        ),
        max_size=3,
    ),
)


@given(_selectors, st.text(max_size=20), st.dictionaries(_keys, _values))
def test_a_published_target_reads_back_the_same(
    selector: dict[str, Any], base: str, labels: dict[str, str]
) -> None:
    target = Target(base_model=base, selector=parse_selector(selector))
    read = targeting.parse_target(target.to_json())
    assert read == target
    assert read.selector.matches(labels) == parse_selector(selector).matches(labels)


@pytest.mark.parametrize(
    "text", ["[]", "{not json", '{"selector": {"matchExpressions": [{"operator": "In"}]}}']
)
def test_a_damaged_target_is_a_value_error(text: str) -> None:
    with pytest.raises(ValueError, match="not an adapter target"):
        targeting.parse_target(text)


def test_downward_api_labels() -> None:
    text = 'app.kubernetes.io/component="inference"\nlora.dev/inference="true"\ntier=""\n'
    assert targeting.parse_pod_labels(text) == {
        "app.kubernetes.io/component": "inference",
        "lora.dev/inference": "true",
        "tier": "",
    }
    assert targeting.parse_pod_labels("") == {}


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        pytest.param(Target("sd"), None, id="any-pod"),
        pytest.param(Target(""), None, id="no-base-model"),
        pytest.param(Target("sd", parse_selector({"matchLabels": {"tier": "gpu"}})), None),
        pytest.param(Target("flux"), "base model 'flux'", id="other-base"),
        pytest.param(
            Target("sd", parse_selector({"matchLabels": {"tier": "cpu"}})),
            'selector {"matchLabels": {"tier": "cpu"}} does not match',
            id="other-pods",
        ),
    ],
)
def test_refusal_says_why(target: Target, reason: str | None) -> None:
    got = targeting.refusal(target, POD, "sd")
    assert got == reason if reason is None else reason in (got or "")
