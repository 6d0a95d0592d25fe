"""HTTP calls to one inference pod's adapter API (vLLM's shapes; see docs/inference-server.md).

Every failure becomes a `PodError` that says whether retrying can help: a refusal of the adapter
itself (422, 415, a path outside the pod's roots) is permanent until the spec or the deployment
changes; timeouts, connection errors, 429, 5xx and 401 are transient. A 401 is what a token
rotation looks like while the kubelet has given the new Secret to one side and not yet to the
other, or a bound token the pod no longer accepts: it is retried with the usual backoff, with
the credentials (`podtokens`) asked again at every call and told of the 401.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import aiohttp
from lora_podapi import models
from lora_volume import boundedjson
from lora_volume import errors as volume_errors

from lora_operator.edges import kube, podtokens
from lora_operator.rules import planning
from lora_operator.rules.model import PodInfo

# What a pod's answer may hold: /v1/models of a pod with ten thousand adapters is a few MB.
ANSWER_LIMITS = boundedjson.Limits(max_bytes=32 * 1024**2, max_depth=6, max_values=2_000_000)
REMEMBERED_PODS = 4096  # pods whose last /v1/models answer is kept (`PodClient.models`)
# 404 on load: the pod does not see the revision yet (a lagging shared file system) - retry.
_PERMANENT = {400, 403, 413, 415, 422}


class PodError(Exception):
    def __init__(self, message: str, *, permanent: bool, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.permanent = permanent
        self.status = status


class PodClient:
    def __init__(
        self,
        credentials: podtokens.Credentials,
        *,
        timeout_s: float,
        models_timeout_s: float = 10,
    ):
        self.credentials = credentials
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._models_timeout = aiohttp.ClientTimeout(total=models_timeout_s)
        self._session: aiohttp.ClientSession | None = None
        # Each pod's last /v1/models answer (a digest of its bytes) and its report, by pod UID:
        # an answer the same as the last one is that report again, not decoded and parsed
        # again (a pod holding hundreds of adapters is read every resync, most often unchanged).
        self._reports: dict[str, tuple[bytes, planning.PodReport]] = {}

    async def __aenter__(self) -> PodClient:
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def models(self, pod: PodInfo) -> planning.PodReport:
        """The pod's report: the same object as last time when its answer is the same."""
        where = "GET /v1/models"
        raw, content_type = await self._exchange(
            pod, "GET", "/v1/models", None, self._models_timeout
        )
        digest = hashlib.blake2b(raw, digest_size=16).digest()
        last = self._reports.get(pod.uid)
        if last is not None and last[0] == digest:
            return last[1]
        try:
            report = planning.parse_models(_decode(pod, raw, content_type, where))
        except ValueError as e:
            raise PodError(f"{pod.name}: {e}", permanent=False) from e
        self._reports.pop(pod.uid, None)
        self._reports[pod.uid] = (digest, report)
        if len(self._reports) > REMEMBERED_PODS:  # pods come and go: the oldest answer goes
            del self._reports[next(iter(self._reports))]
        return report

    async def load(
        self, pod: PodInfo, want: planning.Want, *, inplace: bool
    ) -> planning.Card | None:
        """Load `want`; the adapter's card as the pod lists it now, when the pod answers with
        one (a server of this project, asked for JSON), else None (vLLM, an older server, an
        answer that is not the card of `want.name`: the caller reads `/v1/models`)."""
        body = {
            "lora_name": want.name,
            "lora_path": planning.load_path(pod.adapter_root, want),
            "load_inplace": inplace,
            "pinned": want.pinned,
            "scale": want.scale,
        }
        answer = await self._call(
            pod, "POST", "/v1/load_lora_adapter", body, self._timeout, accept="application/json"
        )
        try:
            raw = models.parse_card(answer)
        except ValueError:
            return None
        return planning.card_of(raw) if raw.id == want.name and raw.parent is not None else None

    async def unload(self, pod: PodInfo, name: str) -> None:
        """Unload `name`; a pod that no longer has it is fine."""
        try:
            await self._call(
                pod, "POST", "/v1/unload_lora_adapter", {"lora_name": name}, self._timeout
            )
        except PodError as e:
            if e.status != 404:
                raise

    async def _call(
        self,
        pod: PodInfo,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: aiohttp.ClientTimeout,
        *,
        accept: str | None = None,
    ) -> Any:
        """The answer: JSON parsed when it says it is JSON, else its text."""
        raw, content_type = await self._exchange(pod, method, path, body, timeout, accept=accept)
        return _decode(pod, raw, content_type, f"{method} {path}")

    async def _exchange(
        self,
        pod: PodInfo,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        timeout: aiohttp.ClientTimeout,
        *,
        accept: str | None = None,
    ) -> tuple[bytes, str]:
        """The answer's bytes and content type; PodError for a status of 400 or more."""
        if pod.ip is None:
            raise PodError(f"pod {pod.name} has no IP yet", permanent=False)
        try:
            headers = await self.credentials.header(pod.namespace)
            if accept is not None:
                headers = {**headers, "Accept": accept}
        except (kube.ApiError, aiohttp.ClientError, TimeoutError) as e:
            raise PodError(
                f"no token for the pods of namespace {pod.namespace} (TokenRequest): {e}",
                permanent=False,
            ) from e
        try:
            async with self.session.request(
                method, pod.url(path), json=body, headers=headers, timeout=timeout
            ) as resp:
                raw = await _read_bounded(resp, ANSWER_LIMITS.max_bytes)
                if resp.status == 401:
                    self.credentials.rejected(pod.namespace)
                if resp.status >= 400:
                    raise PodError(
                        f"{method} {path} answered {resp.status}: {_error_message(_text(raw))}",
                        permanent=resp.status in _PERMANENT,
                        status=resp.status,
                    )
                return raw, resp.content_type
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise PodError(
                f"{method} {path} failed: {type(e).__name__}: {e}".rstrip(": "), permanent=False
            ) from e


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's bytes, read no further than one byte past `limit` (the parse then refuses
    it by its length)."""
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            break
    return bytes(body)


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "replace")


def _decode(pod: PodInfo, raw: bytes, content_type: str, where: str) -> Any:
    """JSON parsed (within `ANSWER_LIMITS`) when the answer says it is JSON, else its text."""
    if content_type != "application/json":
        return _text(raw)
    try:
        return boundedjson.parse(_text(raw), ANSWER_LIMITS, where=where)
    except volume_errors.InvalidJson as e:
        raise PodError(f"{pod.name}: {e}", permanent=False) from e


def _error_message(text: str) -> str:
    """The server's `error.message` when it sent vLLM's error shape, else the text itself."""
    try:
        payload = json.loads(text)
        message = payload["error"]["message"]
        if isinstance(message, str):
            return message
    except (ValueError, KeyError, TypeError):
        pass
    return text.strip()[:500]
