"""Staging from s3:// against a real S3-compatible server process (moto's server mode)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from lora_operator.rules import consent, errors
from lora_operator.store import downloads, s3fetch, sources

from tests.support.http import free_port
from tests.support.loras import lora_bytes, sha
from tests.support.origin import Origin
from tests.support.staging import LOCAL, NS, make_store, tmp_entries, visible

BUCKET = "lora-bucket"
FAST = downloads.RetryPolicy(attempts=2, backoff_s=0.01)


@contextlib.contextmanager
def moto_server(env: dict[str, str] | None = None) -> Iterator[str]:
    """moto's S3-compatible server as a subprocess on 127.0.0.1; yields its endpoint."""
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"moto[server] and boto3 are not installed ({e}); pip install -e '.[dev]'")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    with moto_server() as endpoint:
        yield endpoint


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
def creds(s3_endpoint: str) -> sources.Credentials:

    secret = {
        "AWS_ACCESS_KEY_ID": "testing-key",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_REGION": "us-east-1",
    }
    client = s3_client(s3_endpoint, secret["AWS_ACCESS_KEY_ID"], secret["AWS_SECRET_ACCESS_KEY"])
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="adapters/pixel.safetensors", Body=lora_bytes(30))
    client.put_object(Bucket=BUCKET, Key="adapters/big.safetensors", Body=b"\0" * 50_000)
    return sources.credentials_from_secret(secret)


async def test_s3_stage(creds: sources.Credentials, tmp_path: Path) -> None:
    seen: list[int] = []
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    staged = await make_store(tmp_path, policy=FAST).stage(
        NS, "pixel", source, credentials=creds, sha256=sha(lora_bytes(30)), progress=seen.append
    )
    assert staged.sha256 == sha(lora_bytes(30))
    assert seen[-1] == staged.size


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
def auth_s3() -> Iterator[AuthS3]:
    """A moto server that checks signatures (after the 5 set-up calls below) against an IAM user
    allowed s3:*: unsigned requests and unknown keys get 403, like a private bucket."""
    import boto3

    with moto_server({"INITIAL_NO_AUTH_ACTION_COUNT": "5"}) as endpoint:
        anyone = {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", **anyone)
        iam.create_user(UserName="lora-operator")
        policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="lora-operator", PolicyName="s3", PolicyDocument=json.dumps(policy)
        )
        key = iam.create_access_key(UserName="lora-operator")["AccessKey"]
        s3 = s3_client(endpoint, key["AccessKeyId"], key["SecretAccessKey"])
        s3.create_bucket(Bucket=BUCKET)
        s3.put_object(Bucket=BUCKET, Key="private.safetensors", Body=lora_bytes(31))
        yield AuthS3(endpoint, key["AccessKeyId"], key["SecretAccessKey"])


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
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA-NOT-IN-MOTO")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    secret = {"AWS_ACCESS_KEY_ID": auth_s3.key_id, "AWS_SECRET_ACCESS_KEY": auth_s3.secret}
    assert await _stage_private(auth_s3.endpoint, tmp_path / "v", secret) == sha(lora_bytes(31))


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
