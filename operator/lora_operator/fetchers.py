"""Fetching a source's bytes into a `sinks.Sink`: https, hf://, s3:// and volume paths.

Each fetcher writes the whole content into the sink, calling `sink.reset()` before a retry, and
raises `lora_operator.errors` (a volume path's own checks raise `lora_volume.errors`, which
`staging.Store.stage` maps): 404/403 and other 4xx are permanent, 5xx, 408, 429 and
connection errors are retried with backoff and then transient. Credentials go into request
headers or clients only; they never appear in a message or a log line.
"""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from lora_volume import files, layout

from lora_operator import backoff, errors, sinks, sources

CHUNK_BYTES = 1024 * 1024
# An https read waits until it has its whole size (or the end): small while the source is slow,
# so progress shows as bytes arrive, up to CHUNK_BYTES while it is fast, so a gigabyte takes
# few calls. See next_read_size.
MIN_READ_BYTES = 8 * 1024
FAST_READ_S = 0.05
SLOW_READ_S = 0.5


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 4
    backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    connect_timeout_s: float = 30.0
    read_timeout_s: float = 60.0

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based), pure."""
        return backoff.delay(attempt + 1, cap=self.max_backoff_s, first=self.backoff_s)


def next_read_size(size: int, seconds: float) -> int:
    """The size of the next https read after one of `size` bytes took `seconds` (pure): doubled
    while reads come back fast, halved when one waited long, within MIN_READ_BYTES and
    CHUNK_BYTES."""
    if seconds < FAST_READ_S:
        return min(size * 2, CHUNK_BYTES)
    if seconds > SLOW_READ_S:
        return max(size // 2, MIN_READ_BYTES)
    return size


Verdict = Literal["ok", "retry", "not_found", "forbidden", "rejected"]


def classify_status(status: int) -> Verdict:
    """What an HTTP status means for a download (pure)."""
    if 200 <= status < 300:
        return "ok"
    if status in (404, 410):
        return "not_found"
    if status in (401, 403):
        return "forbidden"
    if status in (408, 425, 429) or status >= 500:
        return "retry"
    return "rejected"


def _status_error(
    verdict: Verdict, status: int, what: str, secret_hint: str
) -> errors.StagingError:
    if verdict == "not_found":
        return errors.SourceNotFound(f"{what} answered HTTP {status}: not found; check the URI")
    if verdict == "forbidden":
        return errors.SourceForbidden(
            f"{what} answered HTTP {status}: access denied; check {secret_hint} in the Secret "
            "named by source.secretRef"
        )
    return errors.InvalidSource(f"{what} answered HTTP {status}; check the URI")


async def fetch(
    source: sources.Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy | None = None,
    volume_root: Path | None = None,
    hf_endpoint: str | None = None,
) -> None:
    """Fetch any source into `sink` (the default fetcher of `staging.Store`).

    `hf_endpoint` overrides the Hub's address (a mirror); None keeps huggingface_hub's default,
    which honours HF_ENDPOINT.
    """
    policy = policy or RetryPolicy()
    if isinstance(source, sources.HttpsSource):
        headers = {"Authorization": credentials.authorization} if credentials.authorization else {}
        await fetch_https(source.url, sink, headers=headers, policy=policy)
    elif isinstance(source, sources.HfSource):
        await fetch_hf(source, credentials, sink, policy=policy, endpoint=hf_endpoint)
    elif isinstance(source, sources.S3Source):
        await fetch_s3(source, credentials, sink, policy=policy)
    else:
        if volume_root is None:
            raise errors.InvalidSource(
                f"{source.path}: volume paths need the volume root; stage them with a Store"
            )
        await fetch_volume(source, volume_root, sink)


async def fetch_https(
    url: str,
    sink: sinks.Sink,
    *,
    headers: dict[str, str],
    policy: RetryPolicy,
    secret_hint: str = "AUTHORIZATION",
) -> None:
    """GET `url` into the sink in a worker thread, retrying as `classify_status` says.

    A blocking socket in a thread, not the event loop: OpenSSL then decrypts straight into
    each chunk (curl's speed), where asyncio's TLS transport copies every byte twice more
    through Python, and a large download no longer takes the loop's time from every other
    adapter the operator is reconciling.
    """
    await asyncio.to_thread(_fetch_https_sync, url, sink, headers, policy, secret_hint)


def _fetch_https_sync(
    url: str, sink: sinks.Sink, headers: dict[str, str], policy: RetryPolicy, secret_hint: str
) -> None:
    import urllib3
    from urllib3 import exceptions as u3

    what = sink.description
    # identity: the hash and the size limit apply to the bytes of the file itself (a server
    # that compresses anyway is decoded below).
    request_headers = {**headers, "Accept-Encoding": "identity"}
    timeout = urllib3.Timeout(connect=policy.connect_timeout_s, read=policy.read_timeout_s)
    # Redirects are followed (a Hub answers with one to its CDN); urllib3 drops Authorization
    # when one leads to another host. Every other retry is ours, below.
    retries = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=10)
    last = "no attempt"
    with urllib3.PoolManager(timeout=timeout, retries=retries) as http:
        for attempt in range(policy.attempts):
            if attempt:
                time.sleep(policy.delay(attempt - 1))
                sink.reset()
            try:
                resp = http.request("GET", url, headers=request_headers, preload_content=False)
                try:
                    verdict = classify_status(resp.status)
                    if verdict == "retry":
                        last = f"HTTP {resp.status}"
                        resp.drain_conn()  # a short error body; the connection can serve again
                        continue
                    if verdict != "ok":
                        raise _status_error(verdict, resp.status, what, secret_hint)
                    declared = resp.headers.get("Content-Length")
                    length = int(declared) if declared and declared.isdigit() else None
                    sink.expect(length)
                    size = MIN_READ_BYTES
                    while True:
                        started = time.monotonic()
                        chunk = resp.read(size, decode_content=True)
                        if not chunk:
                            break
                        sink.write(chunk)
                        size = next_read_size(size, time.monotonic() - started)
                    if length is not None and sink.size != length and not _encoded(resp):
                        last = f"body ended after {sink.size} of {length} bytes"
                        continue
                    resp.release_conn()
                    return
                finally:
                    # Anything not read to its end (a failure, a refusal) closes its connection
                    # rather than going back to the pool with a body still in it.
                    resp.close()
            except (u3.LocationValueError, u3.URLSchemeUnknown, ValueError) as e:
                raise errors.InvalidSource(f"{what}: {_short(e)}; check the URI") from e
            except u3.MaxRetryError as e:
                if isinstance(e.reason, u3.ResponseError):  # the redirects ran out
                    raise errors.InvalidSource(f"{what}: too many redirects; check the URI") from e
                last = f"{type(e.reason).__name__}: {_short(e.reason)}" if e.reason else "failed"
            except (u3.TimeoutError, TimeoutError):
                last = "timed out"
            except (u3.HTTPError, OSError) as e:
                # A truncated body (IncompleteRead), a reset connection, a TLS failure.
                last = f"{type(e).__name__}: {_short(e)}"
    raise errors.SourceUnavailable(
        f"{what} could not be downloaded after {policy.attempts} attempts ({last}); "
        "staging retries later"
    )


def _encoded(resp: Any) -> bool:
    """Whether the body came content-encoded (its Content-Length counts the encoded bytes)."""
    encoding: str = resp.headers.get("Content-Encoding", "identity")
    return encoding.lower() != "identity"


def _short(e: BaseException) -> str:
    # Messages can carry the full URL (with a signed query string): keep the first line and
    # drop anything after a '?', and urllib3's "HTTPSConnection(host=..., port=...): " prefix.
    text = str(e).splitlines()[0].split("?")[0] if str(e) else "no detail"
    return re.sub(r"^\w*Connection\([^)]*\):\s*", "", text)[:200]


async def fetch_hf(
    source: sources.HfSource,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy,
    endpoint: str | None = None,
) -> None:
    """Resolve the file with huggingface_hub, then stream it like any https download."""
    import huggingface_hub
    from huggingface_hub import errors as hf_errors

    what = sources.describe(source)
    filename = source.filename
    if filename is None:
        api = huggingface_hub.HfApi(endpoint=endpoint, token=credentials.hf_token or False)
        try:
            names = await asyncio.to_thread(
                api.list_repo_files, source.repo_id, revision=source.revision
            )
        except (hf_errors.RepositoryNotFoundError, hf_errors.RevisionNotFoundError) as e:
            raise errors.SourceNotFound(
                f"{what}: repository or revision not found (or private: set HF_TOKEN in the "
                "Secret named by source.secretRef)"
            ) from e
        except hf_errors.GatedRepoError as e:
            raise errors.SourceForbidden(
                f"{what} is gated: accept its terms on the Hub and set HF_TOKEN in the Secret"
            ) from e
        except (hf_errors.HfHubHTTPError, OSError) as e:
            raise errors.SourceUnavailable(f"{what}: the Hub could not be reached") from e
        filename = sources.choose_hf_file(names, source=what)
        sources.check_not_pickle(sources.HfSource(source.repo_id, filename, source.revision))
    url = huggingface_hub.hf_hub_url(
        source.repo_id, filename, revision=source.revision, endpoint=endpoint
    )
    headers = {"Authorization": f"Bearer {credentials.hf_token}"} if credentials.hf_token else {}
    await fetch_https(url, sink, headers=headers, policy=policy, secret_hint="HF_TOKEN")


async def fetch_s3(
    source: sources.S3Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy,
) -> None:
    """GetObject with boto3 in a worker thread, signed as `choose_s3_auth` decides."""
    await asyncio.to_thread(_fetch_s3_sync, source, credentials, sink, policy)


S3Auth = Literal["secret", "chain", "unsigned"]


def choose_s3_auth(*, secret_has_keys: bool, chain_has_credentials: bool) -> S3Auth:
    """How an s3:// request is signed (pure).

    Keys in the Secret win. Without them, the SDK's default credential chain (environment,
    shared credentials file, web identity such as IRSA or workload identity federation, the
    container and instance metadata endpoints) signs the request, so a pod's cloud identity
    works with no Secret at all. Only when the chain finds nothing are requests unsigned, which
    is what a public bucket needs.
    """
    if secret_has_keys:
        return "secret"
    return "chain" if chain_has_credentials else "unsigned"


def _s3_client(credentials: sources.Credentials, policy: RetryPolicy) -> Any:
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config

    session = boto3.session.Session()
    has_keys = credentials.aws_access_key_id is not None
    # The chain is consulted only without keys, and only for namespaces the platform team
    # lends the operator's identity to (consent.Rules.ambient): resolving it may ask a
    # metadata endpoint.
    auth = choose_s3_auth(
        secret_has_keys=has_keys,
        chain_has_credentials=not has_keys
        and credentials.ambient
        and session.get_credentials() is not None,
    )
    config = Config(
        retries={"max_attempts": policy.attempts, "mode": "standard"},
        connect_timeout=policy.connect_timeout_s,
        read_timeout=policy.read_timeout_s,
        signature_version=UNSIGNED if auth == "unsigned" else None,
    )
    return session.client(
        "s3",
        endpoint_url=credentials.aws_endpoint_url,
        region_name=credentials.aws_region or session.region_name or "us-east-1",
        aws_access_key_id=credentials.aws_access_key_id,
        aws_secret_access_key=credentials.aws_secret_access_key,
        config=config,
    )


def _fetch_s3_sync(
    source: sources.S3Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    policy: RetryPolicy,
) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    what = sink.description
    client = _s3_client(credentials, policy)
    last = "no attempt"
    for attempt in range(policy.attempts):
        if attempt:
            sink.reset()
        try:
            response = client.get_object(Bucket=source.bucket, Key=source.key)
            sink.expect(response.get("ContentLength"))
            body = response["Body"]
            try:
                for chunk in body.iter_chunks(CHUNK_BYTES):
                    sink.write(chunk)
            finally:
                body.close()
            return
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            status = int(e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            if code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound") or status == 404:
                raise errors.SourceNotFound(f"{what}: {code or 'not found'}; check the URI") from e
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403"):
                raise errors.SourceForbidden(
                    f"{what}: {code}; check AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY and "
                    "AWS_ENDPOINT_URL in the Secret named by source.secretRef, or, without "
                    "keys there, the operator's own cloud identity (its ServiceAccount's role)"
                ) from e
            if status and classify_status(status) != "retry":
                raise errors.InvalidSource(f"{what}: {code} (HTTP {status})") from e
            last = code or f"HTTP {status}"
        except BotoCoreError as e:
            last = type(e).__name__
    raise errors.SourceUnavailable(
        f"{what} could not be downloaded after {policy.attempts} attempts ({last}); "
        "staging retries later"
    )


async def fetch_volume(source: sources.VolumeSource, volume_root: Path, sink: sinks.Sink) -> None:
    """Copy a file (or an adapter directory's weights) that is already on the volume."""
    await asyncio.to_thread(_fetch_volume_sync, source, volume_root, sink)


def _fetch_volume_sync(source: sources.VolumeSource, volume_root: Path, sink: sinks.Sink) -> None:
    resolved = layout.resolve_allowed(source.path, (volume_root,), param="source.uri")
    weights = files.find_weights_file(resolved)
    for internal in (layout.tmp_dir(volume_root), volume_root / layout.OBJECTS):
        if weights.is_relative_to(internal.resolve()):
            raise errors.InvalidSource(
                f"{source.path} is inside the operator's own store; name a file you put there"
            )
    with weights.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            sink.write(chunk)
