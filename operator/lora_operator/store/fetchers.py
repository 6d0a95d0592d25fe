"""Fetching a source's bytes into a `sinks.Sink`: https, hf://, s3://, oci:// and volume paths.

Every remote request goes through `egress.get`, the one guarded HTTP client: the Hub through
its plain HTTP endpoints (the file listing, `resolve/`), S3 through GETs that botocore signs
(SigV4) and egress sends, OCI registries through the distribution API (`ocifetch`); no library
opens a socket of its own. `Fetcher` binds
the operator's rules (`egress.Guard`) to `fetch`; without a guard nothing remote is fetched.
One download, retried, is `downloads.download`; s3:// is `s3fetch`.

Each fetcher writes the whole content into the sink, calling `sink.reset()` before a retry, and
returns what the source resolved to, in the source's own terms, where a reference can move: an
oci:// reference's manifest digest (`oci://REGISTRY/REPOSITORY@sha256:...`, `ocifetch`); None
for the other sources, which name no resolution (yet: an hf:// revision's commit would be one).
It raises `lora_operator.rules.errors` (a volume path's own checks raise `lora_volume.errors`, which
`staging.Store.stage` maps): a refused host or address is `consent.HostRefused`, 404/403 and
other 4xx are permanent, 5xx, 408, 429, connection errors and a resolver that does not answer
are retried with backoff and then transient. Credentials go into request headers or signed
URLs only; messages name what failed in words of their own, never the URL's query, a header,
nor anything the host answered but its status.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from lora_volume import files, layout

from lora_operator.rules import errors
from lora_operator.store import downloads, egress, ocifetch, s3fetch, sinks, sources
from lora_operator.store.downloads import Refusal, RetryPolicy, classify_status, status_error


@dataclass(frozen=True)
class Fetcher:
    """`fetch` bound to the operator's settings: the fetch a `staging.Store` is given."""

    volume_root: Path
    guard: egress.Guard
    policy: RetryPolicy = field(default_factory=RetryPolicy)
    hf_endpoint: str | None = None

    async def __call__(
        self, source: sources.Source, credentials: sources.Credentials, sink: sinks.Sink
    ) -> str | None:
        return await fetch(
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
) -> str | None:
    """Fetch any source into `sink`; what it resolved to (see the module's docstring), or None.

    `hf_endpoint` overrides the Hub's address (a mirror); None reads HF_ENDPOINT, then the Hub.
    `guard`: the rules every remote request is checked against; None fetches from no remote
    host (an empty `sourceHosts`).
    """
    policy = policy or RetryPolicy()
    guard = guard or downloads.NO_GUARD
    if isinstance(source, sources.HttpsSource):
        headers = {"Authorization": credentials.authorization} if credentials.authorization else {}
        await fetch_https(source.url, sink, headers=headers, policy=policy, guard=guard)
    elif isinstance(source, sources.HfSource):
        await fetch_hf(source, credentials, sink, policy=policy, endpoint=hf_endpoint, guard=guard)
    elif isinstance(source, sources.S3Source):
        await s3fetch.fetch_s3(source, credentials, sink, policy=policy, guard=guard)
    elif isinstance(source, sources.OciSource):
        return await ocifetch.fetch_oci(source, credentials, sink, policy=policy, guard=guard)
    else:
        if volume_root is None:
            raise errors.InvalidSource(
                f"{source.path}: volume paths need the volume root; stage them with a Store"
            )
        await fetch_volume(source, volume_root, sink)
    return None


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
        return status_error(classify_status(status), status, what, secret_hint)

    await asyncio.to_thread(
        downloads.download,
        lambda: (url, headers),
        sink,
        policy,
        guard or downloads.NO_GUARD,
        what,
        refusal,
    )


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
        _fetch_hf_sync, source, credentials, sink, policy, endpoint, guard or downloads.NO_GUARD
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
        listing = downloads.Buffer(
            sources.HF_LISTING_LIMITS.max_bytes, f"{what}: the Hub's file listing"
        )
        url = sources.hf_listing_url(hub, source)
        downloads.download(
            lambda: (url, headers), listing, policy, guard, what, _hf_listing_refusal(what)
        )
        try:
            names = sources.parse_hf_listing(listing.value())
        except ValueError as e:
            raise errors.InvalidSource(f"{what}: the Hub's file listing is refused: {e}") from e
        filename = sources.choose_hf_file(names, source=what)
        sources.check_not_pickle(sources.HfSource(source.repo_id, filename, source.revision))
    file_url = sources.hf_file_url(hub, source, filename)
    downloads.download(
        lambda: (file_url, headers), sink, policy, guard, what, _hf_file_refusal(what)
    )


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
        return status_error(classify_status(status), status, what, "HF_TOKEN")

    return refusal


def _hf_file_refusal(what: str) -> Refusal:
    def refusal(status: int, headers: Mapping[str, str], _: bytes) -> errors.StagingError:
        gated = _gated(status, headers, what)
        if gated is not None:
            return gated
        return status_error(classify_status(status), status, what, "HF_TOKEN")

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
        while chunk := f.read(downloads.CHUNK_BYTES):
            sink.write(chunk)
