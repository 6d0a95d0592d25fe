"""Parsing spec.source, choosing an hf:// file, reading credentials: pure, no I/O."""

from __future__ import annotations

from pathlib import Path

import pytest
from lora_operator import errors, sources


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
