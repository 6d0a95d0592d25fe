"""Staging from s3:// against a real S3-compatible server process (moto's server mode)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from lora_operator import errors, fetchers, sources, staging

from tests.operator.conftest import lora_bytes, sha
from tests.operator.test_staging_https import NS, tmp_entries, visible

BUCKET = "lora-bucket"
FAST = fetchers.RetryPolicy(attempts=2, backoff_s=0.01)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    try:
        import boto3  # noqa: F401
        import moto.server  # noqa: F401
    except ImportError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"moto[server] and boto3 are not installed ({e}); pip install -e '.[dev]'")
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
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
def creds(s3_endpoint: str) -> sources.Credentials:
    import boto3

    secret = {
        "AWS_ACCESS_KEY_ID": "testing-key",
        "AWS_SECRET_ACCESS_KEY": "testing-secret",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_REGION": "us-east-1",
    }
    client = boto3.client(
        "s3",
        endpoint_url=s3_endpoint,
        region_name="us-east-1",
        aws_access_key_id=secret["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=secret["AWS_SECRET_ACCESS_KEY"],
    )
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key="adapters/pixel.safetensors", Body=lora_bytes(30))
    client.put_object(Bucket=BUCKET, Key="adapters/big.safetensors", Body=b"\0" * 50_000)
    return sources.credentials_from_secret(secret)


async def test_s3_stage(creds: sources.Credentials, tmp_path: Path) -> None:
    seen: list[int] = []
    source = sources.parse_source(f"s3://{BUCKET}/adapters/pixel.safetensors")
    staged = await staging.Store(tmp_path, policy=FAST).stage(
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
        await staging.Store(tmp_path, policy=FAST).stage(
            NS, "x", sources.parse_source(uri), credentials=creds
        )
    assert visible(tmp_path) == [] and tmp_entries(tmp_path) == []


async def test_s3_size_limit(creds: sources.Credentials, tmp_path: Path) -> None:
    with pytest.raises(errors.TooLarge):
        await staging.Store(tmp_path, max_bytes=10_000, policy=FAST).stage(
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
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{_free_port()}",
        }
    )
    with pytest.raises(errors.SourceUnavailable) as e:
        await staging.Store(tmp_path, policy=FAST).stage(
            NS, "x", sources.parse_source(f"s3://{BUCKET}/k.safetensors"), credentials=creds
        )
    assert not e.value.permanent
    assert "VISIBLE-NOWHERE" not in str(e.value) and "very-secret" not in str(e.value)
