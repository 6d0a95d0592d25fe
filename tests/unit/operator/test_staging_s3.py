"""Staging from s3:// against a real S3-compatible server: SeaweedFS's S3 gateway
(tests/support/s3server.py), which checks SigV4 signatures, stores multipart objects and answers
path-style and virtual-host requests with S3's error codes. A bucket in another region is
AWS's alone: that test talks to a stand-in origin."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from lora_operator.rules import consent, errors
from lora_operator.store import downloads, egress, s3fetch, sources

from tests.support import s3server
from tests.support.http import free_port
from tests.support.loras import lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import LOCAL, NS, make_store, tmp_entries, visible

BUCKET = "lora-bucket"
FAST = downloads.RetryPolicy(attempts=2, backoff_s=0.01)


@pytest.fixture(scope="module")
def s3() -> Iterator[s3server.S3Server]:
    with s3server.running() as server:
        yield server


def s3_client(endpoint: str, key_id: str, secret: str) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
    )


@pytest.fixture(scope="module")
def s3_endpoint(s3: s3server.S3Server) -> str:
    return s3.endpoint


@pytest.fixture(scope="module")
def creds(s3: s3server.S3Server) -> sources.Credentials:
    secret = {
        "AWS_ACCESS_KEY_ID": s3.key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_ENDPOINT_URL": s3.endpoint,
        "AWS_REGION": "us-east-1",
    }
    client = s3_client(s3.endpoint, s3.key_id, s3.secret)
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="adapters/pixel.safetensors", Body=lora_bytes(30))
    client.put_object(Bucket=BUCKET, Key="adapters/big.safetensors", Body=b"\0" * 50_000)
    client.put_object(Bucket=BUCKET, Key="private.safetensors", Body=lora_bytes(31))
    return sources.credentials_from_secret(secret)


async def test_s3_stage(creds: sources.Credentials, tmp_path: Path) -> None:
    seen: list[int] = []
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    staged = await make_store(tmp_path, policy=FAST).stage(
        NS, "pixel", source, credentials=creds, sha256=sha(lora_bytes(30)), progress=seen.append
    )
    assert staged.sha256 == sha(lora_bytes(30))
    assert seen[-1] == staged.size


async def test_a_multipart_object_stages_whole(
    s3: s3server.S3Server, creds: sources.Credentials, tmp_path: Path
) -> None:
    """An object uploaded in parts (its ETag is no MD5 of its bytes) is read whole, its own
    sha256 checked."""
    from boto3.s3.transfer import TransferConfig

    data = lora_bytes(33, rank=49_152)  # 12 MiB: three parts of 5 MiB at most
    parts = TransferConfig(multipart_threshold=5 * 1024**2, multipart_chunksize=5 * 1024**2)
    client = s3_client(s3.endpoint, s3.key_id, s3.secret)
    client.upload_fileobj(io.BytesIO(data), BUCKET, "adapters/parts.safetensors", Config=parts)
    etag = client.head_object(Bucket=BUCKET, Key="adapters/parts.safetensors")["ETag"]
    assert etag.strip('"').endswith("-3"), etag
    source = sources.parse_source(f"s3://{BUCKET}/adapters/parts.safetensors")
    staged = await make_store(tmp_path, policy=FAST).stage(
        NS, "parts", source, credentials=creds, sha256=sha(data)
    )
    assert (staged.sha256, staged.size) == (sha(data), len(data))


async def test_a_virtual_host_endpoint_names_the_bucket_in_the_host(
    s3: s3server.S3Server, creds: sources.Credentials, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Virtual-host addressing (the operator's AWS config says `addressing_style = virtual`, as
    for a store that serves no other): the bucket is in the host, `<bucket>.<endpoint's host>`,
    which the operator resolves (here to the server) and checks like any host."""
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    asked: list[str] = []

    def resolve(host: str, port: int) -> list[str]:
        asked.append(host)
        return ["127.0.0.1"]

    monkeypatch.setattr(egress, "resolve", resolve)
    secret = {
        "AWS_ACCESS_KEY_ID": s3.key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret,
        "AWS_ENDPOINT_URL": f"http://{s3server.DOMAIN}:{s3.port}",
        "AWS_REGION": "us-east-1",
    }
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    staged = await make_store(tmp_path / "volume", policy=FAST).stage(
        NS, "vhost", source, credentials=sources.credentials_from_secret(secret)
    )
    assert staged.sha256 == sha(lora_bytes(30))
    assert asked == [f"{BUCKET}.{s3server.DOMAIN}"]


@pytest.mark.parametrize(
    ("key_id", "secret", "code"),
    [
        (None, "wrong-secret", "SignatureDoesNotMatch"),
        ("AKIA-UNKNOWN", "any", "InvalidAccessKeyId"),
    ],
    ids=["wrong-secret", "unknown-key"],
)
async def test_a_refused_signature_is_forbidden_with_the_servers_code(
    s3: s3server.S3Server, tmp_path: Path, key_id: str | None, secret: str, code: str
) -> None:
    creds = sources.credentials_from_secret(
        {
            "AWS_ACCESS_KEY_ID": key_id or s3.key_id,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": s3.endpoint,
            "AWS_REGION": "us-east-1",
        }
    )
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    with pytest.raises(errors.SourceForbidden, match=code) as e:
        await make_store(tmp_path, policy=FAST).stage(NS, "x", source, credentials=creds)
    assert e.value.permanent and secret not in str(e.value)
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


@pytest.mark.parametrize(
    "uri", [f"s3://{BUCKET}/adapters/missing.safetensors", "s3://no-such-bucket/x.safetensors"]
)
async def test_s3_missing_is_permanent(
    creds: sources.Credentials, tmp_path: Path, uri: str
) -> None:
    with pytest.raises(errors.SourceNotFound, match="check the URI"):
        await make_store(tmp_path, policy=FAST).stage(
            NS, "x", sources.parse_source(uri), credentials=creds
        )
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_s3_size_limit(creds: sources.Credentials, tmp_path: Path) -> None:
    with pytest.raises(errors.TooLarge):
        await make_store(tmp_path, max_bytes=10_000, policy=FAST).stage(
            NS,
            "x",
            sources.parse_source(f"s3://{BUCKET}/adapters/big.safetensors"),
            credentials=creds,
        )
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_s3_unreachable_is_transient(tmp_path: Path) -> None:
    creds = sources.credentials_from_secret(
        {
            "AWS_ACCESS_KEY_ID": "AKIA-VISIBLE-NOWHERE",
            "AWS_SECRET_ACCESS_KEY": "very-secret-value",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        }
    )
    with pytest.raises(errors.SourceUnavailable) as e:
        await make_store(tmp_path, policy=FAST).stage(
            NS, "x", sources.parse_source(f"s3://{BUCKET}/k.safetensors"), credentials=creds
        )
    assert not e.value.permanent
    assert "VISIBLE-NOWHERE" not in str(e.value) and "very-secret" not in str(e.value)


# ---- no keys in the Secret: the SDK's default credential chain (IRSA, workload identity...)


@pytest.mark.parametrize(
    ("secret_has_keys", "chain_has_credentials", "expected"),
    [
        (True, True, "secret"),
        (True, False, "secret"),
        (False, True, "chain"),
        (False, False, "unsigned"),
    ],
)
def test_choose_s3_auth(secret_has_keys: bool, chain_has_credentials: bool, expected: str) -> None:
    assert (
        s3fetch.choose_s3_auth(
            secret_has_keys=secret_has_keys, chain_has_credentials=chain_has_credentials
        )
        == expected
    )


@dataclass(frozen=True)
class AuthS3:
    endpoint: str
    key_id: str
    secret: str


@pytest.fixture(scope="module")
def auth_s3(s3: s3server.S3Server, creds: sources.Credentials) -> AuthS3:
    """The server checks every request's signature: unsigned requests and unknown keys get
    403 with S3's codes, like a private bucket (`creds` put private.safetensors there)."""
    return AuthS3(s3.endpoint, s3.key_id, s3.secret)


@pytest.fixture
def no_aws_identity(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An environment where the default chain finds nothing unless a test puts it there: no
    AWS_* variables, empty config and credentials files, and no metadata endpoint (never asked:
    this machine is not a cloud instance). Returns the shared credentials file's path."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    credentials = tmp_path / "aws-credentials"
    credentials.write_text("")
    (tmp_path / "aws-config").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(credentials))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return credentials


async def _stage_private(endpoint: str, volume: Path, secret: dict[str, str]) -> str:
    creds = sources.credentials_from_secret({"AWS_ENDPOINT_URL": endpoint, **secret})
    source = sources.parse_source(f"s3://{BUCKET}/private.safetensors")
    staged = await make_store(volume, policy=FAST).stage(NS, "p", source, credentials=creds)
    return staged.sha256


async def test_s3_without_keys_uses_a_shared_credentials_file(
    auth_s3: AuthS3, no_aws_identity: Path, tmp_path: Path
) -> None:
    no_aws_identity.write_text(
        f"[default]\naws_access_key_id = {auth_s3.key_id}\n"
        f"aws_secret_access_key = {auth_s3.secret}\n"
    )
    volume = tmp_path / "volume"
    assert await _stage_private(auth_s3.endpoint, volume, {}) == sha(lora_bytes(31))


async def test_s3_without_keys_uses_the_environment(
    auth_s3: AuthS3, no_aws_identity: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", auth_s3.key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", auth_s3.secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    assert await _stage_private(auth_s3.endpoint, tmp_path / "v", {}) == sha(lora_bytes(31))


async def test_s3_keys_in_the_secret_win_over_the_chain(
    auth_s3: AuthS3, no_aws_identity: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-NOT-KNOWN-THERE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    secret = {"AWS_ACCESS_KEY_ID": auth_s3.key_id, "AWS_SECRET_ACCESS_KEY": auth_s3.secret}
    assert await _stage_private(auth_s3.endpoint, tmp_path / "v", secret) == sha(lora_bytes(31))


def test_each_staging_reads_the_chain_anew_over_one_loader(
    no_aws_identity: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # botocore's own data is parsed once per process; what the environment and the files
    # say is read again for each staging (a rotated key is used at once).
    first, second = s3fetch._session(), s3fetch._session()
    assert first is not second
    assert first.get_component("data_loader") is second.get_component("data_loader")
    assert first.get_credentials() is None
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-ROTATED")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "rotated")
    assert s3fetch._session().get_credentials().access_key == "AKIA-ROTATED"


async def test_s3_with_no_identity_anywhere_is_unsigned_and_refused(
    auth_s3: AuthS3, no_aws_identity: Path, tmp_path: Path
) -> None:
    with pytest.raises(errors.SourceForbidden, match="the operator's own cloud identity"):
        await _stage_private(auth_s3.endpoint, tmp_path / "v", {})


# ---- the S3 request goes through the guarded client like any other source


async def test_s3_endpoint_is_checked_where_the_socket_opens(
    creds: sources.Credentials, s3_endpoint: str, tmp_path: Path
) -> None:
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    any_host = consent.Rules(hosts=("*",))  # loopback not allowed
    with pytest.raises(consent.HostRefused, match=r"127\.0\.0\.1, a loopback address") as e:
        await make_store(tmp_path, rules=any_host, policy=FAST).stage(
            NS, "x", source, credentials=creds
        )
    named = consent.Rules(hosts=("s3.example.com",), allow=LOCAL.allow)
    with pytest.raises(consent.HostRefused, match="not one the operator may fetch from") as f:
        await make_store(tmp_path, rules=named, policy=FAST).stage(
            NS, "x", source, credentials=creds
        )
    for refused in (e.value, f.value):
        assert "testing-secret" not in refused.message and "testing-key" not in refused.message


async def test_s3_signs_again_for_the_region_the_bucket_is_in(
    origin: Origin, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """S3 answers a request signed for the wrong region with the bucket's region; the request is
    signed again for it, once."""
    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    data = lora_bytes(32)
    scopes: list[str] = []

    async def bucket(request: web.Request) -> web.StreamResponse:
        scope = request.headers.get("Authorization", "").split("Credential=")[1].split(",")[0]
        scopes.append(scope.split("/", 2)[2])  # date, region, service: no key id
        if "/eu-west-1/" not in scope:
            body = "<Error><Code>AuthorizationHeaderMalformed</Code></Error>"
            return web.Response(status=400, text=body, headers={"x-amz-bucket-region": "eu-west-1"})
        return web.Response(body=data)

    origin.routes[f"/{BUCKET}/moved.safetensors"] = bucket
    creds = sources.credentials_from_secret(
        {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_ENDPOINT_URL": origin.base}
    )
    source = sources.parse_source(f"s3://{BUCKET}/moved.safetensors")
    staged = await make_store(tmp_path, policy=FAST).stage(NS, "x", source, credentials=creds)
    assert staged.sha256 == sha(data)
    assert [s.split("/")[0] for s in scopes] == ["us-east-1", "eu-west-1"]
