"""Sizes with units (`parse_size`, pure): what the operator, the router and the chart accept."""

from __future__ import annotations

import argparse

import pytest
from lora_runtime import sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2147483648", 2 * 1024**3),
        ("0", 0),
        ("2GiB", 2 * 1024**3),
        ("2gib", 2 * 1024**3),
        ("2Gi", 2 * 1024**3),
        ("500MB", 500 * 1000**2),
        ("500M", 500 * 1000**2),
        ("500 MiB", 500 * 1024**2),
        ("1.5GiB", 3 * 1024**3 // 2),
        ("10kB", 10_000),
        ("10KiB", 10_240),
        ("7B", 7),
        ("1TiB", 1024**4),
        ("0.5B", 0),
        (" 3 Ki ", 3072),
        ("18446744073709551617", 2**64 + 1),
    ],
    ids=lambda v: repr(v) if isinstance(v, str) else str(v),
)
def test_parse_size(text: str, expected: int) -> None:
    assert sizes.parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "2 GB B", "2PiB", "-1GiB", "2,5GiB", "1e9", "two", "2Gib/s", "0x10"]
)
def test_parse_size_refuses_with_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid size .*e\.g\. 2147483648, 2GiB, 2Gi or 500MB"):
        sizes.parse_size(text)


def test_a_bad_size_on_a_command_line_is_a_usage_error() -> None:
    assert sizes.argument("1MiB") == 1024**2
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        sizes.argument("1 furlong")
