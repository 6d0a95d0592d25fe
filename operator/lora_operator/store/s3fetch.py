"""s3:// sources: GetObject as a GET that botocore builds and signs (its endpoint rules,
addressing style and SigV4) and `downloads.download` sends through the guarded client; no
botocore socket is ever opened. A bucket in another region is signed again for it, once. Each
staging has a botocore session of its own over the process's one loader of botocore's data.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Mapping
from typing import Any, Literal

from lora_operator.rules import errors
from lora_operator.store import downloads, egress, sinks, sources
from lora_operator.store.downloads import Refusal, RetryPolicy


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
    await asyncio.to_thread(
        _fetch_s3_sync, source, credentials, sink, policy, guard or downloads.NO_GUARD
    )


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
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import BotoCoreError

    session = _session()
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
    client = session.create_client(
        "s3",
        endpoint_url=credentials.aws_endpoint_url,
        region_name=region
        or credentials.aws_region
        or session.get_config_variable("region")
        or "us-east-1",
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


def _session() -> Any:
    """A botocore session of its own for each staging (the environment, the shared config and
    credentials files and the credential chain are read anew: a rotated file is seen), with the
    process's one loader of botocore's own data."""
    import botocore.session

    session = botocore.session.Session()
    session.register_component("data_loader", _loader(session.get_config_variable("data_path")))
    return session


@functools.cache
def _loader(data_path: str | None) -> Any:
    """botocore's loader of the data it ships (the S3 model, the endpoint rules, the
    partitions), once per process: a loader per session would parse the same files again, about
    60 ms of every s3:// staging. What it loads is read-only and cached by its arguments, as it
    is for every client of one session."""
    from botocore import loaders

    return loaders.create_loader(data_path)


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
            downloads.download(
                request, sink, policy, guard, what, _s3_refusal(what, signing_region)
            )
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
