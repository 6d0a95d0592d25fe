"""Pure parts of the fetchers: what an HTTP status means, how long to back off."""

from __future__ import annotations

import pytest
from lora_operator.store import downloads, fetchers, sources


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
    assert downloads.classify_status(status) == verdict


def test_backoff_is_bounded() -> None:
    policy = downloads.RetryPolicy(backoff_s=1, max_backoff_s=5)
    assert [policy.delay(i) for i in range(5)] == [1, 2, 4, 5, 5]


def test_hf_url_carries_the_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    source = sources.HfSource("org/repo", "w.safetensors", "v1.0")
    monkeypatch.delenv("HF_ENDPOINT", raising=False)
    url = sources.hf_file_url(fetchers.hf_endpoint_url(None), source, "w.safetensors")
    assert url == "https://huggingface.co/org/repo/resolve/v1.0/w.safetensors"
    monkeypatch.setenv("HF_ENDPOINT", "https://mirror.internal")
    assert fetchers.hf_endpoint_url(None) == "https://mirror.internal"
    assert fetchers.hf_endpoint_url("https://set.by.flag") == "https://set.by.flag"


def test_https_reads_grow_while_fast_and_shrink_while_slow() -> None:
    size = downloads.MIN_READ_BYTES
    sizes = []
    for _ in range(12):  # a fast link: up to the largest read, and no further
        size = downloads.next_read_size(size, 0.001)
        sizes.append(size)
    assert sizes[0] == 2 * downloads.MIN_READ_BYTES and sizes[-1] == downloads.CHUNK_BYTES
    assert sizes == sorted(sizes)
    assert downloads.next_read_size(size, 0.2) == size  # neither fast nor slow: kept
    for _ in range(12):  # a slow link: back down to the smallest, and no further
        size = downloads.next_read_size(size, 2.0)
    assert size == downloads.MIN_READ_BYTES


def test_the_download_policy_counts_attempts_from_zero() -> None:
    """downloads.RetryPolicy waits as `lora_runtime.backoff` says, from its first attempt."""
    policy = downloads.RetryPolicy()
    assert [policy.delay(i) for i in range(6)] == [0.5, 1, 2, 4, 8, 8]
