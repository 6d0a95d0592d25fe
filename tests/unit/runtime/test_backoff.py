"""The one backoff formula (pure), as each of its callers parameterises it."""

from __future__ import annotations

import pytest
from lora_runtime import backoff


def test_backoff_doubles_and_is_capped() -> None:
    assert [backoff.delay(n, cap=10) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


def test_a_zero_count_waits_as_the_first_retry() -> None:
    assert backoff.delay(0, cap=60) == backoff.delay(1, cap=60) == 1.0


@pytest.mark.parametrize(
    ("first", "cap", "delays"),
    [
        (0.5, 8.0, [0.5, 1, 2, 4, 8, 8]),  # downloads (downloads.RetryPolicy's defaults)
        (1.0, 10.0, [1, 2, 4, 8, 10, 10]),  # the peering watch, the router's API watches
        (1.0, 60.0, [1, 2, 4, 8, 16, 32]),  # pod loads and staging (OperatorConfig.max_backoff_s)
    ],
    ids=["downloads", "peering", "pods-and-staging"],
)
def test_each_caller_starts_at_first_and_stops_at_cap(
    first: float, cap: float, delays: list[float]
) -> None:
    assert [backoff.delay(n, cap=cap, first=first) for n in range(1, 7)] == delays
