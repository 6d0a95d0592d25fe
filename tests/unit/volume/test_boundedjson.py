"""The bounded JSON parser: the values json.loads builds, each bound refused with its message,
and held to json.loads on generated documents; `parse` (json's C scanner where the bounds are
proven, the module's own reader otherwise) held to `read` (the reader alone) on the same
documents (pure)."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lora_volume import boundedjson, errors

WIDE = boundedjson.Limits(max_bytes=1 << 20, max_depth=64, max_values=100_000)


def parse(text: str | bytes | memoryview, limits: boundedjson.Limits = WIDE) -> Any:
    """`parse`'s value, checked to be the reader's own."""
    value = boundedjson.parse(text, limits, where="the document")
    if not isinstance(text, str):
        text = str(text, "utf-8")
    assert json.dumps(boundedjson.read(text, limits, where="the document")) == json.dumps(value)
    return value


def refusal(text: str | bytes, limits: boundedjson.Limits = WIDE) -> str:
    """`parse`'s refusal, checked to be the reader's own (bytes that are not UTF-8, or more of
    them than `max_bytes`, never reach the reader)."""
    with pytest.raises(errors.InvalidJson) as e:
        boundedjson.parse(text, limits, where="the document")
    assert isinstance(e.value, errors.InvalidAdapter)  # both sides map it as a bad file
    if isinstance(text, str) and len(text.encode()) <= limits.max_bytes:
        with pytest.raises(errors.InvalidJson) as by_reader:
            boundedjson.read(text, limits, where="the document")
        assert by_reader.value.message == e.value.message
    return e.value.message


scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**20), max_value=10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
documents = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=40,
)


def depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    return 0


def values(value: Any) -> int:
    if isinstance(value, list):
        return 1 + sum(map(values, value))
    if isinstance(value, dict):
        return 1 + len(value) + sum(map(values, value.values()))
    return 1


@settings(max_examples=300, deadline=None)
@given(
    documents,
    st.sampled_from(
        [
            {},
            {"separators": (",", ":")},
            {"indent": 2},
            {"ensure_ascii": False},
            {"indent": "\t", "ensure_ascii": False},
        ]
    ),
)
def test_it_builds_what_json_loads_builds(document: Any, style: dict[str, Any]) -> None:
    text = json.dumps(document, **style)
    expected = json.loads(text)
    assert parse(text) == expected
    assert parse(text.encode()) == expected
    # Each bound is exact: the document's own depth and count pass, one less is refused.
    exact = boundedjson.Limits(
        max_bytes=len(text.encode()),
        max_depth=depth(expected),
        max_values=values(expected),
        max_number_chars=max(32, len(text)),
    )
    assert parse(text.encode(), exact) == expected
    if depth(expected) > 0:
        tight = boundedjson.Limits(exact.max_bytes, depth(expected) - 1, exact.max_values)
        assert "nests deeper" in refusal(text, tight)
    tight = boundedjson.Limits(exact.max_bytes, exact.max_depth, values(expected) - 1, 10**6)
    assert "holds more than" in refusal(text, tight)


# Texts from JSON's own characters, mostly not JSON: whatever the parser accepts, json.loads
# accepts and reads the same; whatever json.loads accepts (but NaN and the infinities), so does
# the parser.
_PIECES = ['"', "\\", "[", "]", "{", "}", ",", ":", " ", "0", "1", "-", ".", "e", "+", "a"]
_PIECES += ["true", "false", "null", "NaN", "\\u00e9", "\\ud800", '"k"', "é", "\n"]


@settings(max_examples=2000, deadline=None)
@given(st.lists(st.sampled_from(_PIECES), max_size=24).map("".join))
def test_it_accepts_exactly_what_json_loads_accepts(text: str) -> None:
    try:
        expected = json.loads(text)
    except ValueError:
        refusal(text)
        return
    try:
        got = parse(text)
    except errors.InvalidJson as e:
        assert "NaN" in text or "\\ud800" in text, e.message
        assert refusal(text) == e.message
        return
    assert json.dumps(got) == json.dumps(expected)


def test_the_last_of_two_equal_keys_wins_as_in_json_loads() -> None:
    assert parse('{"a": 1, "a": 2}') == {"a": 2} == json.loads('{"a": 1, "a": 2}')


def test_keys_of_every_entry_are_one_string() -> None:
    """As json.loads does: a header's "dtype" repeated in every entry is held once."""
    first, second = parse('[{"dtype": 1}, {"dtype": 2}]')
    assert next(iter(first)) is next(iter(second))


def test_numbers_read_as_json_loads_reads_them() -> None:
    text = "[0, -0, 1.5, -2e3, 1E400, 12345678901234567890, 0.1]"
    got = parse(text)
    assert got == json.loads(text)
    assert [type(v) for v in got] == [type(v) for v in json.loads(text)]
    assert math.isinf(got[4])


@pytest.mark.parametrize(
    ("text", "limits", "message"),
    [
        pytest.param(
            "[" * 100 + "]" * 100,
            WIDE,
            "the document nests deeper than 64 levels",
            id="nesting",
        ),
        pytest.param(
            "[" + "[]," * 100_000 + "[]]",
            WIDE,
            "the document holds more than 100000 values, more than any adapter needs",
            id="values",
        ),
        pytest.param(
            "[" + "1" * 5000 + "]",
            WIDE,
            "the document has a number 5000 characters long at character 1, over the limit of 32",
            id="number",
        ),
        pytest.param(
            "[" + "1" * 5000 + "]",
            boundedjson.Limits(max_bytes=100, max_depth=4, max_values=10),
            "the document is 5002 bytes long, over the limit of 100",
            id="bytes",
        ),
        pytest.param('{"a": NaN}', WIDE, "expected a value at character 6, found 'N'", id="nan"),
        pytest.param("[1, 2", WIDE, "expected ',' or ']' at character 5, found the end", id="open"),
        pytest.param('{"a" 1}', WIDE, "expected ':' at character 5, found '1'", id="colon"),
        pytest.param("{1: 2}", WIDE, "expected a string key at character 1", id="key"),
        pytest.param("[] []", WIDE, "expected the end at character 3", id="trailing"),
        pytest.param('"abc', WIDE, "Unterminated string starting at character 0", id="string"),
        pytest.param('"a\nb"', WIDE, "Invalid control character at character 2", id="control"),
        pytest.param(
            '["\\ud800"]', WIDE, "an unpaired surrogate escape at character 1", id="surrogate"
        ),
        pytest.param(
            b"[\xff]", WIDE, "is not UTF-8 text (invalid start byte at byte 1)", id="utf8"
        ),
        pytest.param(b"\xff\xfe[\x00]\x00", WIDE, "is not UTF-8", id="utf16"),
    ],
)
def test_each_refusal_says_what_is_wrong(
    text: str | bytes, limits: boundedjson.Limits, message: str
) -> None:
    assert message in refusal(text, limits)


def test_a_bound_is_refused_before_the_document_is_read_to_its_end() -> None:
    """The values bound stops the parse where it is broken: what follows, even if it is not
    JSON at all, is never read."""
    assert "holds more than 10 values" in refusal(
        "[" + "0," * 20 + "this is not JSON", boundedjson.Limits(1000, 4, 10)
    )


def test_a_memoryview_is_read_where_it_lies() -> None:
    blob = b"xxxx" + b'{"a": [1, "\\u00e9"]}'
    assert parse(memoryview(blob)[4:]) == {"a": [1, "é"]}


def test_a_document_within_its_bounds_is_read_by_json_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pod's answer of a thousand adapters: the character count proves the values bound, so
    the module's own reader is never run; one over a bound, or with a surrogate escape, is
    handed to it."""
    cards = [
        {"id": f"a-{i}", "parent": "sd", "scale": 1.0, "hits": i, "pinned": False}
        for i in range(1000)
    ]
    text = json.dumps({"object": "list", "data": cards})
    limits = boundedjson.Limits(max_bytes=1 << 22, max_depth=6, max_values=20_000)
    by_reader: list[str] = []

    def reader(text: str, limits: boundedjson.Limits, *, where: str) -> Any:
        by_reader.append(text)
        return json.loads(text)

    monkeypatch.setattr(boundedjson, "read", reader)
    assert boundedjson.parse(text, limits, where="it") == json.loads(text)
    assert by_reader == []
    for handed in (
        text.replace('"pinned": false', '"pinned": [[[[[[false]]]]]]'),  # deeper than 6
        text.replace('"hits": 7,', '"hits": 1' + "0" * 40 + ","),  # a number of 41 characters
        text.replace('"a-3"', '"\\ud83d\\ude00"'),  # a surrogate pair, spelled in escapes
        json.dumps({"data": cards * 4}),  # more commas and colons than 20,000 values allow
    ):
        boundedjson.parse(handed, limits, where="it")
        assert by_reader[-1] == handed
