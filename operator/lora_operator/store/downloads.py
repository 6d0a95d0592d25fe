"""One guarded GET into a sink, retried: what every remote fetch (https, hf://, s3://) is made of.

`download` asks `egress.get`, the one guarded HTTP client, for a URL (asked again at each
attempt: a signature is made anew), reads the answer into a `Writer` in reads sized to how fast
the source sends, and retries 5xx, 408, 425, 429, a failed connection and a resolver that does
not answer, with backoff; `classify_status` says which, `status_error` words the rest. Blocking
calls only: callers run it in a worker thread. Nothing of what a host answered is quoted but
its status.
"""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from lora_runtime import backoff

from lora_operator.rules import consent, errors
from lora_operator.store import egress

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


def status_error(verdict: Verdict, status: int, what: str, secret_hint: str) -> errors.StagingError:
    if verdict == "not_found":
        return errors.SourceNotFound(f"{what} answered HTTP {status}: not found; check the URI")
    if verdict == "forbidden":
        return errors.SourceForbidden(
            f"{what} answered HTTP {status}: access denied; check {secret_hint} in the Secret "
            "named by source.secretRef"
        )
    return errors.InvalidSource(f"{what} answered HTTP {status}; check the URI")


class Writer(Protocol):
    """What a download writes into: a `sinks.Sink`, or `Buffer` for a small answer."""

    @property
    def size(self) -> int: ...

    def expect(self, declared: int | None) -> None: ...

    def write(self, chunk: bytes) -> None: ...

    def reset(self) -> None: ...


# The error for an answer that is neither a success nor worth retrying: (status, headers,
# the first ERROR_BODY_BYTES of its body) -> the error raised.
Refusal = Callable[[int, Mapping[str, str], bytes], errors.StagingError]

# No rules: no remote host (an empty `sourceHosts`).
NO_GUARD = egress.Guard(consent.Rules())


def download(
    request: Callable[[], tuple[str, Mapping[str, str]]],
    sink: Writer,
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


class Buffer:
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
