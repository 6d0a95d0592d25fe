"""Parsing spec.source, choosing an hf:// file, reading credentials: pure, no I/O."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from lora_operator.rules import errors
from lora_operator.store import sources


@pytest.mark.parametrize(
    ("uri", "revision", "expected"),
    [
        ("hf://org/repo", None, sources.HfSource("org/repo", None, "main")),
        ("hf://org/repo", "v2", sources.HfSource("org/repo", None, "v2")),
        (
            "hf://org/repo/sub/w.safetensors",
            "abc123",
            sources.HfSource("org/repo", "sub/w.safetensors", "abc123"),
        ),
        (
            "https://h.example/a/b.safetensors",
            None,
            sources.HttpsSource("https://h.example/a/b.safetensors"),
        ),
        ("s3://my-bucket/k/x.safetensors", None, sources.S3Source("my-bucket", "k/x.safetensors")),
        (
            "/mnt/adapters/x.safetensors",
            None,
            sources.VolumeSource(Path("/mnt/adapters/x.safetensors")),
        ),
    ],
    ids=["hf", "hf-revision", "hf-file", "https", "s3", "volume"],
)
def test_parse_source(uri: str, revision: str | None, expected: sources.Source) -> None:
    assert sources.parse_source(uri, revision) == expected


@pytest.mark.parametrize(
    ("uri", "revision", "fragment"),
    [
        ("http://h/x.safetensors", None, "must start with hf://"),
        ("relative/x", None, "must start with hf://"),
        ("hf://repo", None, "hf://ORG/REPO"),
        ("hf://org/repo/../x", None, "hf://ORG/REPO"),
        ("s3://Bad_Bucket/key", None, "s3://BUCKET/KEY"),
        ("s3://bucket", None, "s3://BUCKET/KEY"),
        ("/mnt/../etc/passwd", None, "'..'"),
        ("https://user:pw@h.example/x", None, "must not carry credentials"),
        ("https:///x", None, "names no host"),
        ("https://h.example/x", "main", "hf:// sources only"),
        ("https://evil.example\\.s3.amazonaws.com/x", None, "backslash"),
        ("https://h.example%2F@x/y", None, "must not carry credentials"),
        ("https://2130706433/x", None, "numeric"),
    ],
    ids=[
        "http",
        "relative",
        "hf-no-org",
        "hf-dotdot",
        "s3-bucket",
        "s3-no-key",
        "dotdot",
        "userinfo",
        "no-host",
        "revision-on-https",
        "backslash",
        "encoded-userinfo",
        "decimal-host",
    ],
)
def test_parse_source_refuses(uri: str, revision: str | None, fragment: str) -> None:
    with pytest.raises(errors.InvalidSource) as e:
        sources.parse_source(uri, revision)
    assert fragment in e.value.message
    assert e.value.permanent
    assert "pw" not in e.value.message


def test_describe_drops_query_and_credentials() -> None:
    source = sources.HttpsSource("https://h.example/a.safetensors?X-Amz-Signature=secret")
    assert sources.describe(source) == "https://h.example/a.safetensors"
    hf = sources.HfSource("org/repo", "w.safetensors", "v1")
    assert sources.describe(hf) == "hf://org/repo/w.safetensors@v1"


@pytest.mark.parametrize(
    "uri",
    ["https://h/x.bin", "s3://bucket/m.ckpt", "hf://o/r/w.pt", "/v/a.pth", "https://h/x.PKL"],
)
def test_pickle_names_refused(uri: str) -> None:
    with pytest.raises(errors.PickleRefused, match="convert it to"):
        sources.check_not_pickle(sources.parse_source(uri))


def test_sha256_pin() -> None:
    assert sources.check_sha256(None) is None
    assert sources.check_sha256("A" * 64) == "a" * 64
    for bad in ("abc", "g" * 64, "a" * 63):
        with pytest.raises(errors.InvalidSource, match="sha256sum"):
            sources.check_sha256(bad)


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (
            ["README.md", "pytorch_lora_weights.safetensors", "x.safetensors"],
            "pytorch_lora_weights.safetensors",
        ),
        (["adapter_config.json", "adapter_model.safetensors"], "adapter_model.safetensors"),
        (["one.safetensors", "sub/two.safetensors"], "one.safetensors"),
    ],
    ids=["diffusers-name", "peft-name", "single"],
)
def test_choose_hf_file(names: list[str], expected: str) -> None:
    assert sources.choose_hf_file(names) == expected


def test_choose_hf_file_refuses() -> None:
    with pytest.raises(errors.InvalidSource, match="several"):
        sources.choose_hf_file(["a.safetensors", "b.safetensors"])
    with pytest.raises(errors.PickleRefused):
        sources.choose_hf_file(["pytorch_lora_weights.bin"])
    with pytest.raises(errors.SourceNotFound):
        sources.choose_hf_file(["README.md"])


def test_credentials_from_secret() -> None:
    creds = sources.credentials_from_secret(
        {
            "HF_TOKEN": b"hf_secret",
            "AWS_ACCESS_KEY_ID": "AKIA",
            "AWS_SECRET_ACCESS_KEY": "s3cret",
            "AWS_ENDPOINT_URL": "http://minio:9000",
            "AWS_REGION": "",
            "AUTHORIZATION": "Bearer tok",
            "unrelated": "x",
        }
    )
    assert creds.hf_token == "hf_secret"
    assert creds.aws_endpoint_url == "http://minio:9000"
    assert creds.aws_region is None
    assert creds.authorization == "Bearer tok"
    for secret in ("hf_secret", "AKIA", "s3cret", "Bearer tok"):
        assert secret not in repr(creds)
    assert sources.credentials_from_secret({}) == sources.Credentials()


def test_credentials_half_aws_pair_refused() -> None:
    with pytest.raises(errors.InvalidSource, match="set both") as e:
        sources.credentials_from_secret({"AWS_ACCESS_KEY_ID": "AKIAXYZ"})
    assert "AKIAXYZ" not in e.value.message


# ---- one reading of a URL, held against urllib.parse and urllib3


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("https://h.example/a/b.safetensors", ("https", "h.example", 443, "/a/b.safetensors")),
        ("https://H.Example./a?x=1#frag", ("https", "h.example", 443, "/a?x=1")),
        ("http://127.0.0.1:8080/a", ("http", "127.0.0.1", 8080, "/a")),
        ("https://[::1]:8443/a", ("https", "::1", 8443, "/a")),
        ("https://[::ffff:169.254.169.254]/a", ("https", "::ffff:a9fe:a9fe", 443, "/a")),
        ("https://xn--bcher-kva.example/a", ("https", "xn--bcher-kva.example", 443, "/a")),
        ("https://h.example", ("https", "h.example", 443, "/")),
    ],
    ids=["plain", "case-dot-fragment", "port", "ipv6", "mapped", "punycode", "no-path"],
)
def test_parse_url(url: str, expected: tuple[str, str, int, str]) -> None:
    target = sources.parse_url(url)
    assert (target.scheme, target.host, target.port, target.request_target) == expected


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("https://evil.example\\.s3.amazonaws.com/x", "backslash"),
        ("https://h.example/a\\b", "backslash"),
        ("https://a@h.example/x", "user information"),
        ("https://h.example:443@evil.example/x", "user information"),
        ("https://evil.example%2f.h.example/x", "percent-encoded"),
        ("https://h%2eexample/x", "percent-encoded"),
        ("https://h.example\tevil/x", "control character"),
        ("https://h.example/\x00", "control character"),
        ("https://h.example /x", "space"),
        ("https://bücher.example/x", "non-ASCII"),
        ("https://h.example\u3002evil/x", "non-ASCII"),
        ("https://ⓔⓥⓘⓛ.example/x", "non-ASCII"),
        ("https://2130706433/x", "numeric"),
        ("https://0x7f000001/x", "numeric"),
        ("https://0x7f.0.0.1/x", "numeric"),
        ("https://127.1/x", "numeric"),
        ("https://0177.0.0.1/x", "numeric"),
        ("https://010.0.0.1/x", "numeric"),
        ("https://a..b/x", "not a valid DNS name"),
        ("https://-a.example/x", "not a valid DNS name"),
        ("https://a_b.example/x", "not a DNS name"),
        ("https://[fe80::1%25eth0]/x", "percent-encoded"),
        ("https://[::1/x", "not a DNS name"),
        ("https://h.example:99999/x", "out of range"),
        ("https://h.example:0/x", "out of range"),
        ("https:///x", "no host"),
        ("ftp://h.example/x", "not http or https"),
        ("//h.example/x", "not an absolute"),
    ],
    ids=lambda v: v if len(v) < 40 else v[:40],
)
def test_parse_url_refuses(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        sources.parse_url(url)


def _readings(url: str) -> set[tuple[str, str, int | None]]:
    """(scheme, host, port) as urllib.parse and urllib3 read `url`, normalised alike."""
    from urllib.parse import urlsplit

    from urllib3.util import parse_url

    def plain(host: str | None) -> str:
        host = (host or "").lower().strip("[]").rstrip(".")
        return str(ipaddress.ip_address(host)) if ":" in host else host

    split, u3 = urlsplit(url), parse_url(url)
    default = {"http": 80, "https": 443}.get(split.scheme.lower())
    return {
        (split.scheme.lower(), plain(split.hostname), split.port or default),
        ((u3.scheme or "").lower(), plain(u3.host), u3.port or default),
    }


_URLS = st.tuples(
    st.sampled_from(["https://", "http://", "HTTPS://", "https:/", "https:\\\\", "ftp://"]),
    st.lists(
        st.sampled_from(
            ["h", "example", ".", "-", "127.0.0.1", "[::1]", "%2e", "@", "\\", "é", "0x7f", "1"]
        ),
        min_size=1,
        max_size=4,
    ).map("".join),
    st.sampled_from(["", ":443", ":8443", ":", ":0", ":99999", ":8o"]),
    st.sampled_from(["", "/", "/a", "?q", "#f", "/\\x", "/@evil", "?@evil.example", "#@evil"]),
).map("".join)


@settings(max_examples=400, deadline=None)
@given(_URLS)
@example("https://h.example:8443/a")
@example("http://[::1]/")
@example("https://h.example./?a#b")
def test_what_parse_url_accepts_every_parser_reads_alike(url: str) -> None:
    """The differential: a URL parse_url accepts is read with the same scheme, host and port
    by urllib.parse and urllib3 (a URL they read differently is refused)."""
    try:
        target = sources.parse_url(url)
    except ValueError:
        return
    assert _readings(url) == {(target.scheme, target.host, target.port)}


def test_hf_urls_match_huggingface_hub() -> None:
    import huggingface_hub

    for repo, filename, revision in (
        ("org/repo", "w.safetensors", "main"),
        ("org/repo", "sub dir/w v2.safetensors", "v1.0"),
        ("org/repo", "w.safetensors", "refs/pr/1"),
    ):
        source = sources.HfSource(repo, filename, revision)
        ours = sources.hf_file_url("https://huggingface.co", source, filename)
        theirs = huggingface_hub.hf_hub_url(
            repo, filename, revision=revision, endpoint="https://huggingface.co"
        )
        assert ours == theirs
    listing = sources.hf_listing_url("https://hub/", sources.HfSource("o/r", None, "refs/pr/1"))
    assert listing == "https://hub/api/models/o/r/revision/refs%2Fpr%2F1"


def test_hf_listing() -> None:
    body = b'{"id": "o/r", "siblings": [{"rfilename": "a.safetensors"}, {"x": 1}, 3]}'
    assert sources.parse_hf_listing(body) == ["a.safetensors"]


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 33 + b"]" * 33,
        b'{"siblings": [' + b"[]," * 500_000 + b"[]]}",
        b'{"siblings": [' + b"1" * 5000 + b"]}",
        b" " * (sources.HF_LISTING_LIMITS.max_bytes + 1),
        b"[1, 2",
        b'{"a": NaN}',
    ],
    ids=["deep", "many", "huge-number", "large", "truncated", "nan"],
)
def test_hf_listing_is_bounded(body: bytes) -> None:
    with pytest.raises(ValueError, match="not JSON within") as e:
        sources.parse_hf_listing(body)
    assert "[" not in str(e.value) and "1111" not in str(e.value)


@pytest.mark.parametrize(
    "body",
    [b'{"siblings": "[[[["}', b'{"siblings": {}}', b"[]", b'"x"'],
    ids=["string", "object", "array", "string-document"],
)
def test_hf_listing_without_a_list_of_files(body: bytes) -> None:
    with pytest.raises(ValueError, match="no list of files"):
        sources.parse_hf_listing(body)


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"<Error><Code>NoSuchKey</Code><Message>x</Message></Error>", "NoSuchKey"),
        (b"<Error><Code>AccessDenied</Code></Error>", "AccessDenied"),
        (b"<Error><Code>SomethingTheHostMadeUp</Code></Error>", None),
        (b"<html>internal admin page</html>", None),
    ],
    ids=["not-found", "denied", "unknown-code", "not-s3"],
)
def test_s3_error_code_only_names_codes_s3_documents(body: bytes, code: str | None) -> None:
    assert sources.s3_error_code(body) == code
