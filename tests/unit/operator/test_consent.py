"""What a LoRAAdapter may use to fetch: Secrets by consent, hosts, addresses, ambient identity
(consent, pure), and the operator's settings for them."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from lora_operator.edges import config
from lora_operator.rules import consent


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
        ("anything.example", (), False),
        ("anything.example", ("*",), True),
        ("anything.example", ("huggingface.co", "*"), True),
        ("huggingface.co", ("huggingface.co",), True),
        ("HuggingFace.co.", ("huggingface.co",), True),
        ("cdn.example.com", ("*.example.com",), True),
        ("example.com", ("*.example.com",), False),
        ("evil-example.com", ("*.example.com",), False),
        ("example.com.evil", ("example.com",), False),
    ],
    ids=[
        "empty-allows-none",
        "star-allows-all",
        "star-among-others",
        "exact",
        "case-and-dot",
        "subdomain",
        "apex",
        "suffix",
        "longer",
    ],
)
def test_the_host_allowlist(host: str, allowed: tuple[str, ...], ok: bool) -> None:
    assert consent.host_allowed(host, allowed) is ok


def test_a_host_outside_the_list_is_refused_saying_which_value_opens_it() -> None:
    with pytest.raises(consent.HostRefused, match="not one the operator may fetch from"):
        consent.check_host("files.example.com", consent.Rules(hosts=("huggingface.co",)), "x")
    with pytest.raises(consent.HostRefused, match="fetches from no remote host") as e:
        consent.check_host("files.example.com", consent.Rules(), "x")
    assert "operator.sourceHosts" in e.value.message and "files.example.com" in e.value.message


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
    # With no rules: what is refused whatever the rules open.
    reason = consent.connect_refusal(
        "h", port, addresses, None, {"10.0.0.1"}, {("10.244.0.1", 443), ("10.244.0.2", 443)}
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


# ---- addresses: every range refused by default, in every form that carries an IPv4 address

# One address inside each range refused by default, and what the reason calls it.
REFUSED = [
    ("0.0.0.0", "an unspecified address"),
    ("0.255.255.255", "an unspecified address"),
    ("10.1.2.3", "a private address"),
    ("100.64.0.1", "a carrier-grade NAT address"),
    ("100.127.255.254", "a carrier-grade NAT address"),
    ("127.0.0.1", "a loopback address"),
    ("127.255.255.254", "a loopback address"),
    ("172.16.0.1", "a private address"),
    ("172.31.255.254", "a private address"),
    ("192.0.0.170", "a reserved address"),
    ("192.0.2.1", "a reserved (documentation) address"),
    ("192.88.99.1", "a reserved (6to4 relay) address"),
    ("192.168.1.1", "a private address"),
    ("198.18.0.1", "a reserved (benchmarking) address"),
    ("198.51.100.1", "a reserved (documentation) address"),
    ("203.0.113.1", "a reserved (documentation) address"),
    ("224.0.0.1", "a multicast address"),
    ("239.255.255.250", "a multicast address"),
    ("240.0.0.1", "a reserved or broadcast address"),
    ("255.255.255.255", "a reserved or broadcast address"),
    ("::", "an unspecified address"),
    ("::1", "a loopback address"),
    ("64:ff9b:1::a", "a private (local NAT64) address"),
    ("100::1", "a reserved (discard) address"),
    ("2001:db8::1", "a reserved (documentation) address"),
    ("2001:2::1", "a reserved (IETF protocol) address"),
    ("fc00::1", "a private address"),
    ("fd12:3456::1", "a private address"),
    ("fec0::1", "a private (site-local) address"),
    ("ff02::1", "a multicast address"),
]
# Refused whatever is allowed: the metadata services' link-local addresses.
METADATA = ["169.254.169.254", "169.254.0.1", "fe80::1", "fe80::1%eth0", "fd00:ec2::254"]
PUBLIC = ["93.184.216.34", "8.8.8.8", "1.1.1.1", "2606:4700::1111", "2a00:1450:4001::1"]


@pytest.mark.parametrize(("address", "what"), REFUSED, ids=[a for a, _ in REFUSED])
def test_every_default_range_is_refused_and_named(address: str, what: str) -> None:
    reason = consent.connect_refusal("h.example", 443, [address], consent.Rules())
    assert reason is not None
    assert f"host h.example resolves to {ipaddress.ip_address(address)}, {what}" in reason
    assert "operator.sourceAllowCIDRs" in reason  # the value that opens it


def _forms(v4: str) -> dict[str, str]:
    """Every IPv6 form that carries the IPv4 address `v4`."""
    n = int(ipaddress.IPv4Address(v4))
    hi, lo = n >> 16, n & 0xFFFF
    teredo_client = n ^ 0xFFFFFFFF  # Teredo stores the client's address inverted
    return {
        "mapped": f"::ffff:{v4}",
        "translated": f"::ffff:0:{v4}",
        "compatible": f"::{v4}",
        "nat64": f"64:ff9b::{v4}",
        "6to4": f"2002:{hi:x}:{lo:x}::1",
        "teredo": f"2001:0:4136:e378:8000:63bf:{teredo_client >> 16:x}:{teredo_client & 0xFFFF:x}",
    }


MAPPED = [
    (form, v4, text)
    for v4 in ("169.254.169.254", "127.0.0.1", "10.0.0.1", "192.168.0.1", "100.64.0.1")
    for form, text in _forms(v4).items()
]


@pytest.mark.parametrize(
    ("form", "v4", "address"), MAPPED, ids=[f"{f}-{v4}" for f, v4, _ in MAPPED]
)
def test_ipv6_forms_of_refused_ipv4_addresses_are_refused(form: str, v4: str, address: str) -> None:
    reason = consent.connect_refusal("h", 443, [address], consent.Rules())
    assert reason is not None and f"of {v4}, " in reason, reason
    if v4.startswith("169.254."):
        assert "link-local" in reason and "never allowed" in reason


@pytest.mark.parametrize("form", sorted(_forms("8.8.8.8")))
def test_ipv6_forms_of_public_ipv4_addresses_pass(form: str) -> None:
    address = _forms("8.8.8.8")[form]
    if form == "teredo":  # Teredo lives in 2001::/23, refused on its own
        assert consent.connect_refusal("h", 443, [address], consent.Rules()) is not None
    else:
        assert consent.connect_refusal("h", 443, [address], consent.Rules()) is None


@pytest.mark.parametrize("address", PUBLIC)
def test_public_addresses_pass(address: str) -> None:
    assert consent.connect_refusal("h", 443, [address], consent.Rules()) is None


def _rules(allow: tuple[str, ...] = (), refuse: tuple[str, ...] = ()) -> consent.Rules:
    return consent.Rules(
        hosts=("*",), allow=consent.parse_networks(allow), refuse=consent.parse_networks(refuse)
    )


@pytest.mark.parametrize(
    ("address", "rules", "words"),
    [
        ("10.1.2.3", _rules(allow=("10.0.0.0/8",)), None),
        ("10.1.2.3", _rules(allow=("10.1.2.0/24",)), None),
        ("10.9.9.9", _rules(allow=("10.1.2.0/24",)), "a private address"),
        ("127.0.0.1", _rules(allow=("127.0.0.0/8",)), None),
        ("::ffff:127.0.0.1", _rules(allow=("127.0.0.0/8",)), None),
        ("10.244.1.5", _rules(allow=("10.0.0.0/8",), refuse=("10.244.0.0/16",)), "in 10.244"),
        ("10.244.7.5", _rules(allow=("10.244.7.0/24",), refuse=("10.244.0.0/16",)), None),
        ("10.244.7.5", _rules(allow=("10.244.0.0/16",), refuse=("10.244.0.0/16",)), "in 10.244"),
        ("34.1.2.3", _rules(refuse=("34.0.0.0/8",)), "a range the operator refuses"),
        ("169.254.169.254", _rules(allow=("169.254.0.0/16",)), "never allowed"),
        ("fd00:ec2::254", _rules(allow=("fc00::/7",)), "never allowed"),
        ("fd12::1", _rules(allow=("fc00::/7",)), None),
    ],
    ids=[
        "allowed",
        "allowed-narrow",
        "outside-the-allowed",
        "loopback-allowed",
        "mapped-allowed",
        "cluster-range-refused-inside-an-allowed-one",
        "narrower-allowed-inside-a-refused-one",
        "tie-refuse-wins",
        "public-refused-by-the-team",
        "metadata-never",
        "aws-v6-metadata-never",
        "v6-private-allowed",
    ],
)
def test_allowed_and_refused_ranges_most_specific_wins(
    address: str, rules: consent.Rules, words: str | None
) -> None:
    reason = consent.connect_refusal("h", 443, [address], rules)
    assert reason is None if words is None else (reason is not None and words in reason)
    if reason is not None and words and words.startswith("in "):
        assert "operator.sourceRefuseCIDRs" in reason


def test_the_api_server_is_refused_in_an_allowed_range() -> None:
    rules = _rules(allow=("10.0.0.0/8",))
    reason = consent.connect_refusal("h", 443, ["10.96.0.1"], rules, {"10.96.0.1"})
    assert reason is not None and "the Kubernetes API server" in reason
    mapped = consent.connect_refusal("h", 443, ["::ffff:10.96.0.1"], rules, {"10.96.0.1"})
    assert mapped is not None and "API server" in mapped


def test_any_refused_address_of_several_refuses_the_host() -> None:
    reason = consent.connect_refusal("h", 443, ["8.8.8.8", "10.0.0.1"], consent.Rules())
    assert reason is not None and "10.0.0.1, a private address" in reason
    assert consent.connect_refusal("h", 443, ["not-an-address"], consent.Rules()) is not None


@pytest.mark.parametrize("address", METADATA)
def test_metadata_addresses_whatever_is_allowed(address: str) -> None:
    everything = _rules(allow=("0.0.0.0/0", "::/0"))
    reason = consent.connect_refusal("h", 443, [address], everything)
    assert reason is not None and "link-local" in reason


def test_the_address_flags() -> None:
    c = config.parse_args(
        [
            *("--source-host", "*"),
            *("--source-allow-cidr", "10.20.0.0/16", "--source-allow-cidr", "127.0.0.1"),
            *("--source-refuse-cidr", "10.244.0.0/16", "--source-refuse-cidr", "fd00:10::/64"),
        ]
    )
    assert c.source_rules.hosts == ("*",)
    assert c.source_rules.allow == consent.parse_networks(["10.20.0.0/16", "127.0.0.1/32"])
    assert c.source_rules.refuse == consent.parse_networks(["10.244.0.0/16", "fd00:10::/64"])
    assert config.parse_args([]).source_rules == consent.Rules()  # no host, nothing opened
    for bad in ("10.0.0.1/8", "10.0.0.0/33", "ten"):
        with pytest.raises(SystemExit):
            config.parse_args(["--source-allow-cidr", bad])
    with pytest.raises(ValueError, match="host bits set"):
        consent.parse_networks(["10.0.0.1/8"])
