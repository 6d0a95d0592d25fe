"""Fetching a source's bytes into a `sinks.Sink`: https, hf://, s3:// and volume paths.

Every remote request goes through `egress.get`, the one guarded HTTP client: the Hub through
its plain HTTP endpoints (the file listing, `resolve/`), S3 through GETs that botocore signs
(SigV4) and egress sends; no library opens a socket of its own. `Fetcher` binds
the operator's rules (`egress.Guard`) to `fetch`; without a guard nothing remote is fetched.

Each fetcher writes the whole content into the sink, calling `sink.reset()` before a retry, and
raises `lora_operator.errors` (a volume path's own checks raise `lora_volume.errors`, which
`staging.Store.stage` maps): a refused host or address is `consent.HostRefused`, 404/403 and
other 4xx are permanent, 5xx, 408, 429, connection errors and a resolver that does not answer
are retried with backoff and then transient. Credentials go into request headers or signed
URLs only; messages name what failed in words of their own, never the URL's query, a header,
nor anything the host answered but its status.
"""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from lora_volume import files, layout

from lora_operator import backoff, consent, egress, errors, sinks, sources

CHUNK_BYTES = 1024 * 1024
# An https read waits until it has its whole size (or the end): small while the source is slow,
# so progress shows as bytes arrive, up to CHUNK_BYTES while it is fast, so a gigabyte takes
# few calls. See next_read_size.
MIN_READ_BYTES = 8 * 1024
FAST_READ_S = 0.05
SLOW_READ_S = 0.5
# What is read of an error answer, for S3's error code: never quoted.
ERROR_BODY_BYTES = 16 * 1024


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


class _Writer(Protocol):
    """What a download writes into: a `sinks.Sink`, or `_Buffer` for a small answer."""

    @property
    def size(self) -> int: ...

    def expect(self, declared: int | None) -> None: ...

    def write(self, chunk: bytes) -> None: ...

    def reset(self) -> None: ...


# The error for an answer that is neither a success nor worth retrying: (status, headers,
# the first ERROR_BODY_BYTES of its body) -> the error raised.
Refusal = Callable[[int, Mapping[str, str], bytes], errors.StagingError]

_NO_GUARD = egress.Guard(consent.Rules())


@dataclass(frozen=True)
class Fetcher:
    """`fetch` bound to the operator's settings: the fetch a `staging.Store` is given."""

    volume_root: Path
    guard: egress.Guard
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    hf_endpoint: str | None = None

    async def __call__(
        self, source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> None:
        await fetch(
            source,
            credentials,
            sink,
            policy=self.policy,
            volume_root=self.volume_root,
            hf_endpoint=self.hf_endpoint,
            guard=self.guard,
        )


async def fetch(
    source: sources.Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy | None = None,
    volume_root: Path | None = None,
    hf_endpoint: str | None = None,
    guard: egress.Guard | None = None,
) -> None:
    """Fetch any source into `sink`.

    `hf_endpoint` overrides the Hub's address (a mirror); None reads HF_ENDPOINT, then the Hub.
    `guard`: the rules every remote request is checked against; None fetches from no remote
    host (an empty `sourceHosts`).
    """
    policy = policy or RetryPolicy()
    guard = guard or _NO_GUARD
    if isinstance(source, sources.HttpsSource):
        headers = {"Authorization": credentials.authorization} if credentials.authorization else {}
        await fetch_https(source.url, sink, headers=headers, policy=policy, guard=guard)
    elif isinstance(source, sources.HfSource):
        await fetch_hf(source, credentials, sink, policy=policy, endpoint=hf_endpoint, guard=guard)
    elif isinstance(source, sources.S3Source):
        await fetch_s3(source, credentials, sink, policy=policy, guard=guard)
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
    guard: egress.Guard | None = None,
    secret_hint: str = "AUTHORIZATION",
) -> None:
    """GET `url` into the sink in a worker thread, retrying as `classify_status` says.

    A blocking socket in a thread, not the event loop: OpenSSL then decrypts straight into
    each chunk (curl's speed), where asyncio's TLS transport copies every byte twice more
    through Python, and a large download no longer takes the loop's time from every other
    adapter the operator is reconciling.
    """
    what = sink.description

    def refusal(status: int, _: Mapping[str, str], __: bytes) -> errors.StagingError:
        return _status_error(classify_status(status), status, what, secret_hint)

    await asyncio.to_thread(
        _download, lambda: (url, headers), sink, policy, guard or _NO_GUARD, what, refusal
    )


def _download(
    request: Callable[[], tuple[str, Mapping[str, str]]],
    sink: _Writer,
    policy: RetryPolicy,
    guard: egress.Guard,
    what: str,
    refusal: Refusal,
) -> None:
    """GET the URL `request()` gives, with its headers (asked again for each attempt: a
    signature is made anew), into `sink` through `egress.get`, retrying what `classify_status`
    says to retry and failed connections; `refusal` makes the error of any other answer that is
    not a success."""
    import urllib3
    from urllib3 import exceptions as u3

    timeout = urllib3.Timeout(connect=policy.connect_timeout_s, read=policy.read_timeout_s)
    last = "no attempt"
    for attempt in range(policy.attempts):
        if attempt:
            time.sleep(policy.delay(attempt - 1))
            sink.reset()
        url, headers = request()
        # identity: the hash and the size limit apply to the bytes of the file itself (a
        # server that compresses anyway is decoded below).
        headers = {**headers, "Accept-Encoding": "identity"}
        try:
            with egress.get(url, guard=guard, headers=headers, timeout=timeout, what=what) as resp:
                if classify_status(resp.status) == "retry":
                    last = f"HTTP {resp.status}"
                    continue
                if classify_status(resp.status) != "ok":
                    body = resp.read(ERROR_BODY_BYTES, decode_content=True)
                    raise refusal(resp.status, resp.headers, body)
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
                    last = "the body ended before the length it declared"
                    continue
                return
        except egress.DnsUnavailable:
            last = "the host's name could not be resolved for now"
        except (u3.TimeoutError, TimeoutError):
            last = "timed out"
        except (u3.SSLError, ssl.SSLError):
            last = "TLS failed: the certificate is not trusted or not for this host"
        except u3.NewConnectionError:
            last = "the connection was refused or the host is unreachable"
        except (u3.HTTPError, OSError):
            # A truncated body, a reset connection: nothing of the answer is quoted.
            last = "the connection failed or was cut"
    raise errors.SourceUnavailable(
        f"{what} could not be downloaded after {policy.attempts} attempts ({last}); "
        "staging retries later"
    )


def _encoded(resp: Any) -> bool:
    """Whether the body came content-encoded (its Content-Length counts the encoded bytes)."""
    encoding: str = resp.headers.get("Content-Encoding", "identity")
    return encoding.lower() != "identity"


class _Buffer:
    """A small answer read into memory, refused past `limit` bytes (the Hub's listing)."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self.chunks: list[bytes] = []
        self.size = 0

    def expect(self, declared: int | None) -> None:
        if declared is not None and declared > self.limit:
            raise self._too_large()

    def write(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            raise self._too_large()
        self.chunks.append(chunk)

    def reset(self) -> None:
        self.chunks, self.size = [], 0

    def _too_large(self) -> errors.StagingError:
        return errors.InvalidSource(f"{self.what} is larger than {self.limit} bytes")

    def value(self) -> bytes:
        return b"".join(self.chunks)


# ---- hf://: the Hub's plain HTTP endpoints


async def fetch_hf(
    source: sources.HfSource,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy,
    endpoint: str | None = None,
    guard: egress.Guard | None = None,
) -> None:
    """List the repository (when the URI names no file) and download the file, both from the
    Hub's HTTP endpoints through the guarded client; the Hub's redirects to its CDN hosts are
    followed and each one checked."""
    await asyncio.to_thread(
        _fetch_hf_sync, source, credentials, sink, policy, endpoint, guard or _NO_GUARD
    )


def hf_endpoint_url(endpoint: str | None) -> str:
    """The Hub's address: the operator's setting, else HF_ENDPOINT, else the Hub."""
    return endpoint or os.environ.get("HF_ENDPOINT") or sources.DEFAULT_HF_ENDPOINT


def _fetch_hf_sync(
    source: sources.HfSource,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    policy: RetryPolicy,
    endpoint: str | None,
    guard: egress.Guard,
) -> None:
    what = sources.describe(source)
    hub = hf_endpoint_url(endpoint)
    headers = {"Authorization": f"Bearer {credentials.hf_token}"} if credentials.hf_token else {}
    filename = source.filename
    if filename is None:
        listing = _Buffer(sources.HF_LISTING_LIMITS.max_bytes, f"{what}: the Hub's file listing")
        url = sources.hf_listing_url(hub, source)
        _download(lambda: (url, headers), listing, policy, guard, what, _hf_listing_refusal(what))
        try:
            names = sources.parse_hf_listing(listing.value())
        except ValueError as e:
            raise errors.InvalidSource(f"{what}: the Hub's file listing is refused: {e}") from e
        filename = sources.choose_hf_file(names, source=what)
        sources.check_not_pickle(sources.HfSource(source.repo_id, filename, source.revision))
    file_url = sources.hf_file_url(hub, source, filename)
    _download(lambda: (file_url, headers), sink, policy, guard, what, _hf_file_refusal(what))


def _gated(status: int, headers: Mapping[str, str], what: str) -> errors.StagingError | None:
    if status in (401, 403) and headers.get("X-Error-Code") == "GatedRepo":
        return errors.SourceForbidden(
            f"{what} is gated: accept its terms on the Hub and set HF_TOKEN in the Secret"
        )
    return None


def _hf_listing_refusal(what: str) -> Refusal:
    def refusal(status: int, headers: Mapping[str, str], _: bytes) -> errors.StagingError:
        gated = _gated(status, headers, what)
        if gated is not None:
            return gated
        if status in (401, 404):  # the Hub answers 401 for a missing repository, too
            return errors.SourceNotFound(
                f"{what}: repository or revision not found (or private: set HF_TOKEN in the "
                "Secret named by source.secretRef)"
            )
        return _status_error(classify_status(status), status, what, "HF_TOKEN")

    return refusal


def _hf_file_refusal(what: str) -> Refusal:
    def refusal(status: int, headers: Mapping[str, str], _: bytes) -> errors.StagingError:
        gated = _gated(status, headers, what)
        if gated is not None:
            return gated
        return _status_error(classify_status(status), status, what, "HF_TOKEN")

    return refusal


# ---- s3://: signed by botocore, sent by egress


async def fetch_s3(
    source: sources.S3Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    *,
    policy: RetryPolicy,
    guard: egress.Guard | None = None,
) -> None:
    """GetObject as a GET that botocore signs (SigV4, as `choose_s3_auth` decides) and the
    guarded client sends, in a worker thread."""
    await asyncio.to_thread(_fetch_s3_sync, source, credentials, sink, policy, guard or _NO_GUARD)


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


class _Prepared(Exception):
    """The request botocore would send, caught just before it is sent."""

    def __init__(self, url: str, headers: Mapping[str, str]) -> None:
        super().__init__("prepared")
        self.url, self.headers = url, headers


def _capture(request: Any, **_: Any) -> None:
    # botocore's `before-send` event: the request is built and signed, nothing is sent yet.
    headers = {
        k: v.decode("latin-1") if isinstance(v, bytes) else str(v)
        for k, v in request.headers.items()
    }
    raise _Prepared(str(request.url), headers)


def _s3_request(
    source: sources.S3Source, credentials: sources.Credentials, region: str | None, what: str
) -> tuple[str, Callable[[], tuple[str, Mapping[str, str]]]]:
    """The region a GetObject of `source` is signed for, and what makes the request: the URL
    and headers botocore builds and signs (its endpoint rules, addressing style and SigV4;
    signed anew at each call), caught at its `before-send` event: botocore sends nothing."""
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    session = boto3.session.Session()
    has_keys = credentials.aws_access_key_id is not None
    # The chain is consulted only without keys, and only for namespaces the platform team
    # lends the operator's identity to (consent.Rules.ambient): resolving it may ask a
    # metadata endpoint (the operator's own identity, never a URL a source names).
    auth = choose_s3_auth(
        secret_has_keys=has_keys,
        chain_has_credentials=not has_keys
        and credentials.ambient
        and session.get_credentials() is not None,
    )
    client = session.client(
        "s3",
        endpoint_url=credentials.aws_endpoint_url,
        region_name=region or credentials.aws_region or session.region_name or "us-east-1",
        aws_access_key_id=credentials.aws_access_key_id,
        aws_secret_access_key=credentials.aws_secret_access_key,
        config=Config(signature_version=UNSIGNED) if auth == "unsigned" else None,
    )
    client.meta.events.register("before-send.s3.GetObject", _capture)

    def request() -> tuple[str, Mapping[str, str]]:
        try:
            client.get_object(Bucket=source.bucket, Key=source.key)
        except _Prepared as prepared:
            return prepared.url, prepared.headers
        except BotoCoreError as e:  # the chain's credentials could not be had just now
            raise errors.SourceUnavailable(
                f"{what}: the request could not be signed ({type(e).__name__}); staging "
                "retries later"
            ) from e
        raise errors.InvalidSource(f"{what}: the S3 request could not be built")

    return str(client.meta.region_name), request


class _OtherRegion(Exception):
    """S3 says the bucket is in `region`: signed again for it, once."""

    def __init__(self, region: str) -> None:
        super().__init__(region)
        self.region = region


def _fetch_s3_sync(
    source: sources.S3Source,
    credentials: sources.Credentials,
    sink: sinks.Sink,
    policy: RetryPolicy,
    guard: egress.Guard,
) -> None:
    from botocore.exceptions import BotoCoreError

    what = sink.description
    region: str | None = None
    for _ in range(2):
        try:
            signing_region, request = _s3_request(source, credentials, region, what)
        except (BotoCoreError, ValueError) as e:
            raise errors.InvalidSource(
                f"{what}: the S3 request cannot be made ({type(e).__name__}); check "
                "AWS_ENDPOINT_URL and AWS_REGION in the Secret named by source.secretRef"
            ) from e
        try:
            _download(request, sink, policy, guard, what, _s3_refusal(what, signing_region))
            return
        except _OtherRegion as moved:
            if region is not None:
                break
            region = moved.region
            sink.reset()
    raise errors.InvalidSource(
        f"{what}: S3 keeps sending the request to another region; set AWS_REGION in the Secret"
    )


def _s3_refusal(what: str, signing_region: str) -> Refusal:
    def refusal(status: int, headers: Mapping[str, str], body: bytes) -> errors.StagingError:
        code = sources.s3_error_code(body)
        region = sources.s3_region(headers.get("x-amz-bucket-region"))
        if status in (301, 400) and region is not None and region != signing_region:
            raise _OtherRegion(region)
        if code in sources.S3_NOT_FOUND_CODES or status == 404:
            return errors.SourceNotFound(f"{what}: {code or 'not found'}; check the URI")
        if code in sources.S3_FORBIDDEN_CODES or status in (401, 403):
            return errors.SourceForbidden(
                f"{what}: {code or f'HTTP {status}'}; check AWS_ACCESS_KEY_ID, "
                "AWS_SECRET_ACCESS_KEY and AWS_ENDPOINT_URL in the Secret named by "
                "source.secretRef, or, without keys there, the operator's own cloud identity "
                "(its ServiceAccount's role)"
            )
        return errors.InvalidSource(f"{what}: {code or 'refused'} (HTTP {status})")

    return refusal


# ---- paths on the volume


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
