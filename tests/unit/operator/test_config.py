"""The operator's command line: sizes with units (`lora_runtime.sizes`) and how the parser
reports a bad one."""

from __future__ import annotations

import pytest
from lora_operator.edges import config


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


def test_insecure_registries_reach_the_rules() -> None:
    assert config.parse_args([]).source_rules.insecure_registries == ()
    parsed = config.parse_args(["--insecure-registry", "r.local:5000", "--insecure-registry= "])
    assert parsed.source_rules.insecure_registries == ("r.local:5000",)
