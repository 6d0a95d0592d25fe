"""Pure parts of the fetchers: what an HTTP status means, how long to back off."""

from __future__ import annotations

import pytest
from lora_operator import fetchers


@pytest.mark.parametrize(
    ("status", "verdict"),
    [
        (200, "ok"),
        (206, "ok"),
        (404, "not_found"),
        (410, "not_found"),
        (401, "forbidden"),
        (403, "forbidden"),
        (429, "retry"),
        (408, "retry"),
        (500, "retry"),
        (503, "retry"),
        (400, "rejected"),
        (416, "rejected"),
    ],
)
def test_classify_status(status: int, verdict: str) -> None:
    assert fetchers.classify_status(status) == verdict


def test_backoff_is_bounded() -> None:
    policy = fetchers.RetryPolicy(backoff_s=1, max_backoff_s=5)
    assert [policy.delay(i) for i in range(5)] == [1, 2, 4, 5, 5]


def test_hf_url_carries_the_revision() -> None:
    import huggingface_hub

    url = huggingface_hub.hf_hub_url("org/repo", "w.safetensors", revision="v1.0")
    assert url.endswith("/org/repo/resolve/v1.0/w.safetensors")
