"""The guarded client on real sockets (egress): each request and each redirect is checked where
the socket opens, and the connection goes to the checked address only.

Servers listen on 127.0.0.1 and 127.0.0.2 (both loopback on Linux); the rules open 127.0.0.1
alone, so 127.0.0.2 stands for an address the operator must never reach (a pod, the metadata
service): a request that reached it would show in its `hits`. Host names resolve through the one
resolver of egress, patched here (`names`).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import urllib3
from aiohttp import web
from lora_devcluster.certs import PKI, write_pki
from lora_operator.rules import consent, errors
from lora_operator.store import egress, sources

from tests.support.loras import lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import NS, make_store, tmp_entries, visible

ONLY_127_0_0_1 = consent.Rules(hosts=("*",), allow=(ipaddress.ip_network("127.0.0.1/32"),))
TIMEOUT = urllib3.Timeout(connect=5, read=10)


@pytest.fixture
def internal() -> Iterator[Origin]:
    """A server on 127.0.0.2: what no source may reach."""
    server = Origin(host="127.0.0.2")
    try:
        yield server
    finally:
        server.close()


Names = dict[str, list[list[str]]]


@pytest.fixture
def names(monkeypatch: pytest.MonkeyPatch) -> Names:
    """Host name -> the answers of successive lookups (the last one repeats); every lookup is
    recorded in `names["lookups"]`. A name not listed does not exist."""
    table: Names = {"lookups": []}

    def resolve(host: str, port: int) -> list[str]:
        table["lookups"].append([host])
        answers = table.get(host)
        if not answers:
            raise egress.NameNotFound(host)
        return answers.pop(0) if len(answers) > 1 else answers[0]

    monkeypatch.setattr(egress, "resolve", resolve)
    return table


async def stage_url(tmp_path: Path, url: str, rules: consent.Rules = ONLY_127_0_0_1) -> str:
    staged = await make_store(tmp_path, rules=rules).stage(NS, "x", sources.HttpsSource(url))
    return staged.sha256


def fetch(url: str, rules: consent.Rules = ONLY_127_0_0_1, **headers: str) -> bytes:
    with egress.get(
        url, guard=egress.Guard(rules), headers=headers, timeout=TIMEOUT, what="test"
    ) as resp:
        assert resp.status == 200
        return resp.read()


# ---- redirects


async def test_a_redirect_to_a_refused_address_is_never_followed(
    origin: Origin, internal: Origin, tmp_path: Path
) -> None:
    secret = internal.serve("/latest/meta-data/creds", b"secret")
    origin.redirect("/w.safetensors", secret)
    with pytest.raises(consent.HostRefused) as e:
        await stage_url(tmp_path, origin.url("/w.safetensors"))
    assert e.value.permanent and e.value.reason == "HostRefused"
    assert "127.0.0.2, a loopback address" in e.value.message
    assert "operator.sourceAllowCIDRs" in e.value.message
    assert "meta-data" not in e.value.message  # the redirect's path is not quoted
    assert internal.hits == {}
    assert origin.hits == {"/w.safetensors": 1}  # refused for good: not retried
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_a_redirect_to_a_host_outside_source_hosts_is_refused(
    origin: Origin, names: Names, tmp_path: Path
) -> None:
    names["elsewhere.example"] = [["127.0.0.1"]]
    origin.serve("/w.safetensors", lora_bytes(40))
    origin.redirect("/moved", f"http://elsewhere.example:{origin.port}/w.safetensors")
    rules = consent.Rules(hosts=("127.0.0.1",), allow=ONLY_127_0_0_1.allow)
    with pytest.raises(consent.HostRefused, match=r"host elsewhere\.example is not one") as e:
        await stage_url(tmp_path, origin.url("/moved"), rules)
    assert "redirected to http://elsewhere.example" in e.value.message
    assert names["lookups"] == []  # a host not allowed is not even looked up
    assert "/w.safetensors" not in origin.hits


async def test_each_redirect_hop_that_passes_is_followed(
    origin: Origin, names: Names, tmp_path: Path
) -> None:
    data = lora_bytes(41)
    names["cdn.example"] = [["127.0.0.1"]]
    origin.serve("/blob", data)
    origin.redirect("/b", f"http://cdn.example:{origin.port}/blob", status=307)
    origin.redirect("/a", "/b", status=301)  # relative, to the same origin
    assert await stage_url(tmp_path, origin.url("/a")) == sha(data)
    assert [origin.hits[p] for p in ("/a", "/b", "/blob")] == [1, 1, 1]


def test_authorization_is_not_sent_to_another_origin(origin: Origin, names: Names) -> None:
    names["cdn.example"] = [["127.0.0.1"]]
    origin.serve("/blob", b"bytes")
    origin.redirect("/same", "/hop")
    origin.redirect("/hop", f"http://cdn.example:{origin.port}/blob")
    assert fetch(origin.url("/same"), Authorization="Bearer secret") == b"bytes"
    assert origin.requests["/hop"][0]["Authorization"] == "Bearer secret"
    assert "Authorization" not in origin.requests["/blob"][0]


def test_a_redirect_from_https_to_http_is_refused(
    pki: PKI, monkeypatch: pytest.MonkeyPatch, origin: Origin
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_cert))
    secure = Origin(pki.server_cert, pki.server_key)
    try:
        plain = origin.serve("/w", b"bytes")
        secure.redirect("/w", plain)
        with pytest.raises(consent.HostRefused, match="from https to http"):
            fetch(secure.url("/w"))
        assert secure.hits == {"/w": 1} and origin.hits == {}
    finally:
        secure.close()


async def test_too_many_redirects(origin: Origin, tmp_path: Path) -> None:
    origin.redirect("/loop", "/loop")
    with pytest.raises(errors.InvalidSource, match=f"more than {egress.MAX_REDIRECTS} redirects"):
        await stage_url(tmp_path, origin.url("/loop"))
    assert origin.hits["/loop"] == egress.MAX_REDIRECTS + 1


@pytest.mark.parametrize(
    ("location", "why"),
    [
        ("http://evil.example\\.127.0.0.1/x", "backslash"),
        ("http://user@127.0.0.2/x", "user information"),
        ("http://127.0.0.1%2f@127.0.0.2/x", "user information"),
        ("http://2130706434/x", "numeric"),
        ("http://[::ffff:127.0.0.2]/x", "IPv4-mapped form of 127.0.0.2"),
        ("ftp://127.0.0.1/x", "not http or https"),
    ],
    ids=["backslash", "userinfo", "encoded-userinfo", "decimal-address", "mapped", "ftp"],
)
def test_a_redirect_read_differently_or_to_a_mapped_address_is_refused(
    origin: Origin, internal: Origin, names: Names, location: str, why: str
) -> None:
    internal.serve("/x", b"internal")
    origin.redirect("/r", location)
    with pytest.raises(consent.HostRefused, match=why):
        fetch(origin.url("/r"))
    assert internal.hits == {} and names["lookups"] == []


# ---- names and addresses


async def test_a_name_that_resolves_to_a_refused_address(
    internal: Origin, names: Names, tmp_path: Path
) -> None:
    names["files.example"] = [["127.0.0.2"]]
    internal.serve("/w.safetensors", lora_bytes(42))
    with pytest.raises(consent.HostRefused) as e:
        await stage_url(tmp_path, f"http://files.example:{internal.port}/w.safetensors")
    assert e.value.message.endswith(
        "host files.example resolves to 127.0.0.2, a loopback address; allow the range with "
        "operator.sourceAllowCIDRs (--source-allow-cidr)"
    )
    assert internal.hits == {}


@pytest.mark.parametrize(
    "answer", [["93.184.216.34", "127.0.0.2"], ["127.0.0.2", "93.184.216.34"]], ids=str
)
def test_every_address_a_name_resolves_to_is_checked(
    internal: Origin, names: Names, answer: list[str]
) -> None:
    names["files.example"] = [answer]
    with pytest.raises(consent.HostRefused, match=r"127\.0\.0\.2, a loopback"):
        fetch(f"http://files.example:{internal.port}/x")
    assert internal.hits == {}


async def test_localhost_is_refused_without_an_allowed_range(
    origin: Origin, tmp_path: Path
) -> None:
    """No patched resolver: the system's own lookup of `localhost`."""
    origin.serve("/w.safetensors", lora_bytes(43))
    with pytest.raises(consent.HostRefused, match=r"host localhost resolves to .*loopback"):
        await stage_url(
            tmp_path,
            f"http://localhost:{origin.port}/w.safetensors",
            consent.Rules(hosts=("*",)),
        )
    assert origin.hits == {}


def test_dns_rebinding_connects_to_the_address_that_was_checked(
    origin: Origin, names: Names
) -> None:
    """The first lookup answers an allowed address, every later one a refused address on the
    same port: the connection goes to the first, and the name is looked up once."""
    rebound = Origin(host="127.0.0.2", port=origin.port)
    try:
        origin.serve("/w", b"the checked address")
        rebound.serve("/w", b"the rebound address")
        names["files.example"] = [["127.0.0.1"], ["127.0.0.2"]]
        assert fetch(f"http://files.example:{origin.port}/w") == b"the checked address"
        assert rebound.hits == {}
        assert names["lookups"] == [["files.example"]]
        # The next request looks it up again, and is refused before it connects.
        with pytest.raises(consent.HostRefused, match=r"127\.0\.0\.2"):
            fetch(f"http://files.example:{origin.port}/w")
        assert rebound.hits == {} and origin.hits == {"/w": 1}
    finally:
        rebound.close()


async def test_a_name_that_does_not_exist_is_refused(names: Names, tmp_path: Path) -> None:
    with pytest.raises(consent.HostRefused, match="does not resolve") as e:
        await stage_url(tmp_path, "https://no-such-host.example/w.safetensors")
    assert e.value.permanent
    assert names["lookups"] == [["no-such-host.example"]]  # not retried


async def test_a_resolver_that_does_not_answer_is_transient(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    lookups: list[str] = []

    def unavailable(host: str, port: int) -> list[str]:
        lookups.append(host)
        raise egress.DnsUnavailable(host)

    monkeypatch.setattr(egress, "resolve", unavailable)
    with pytest.raises(errors.SourceUnavailable, match="could not be resolved for now") as e:
        await stage_url(tmp_path, "https://files.example/w.safetensors")
    assert not e.value.permanent
    assert len(lookups) == 3  # every attempt asks again; none connects


async def test_a_backslash_url_is_refused_before_any_lookup(names: Names, tmp_path: Path) -> None:
    """Staged from a source built by hand: parse_source refuses the URI already."""
    url = "https://evil.example\\.s3.amazonaws.com/w.safetensors"
    with pytest.raises(consent.HostRefused, match="backslash"):
        await stage_url(tmp_path, url, consent.Rules(hosts=("*.s3.amazonaws.com",)))
    assert names["lookups"] == []
    with pytest.raises(errors.InvalidSource, match="backslash"):
        sources.parse_source(url)


async def test_no_rules_fetch_from_no_remote_host(
    origin: Origin, names: Names, tmp_path: Path
) -> None:
    names["files.example"] = [["127.0.0.1"]]
    origin.serve("/w.safetensors", lora_bytes(44))
    url = f"http://files.example:{origin.port}/w.safetensors"
    with pytest.raises(consent.HostRefused, match=r"operator\.sourceHosts \(--source-host\) is"):
        await stage_url(tmp_path, url, consent.Rules(allow=ONLY_127_0_0_1.allow))
    assert origin.hits == {} and names["lookups"] == []


async def test_the_api_server_is_refused_even_in_an_allowed_range(
    origin: Origin, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    origin.serve("/w.safetensors", lora_bytes(45))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    with pytest.raises(consent.HostRefused, match="the Kubernetes API server"):
        await stage_url(tmp_path, origin.url("/w.safetensors"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    guard = egress.Guard(ONLY_127_0_0_1, lambda: ("localhost", origin.port))
    url = origin.url("/w.safetensors")
    with (
        pytest.raises(consent.HostRefused, match="the Kubernetes API server"),
        egress.get(url, guard=guard, headers={}, timeout=TIMEOUT, what="t"),
    ):
        pass
    assert origin.hits == {}


# ---- TLS against the host name, at the checked address


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    return write_pki(
        tmp_path_factory.mktemp("pki"), ["127.0.0.1"], ["files.example"], "origin", "127.0.0.1"
    )


def test_tls_is_verified_against_the_host_name_with_sni(
    pki: PKI, monkeypatch: pytest.MonkeyPatch, names: Names
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(pki.ca_cert))
    secure = Origin(pki.server_cert, pki.server_key)
    try:
        secure.serve("/w", b"over tls")
        names["files.example"] = [["127.0.0.1"]]
        names["other.example"] = [["127.0.0.1"]]
        assert fetch(f"https://files.example:{secure.port}/w") == b"over tls"
        assert secure.server_names == ["files.example"]
        assert secure.requests["/w"][0]["Host"] == f"files.example:{secure.port}"
        # The same address under a name the certificate does not hold: refused by TLS.
        with pytest.raises(urllib3.exceptions.SSLError):
            fetch(f"https://other.example:{secure.port}/w")
        assert secure.hits == {"/w": 1}
    finally:
        secure.close()


# ---- the Hub: its listing and its CDN redirect, through the same client


@pytest.fixture
def hub(origin: Origin, names: Names) -> Callable[[bytes], str]:
    """A Hub at http://hub.example that lists one file and redirects its download to
    cdn-lfs.hub.example, both served by `origin`; returns the endpoint."""
    names["hub.example"] = [["127.0.0.1"]]
    names["cdn-lfs.hub.example"] = [["127.0.0.1"]]

    def serve(data: bytes) -> str:
        async def listing(request: web.Request) -> web.StreamResponse:
            if request.headers.get("Authorization") != "Bearer hf_token":
                return web.Response(status=401, headers={"X-Error-Code": "RepoNotFound"})
            siblings = [{"rfilename": n} for n in ("README.md", "pytorch_lora_weights.safetensors")]
            return web.json_response({"id": "org/repo", "siblings": siblings})

        origin.routes["/api/models/org/repo/revision/main"] = listing
        origin.serve("/blobs/abc", data)
        origin.redirect(
            "/org/repo/resolve/main/pytorch_lora_weights.safetensors",
            f"http://cdn-lfs.hub.example:{origin.port}/blobs/abc",
        )
        return f"http://hub.example:{origin.port}"

    return serve


async def test_hf_lists_and_follows_the_cdn_redirect(
    hub: Callable[[bytes], str], origin: Origin, tmp_path: Path
) -> None:
    data = lora_bytes(46)
    endpoint = hub(data)
    rules = consent.Rules(hosts=("hub.example", "*.hub.example"), allow=ONLY_127_0_0_1.allow)
    creds = sources.credentials_from_secret({"HF_TOKEN": "hf_token"})
    staged = await make_store(tmp_path, rules=rules, hf_endpoint=endpoint).stage(
        NS, "x", sources.parse_source("hf://org/repo"), credentials=creds
    )
    assert staged.sha256 == sha(data)
    assert "Authorization" not in origin.requests["/blobs/abc"][0]  # another host: not sent
    with pytest.raises(errors.SourceNotFound, match="set HF_TOKEN"):
        await make_store(tmp_path, rules=rules, hf_endpoint=endpoint).stage(
            NS, "y", sources.parse_source("hf://org/repo")
        )


async def test_hf_cdn_host_must_be_allowed_too(
    hub: Callable[[bytes], str], origin: Origin, tmp_path: Path
) -> None:
    endpoint = hub(lora_bytes(47))
    rules = consent.Rules(hosts=("hub.example",), allow=ONLY_127_0_0_1.allow)
    store = make_store(tmp_path, rules=rules, hf_endpoint=endpoint)
    source = sources.parse_source("hf://org/repo/pytorch_lora_weights.safetensors")
    with pytest.raises(consent.HostRefused, match=r"cdn-lfs\.hub\.example is not one"):
        await store.stage(NS, "x", source)
    assert "/blobs/abc" not in origin.hits


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (b"[" * 100 + b"]" * 100, "not JSON within"),
        (b"[" + b"[]," * 600_000 + b"[]]", "not JSON within"),
        (b'{"siblings": 12}', "no list of files"),
        (b"not json", "not JSON within"),
    ],
    ids=["deep", "many", "no-list", "not-json"],
)
async def test_hf_listing_is_parsed_within_bounds(
    origin: Origin, names: Names, tmp_path: Path, body: bytes, why: str
) -> None:
    names["hub.example"] = [["127.0.0.1"]]

    async def listing(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, content_type="application/json")

    origin.routes["/api/models/org/repo/revision/main"] = listing
    store = make_store(
        tmp_path, rules=ONLY_127_0_0_1, hf_endpoint=f"http://hub.example:{origin.port}"
    )
    with pytest.raises(errors.InvalidSource, match=why) as e:
        await store.stage(NS, "x", sources.parse_source("hf://org/repo"))
    assert "[[" not in e.value.message and "not json" not in e.value.message


# ---- what a failed host answered stays out of the status


async def test_a_truncated_answer_is_described_without_its_sizes(
    origin: Origin, tmp_path: Path
) -> None:
    origin.serve_truncated("/t.safetensors", b"\x17" * 12345)
    with pytest.raises(errors.SourceUnavailable) as e:
        await stage_url(tmp_path, origin.url("/t.safetensors"))
    assert not e.value.permanent
    assert "12345" not in e.value.message and "6172" not in e.value.message
