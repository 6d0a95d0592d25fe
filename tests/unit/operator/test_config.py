"""The operator's command line: sizes with units (`parse_size`, pure) and how the parser reports
a bad one."""

from __future__ import annotations

import pytest
from lora_operator import config


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
    assert config.parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "2 GB B", "2PiB", "-1GiB", "2,5GiB", "1e9", "two", "2Gib/s", "0x10"]
)
def test_parse_size_refuses_with_what_is_accepted(text: str) -> None:
    with pytest.raises(ValueError, match=r"invalid size .*e\.g\. 2147483648, 2GiB, 2Gi or 500MB"):
        config.parse_size(text)


def test_max_adapter_bytes_takes_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert config.parse_args(["--max-adapter-bytes", "2GiB"]).max_adapter_bytes == 2 * 1024**3
    assert config.parse_args(["--max-adapter-bytes=500MB"]).max_adapter_bytes == 500_000_000
    assert config.parse_args([]).max_adapter_bytes == 2 * 1024**3
    with pytest.raises(SystemExit):
        config.parse_args(["--max-adapter-bytes", "2 gigs"])
    err = capsys.readouterr().err
    assert "argument --max-adapter-bytes: invalid size '2 gigs'" in err
    with pytest.raises(SystemExit):
        config.parse_args(["--max-adapter-bytes", "0"])
    assert "--max-adapter-bytes must be at least 1" in capsys.readouterr().err


def test_the_namespace_quota_is_set_unless_a_value_lifts_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert config.parse_args([]).namespace_quota == 20 * 1024**3
    assert config.OperatorConfig().namespace_quota == 20 * 1024**3
    assert config.parse_args(["--namespace-quota", "5Gi"]).namespace_quota == 5 * 1024**3
    assert config.parse_args(["--namespace-quota=500MB"]).namespace_quota == 500_000_000
    for unlimited in ("none", "None", "0", "0GiB"):
        assert config.parse_args(["--namespace-quota", unlimited]).namespace_quota is None
    with pytest.raises(SystemExit):
        config.parse_args(["--namespace-quota", "lots"])
    assert "argument --namespace-quota: invalid size 'lots'" in capsys.readouterr().err
