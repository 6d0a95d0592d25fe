"""What a LoRAAdapter may use to fetch: Secrets by consent, hosts, addresses, ambient identity
(consent, pure), and the operator's settings for them."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_operator import config, consent, sources


@pytest.mark.parametrize(
    ("labels", "annotations", "ok"),
    [
        ({}, {}, False),
        ({"app": "db"}, {"note": "x"}, False),
        ({consent.CONSENT_KEY: "false"}, {}, False),
        ({consent.CONSENT_KEY: "true"}, {}, True),
        ({}, {consent.CONSENT_KEY: "True"}, True),
    ],
    ids=["none", "other-keys", "false", "label", "annotation"],
)
def test_a_secret_lends_its_values_only_when_it_says_so(
    labels: dict[str, str], annotations: dict[str, str], ok: bool
) -> None:
    assert consent.secret_consents(labels, annotations) is ok
    if ok:
        consent.check_secret("creds", labels, annotations)
    else:
        with pytest.raises(consent.CredentialsRefused) as e:
            consent.check_secret("creds", labels, annotations)
        assert e.value.permanent and e.value.reason == "SecretNotConsented"
        assert consent.CONSENT_KEY in e.value.message and "'creds'" in e.value.message


@pytest.mark.parametrize(
    ("host", "allowed", "ok"),
    [
        ("anything.example", (), True),
        ("huggingface.co", ("huggingface.co",), True),
        ("HuggingFace.co.", ("huggingface.co",), True),
        ("cdn.example.com", ("*.example.com",), True),
        ("example.com", ("*.example.com",), False),
        ("evil-example.com", ("*.example.com",), False),
        ("example.com.evil", ("example.com",), False),
    ],
    ids=["empty-allows-all", "exact", "case-and-dot", "subdomain", "apex", "suffix", "longer"],
)
def test_the_host_allowlist(host: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert consent.host_allowed(host, allowed) is ok


def test_the_host_a_source_connects_to() -> None:
    creds = sources.Credentials()
    https = sources.parse_source("https://Files.Example.com/a.safetensors")
    hf = sources.parse_source("hf://org/repo")
    s3 = sources.parse_source("s3://bucket/a.safetensors")
    endpoint = consent.source_endpoint
    assert endpoint(https, creds, None) == ("files.example.com", 443)
    assert endpoint(sources.parse_source("https://h:8443/a"), creds, None) == ("h", 8443)
    assert endpoint(hf, creds, None) == ("huggingface.co", 443)
    assert endpoint(hf, creds, "https://mirror.internal:8443") == ("mirror.internal", 8443)
    assert endpoint(s3, creds, None) == ("s3.amazonaws.com", 443)
    minio = sources.Credentials(aws_endpoint_url="http://minio.store")
    assert endpoint(s3, minio, None) == ("minio.store", 80)
    assert endpoint(sources.parse_source("/v/ns/a"), creds, None) is None
    with pytest.raises(consent.HostRefused, match="not one the operator may fetch from"):
        consent.check_host("files.example.com", consent.Rules(hosts=("huggingface.co",)), "x")


@pytest.mark.parametrize(
    ("addresses", "words"),
    [
        (["93.184.216.34"], None),
        (["127.0.0.1"], None),
        (["169.254.169.254"], "link-local"),
        (["10.0.0.5", "169.254.1.1"], "link-local"),
        (["fe80::1%eth0"], "link-local"),
        (["fd00:ec2::254"], "link-local"),
        (["10.0.0.1"], "API server"),
        (["10.244.0.1"], "API server"),
        (["10.244.0.2"], None),
    ],
    ids=[
        "public",
        "loopback",
        "metadata",
        "any-of-several",
        "v6-link-local",
        "aws-v6",
        "api-service",
        "api-endpoint",
        "same-host-other-port",
    ],
)
def test_metadata_and_api_server_addresses_are_refused(
    addresses: list[str], words: str | None
) -> None:
    # The Service address on any port; the node's address only on the API server's port.
    port = 6443 if addresses == ["10.244.0.2"] else 443
    reason = consent.address_refusal(
        "h", port, addresses, {"10.0.0.1"}, {("10.244.0.1", 443), ("10.244.0.2", 443)}
    )
    assert reason is None if words is None else (reason is not None and words in reason)


def test_ambient_identity_per_namespace(tmp_path: Path) -> None:
    assert consent.Rules().ambient_for("any")
    assert not consent.Rules(ambient=()).ambient_for("any")
    assert consent.Rules(ambient=("ml",)).ambient_for("ml")
    assert not consent.Rules(ambient=("ml",)).ambient_for("other")
    c = config.parse_args(["--source-host", "huggingface.co", "--source-host", "*.s3.aws"])
    assert c.source_rules == consent.Rules(hosts=("huggingface.co", "*.s3.aws"), ambient=("*",))
    assert config.parse_args(["--no-ambient-credentials"]).source_rules.ambient == ()
    c = config.parse_args(["--ambient-credentials-namespace", "ml"])
    assert c.source_rules.ambient == ("ml",)
