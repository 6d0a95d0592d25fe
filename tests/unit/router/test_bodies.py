"""The adapter a generation body names, as the router reads it (bodies, pure)."""

from __future__ import annotations

import json

import pytest
from lora_router import bodies


@pytest.mark.parametrize(
    ("body", "adapter"),
    [
        ({"model": "pixel-art", "prompt": "p"}, "pixel-art"),
        ({"model": "base", "lora": {"name": "ink"}}, "ink"),
        ({"model": "base", "lora": [{"name": "first"}, {"name": "second"}]}, "first"),
        ({"prompt": "no model"}, None),
        (["not", "an", "object"], None),
    ],
    ids=["model", "lora", "stack", "none", "not-an-object"],
)
def test_the_adapter_a_body_names(body: object, adapter: str | None) -> None:
    assert bodies.adapter_of(json.dumps(body).encode()) == adapter


@pytest.mark.parametrize(
    "body",
    [b"{not json", b"\xff\xfe", b"[" * 200_000 + b"]" * 200_000, b'{"n": ' + b"9" * 5000 + b"}"],
    ids=["syntax", "not-utf8", "nesting-bomb", "long-number"],
)
def test_a_body_the_server_will_refuse_names_no_adapter(body: bytes) -> None:
    """Routed by load alone (any pod answers the 400): never an exception in the router."""
    assert bodies.adapter_of(body) is None


def test_a_canary_body_names_the_alias_wherever_it_named_the_adapter() -> None:
    body = {"model": "a", "lora": [{"name": "a"}, {"name": "b"}]}
    out = json.loads(bodies.with_adapter(json.dumps(body).encode(), "a", "a_1234"))
    assert out == {"model": "a_1234", "lora": [{"name": "a_1234"}, {"name": "b"}]}
