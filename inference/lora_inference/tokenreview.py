"""The operator's bearer tokens, checked by the API server: a token is accepted when the
TokenReview API says it is valid for this pod's namespace's audience
(`lora_volume.podauth.audience`) and belongs to the operator's ServiceAccount.

The pod asks with its own ServiceAccount token (which may do nothing but review tokens), from the
files Kubernetes mounts in every pod that asks for one. A verdict is kept for a minute (never
past the token's own expiry), a refusal for ten seconds, both in a bounded cache keyed by the
token's hash; one review per token is in flight at a time, and at most four at once, so a flood
of made-up tokens costs the API server a bounded rate. Anything but a JWT is refused without
asking. An API server that cannot be reached refuses (the operator's 401 is retried).

Owns: the verdicts. Must not: log a token or keep one in clear.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import logging
import re
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from lora_runtime import login

log = logging.getLogger(__name__)

ACCEPTED_TTL_S = 60.0
REFUSED_TTL_S = 10.0
MAX_ENTRIES = 1024
MAX_IN_FLIGHT = 4
MAX_TOKEN_CHARS = 8192
_JWT = re.compile(r"^[A-Za-z0-9_-]+\.([A-Za-z0-9_-]+)\.[A-Za-z0-9_-]+$")


def looks_like_jwt(token: str) -> bool:
    """Whether `token` has a JWT's shape: three base64url parts (pure)."""
    return len(token) <= MAX_TOKEN_CHARS and _JWT.match(token) is not None


def expiry(token: str) -> float | None:
    """The `exp` claim of a JWT, unverified (it only shortens how long a verdict is kept), or
    None (pure)."""
    match = _JWT.match(token)
    if match is None:
        return None
    part = match.group(1)
    try:
        claims = json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))
    except (binascii.Error, ValueError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) if isinstance(exp, int | float) and not isinstance(exp, bool) else None


def accepted(status: Mapping[str, Any], audience: str, user: str) -> bool:
    """Whether a TokenReview's status accepts the token for `audience` as `user` (pure)."""
    audiences = status.get("audiences")
    return (
        status.get("authenticated") is True
        and (status.get("user") or {}).get("username") == user
        and isinstance(audiences, list)
        and audience in audiences
    )


@dataclass(frozen=True)
class ApiServer:
    """Where the pod asks, and as whom: the in-cluster address and its own mounted token."""

    url: str
    token_file: Path
    ca_file: Path | None

    @classmethod
    def in_cluster(cls) -> ApiServer:
        """The API server at the pod's in-cluster address (`lora_runtime.login`), asked with
        the pod's own mounted token (read again at each review)."""
        url = login.api_server_address()
        if url is None:
            raise ValueError(
                "--operator-service-account needs the Kubernetes API server: KUBERNETES_SERVICE_"
                "HOST is not set (the server is not running in a pod)"
            )
        token = login.SERVICE_ACCOUNT / "token"
        if not token.is_file():
            raise ValueError(
                f"--operator-service-account needs the pod's ServiceAccount token at {token}: "
                "set automountServiceAccountToken: true on the pod (the chart does)"
            )
        ca = login.SERVICE_ACCOUNT / "ca.crt"
        return cls(url, token, ca if ca.is_file() else None)


class TokenReviewer:
    def __init__(
        self,
        server: ApiServer,
        *,
        audience: str,
        user: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.server, self.audience, self.user, self._clock = server, audience, user, clock
        self._verdicts: OrderedDict[bytes, tuple[float, bool]] = OrderedDict()
        self._pending: dict[bytes, asyncio.Future[bool]] = {}
        self._slots = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._session: aiohttp.ClientSession | None = None
        self.reviews = 0  # asked of the API server (tests read it)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def allows(self, token: str) -> bool:
        if not looks_like_jwt(token):
            return False
        key = hashlib.sha256(token.encode()).digest()
        now = self._clock()
        kept = self._verdicts.get(key)
        if kept is not None and now < kept[0]:
            self._verdicts.move_to_end(key)
            return kept[1]
        pending = self._pending.get(key)
        if pending is not None:
            return await asyncio.shield(pending)
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._pending[key] = future
        try:
            verdict, keep_s = await self._review(token)
            exp = expiry(token)
            until = now + keep_s if exp is None else min(now + keep_s, exp)
            self._verdicts[key] = (until, verdict)
            while len(self._verdicts) > MAX_ENTRIES:
                self._verdicts.popitem(last=False)
            future.set_result(verdict)
            return verdict
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # retrieved: waiters see it, nobody else logs it
            raise
        finally:
            self._pending.pop(key, None)

    async def _review(self, token: str) -> tuple[bool, float]:
        """The API server's verdict, and how long to keep it; an API server that cannot answer
        refuses for now (kept for no time)."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": [self.audience]},
        }
        async with self._slots:
            self.reviews += 1
            try:
                own = self.server.token_file.read_text().strip()
                async with self._client().post(
                    f"{self.server.url}/apis/authentication.k8s.io/v1/tokenreviews",
                    json=body,
                    headers={"Authorization": f"Bearer {own}"},
                ) as resp:
                    if resp.status >= 300:
                        log.warning("action=token-review result=error status=%d", resp.status)
                        return False, 0.0
                    answer = await resp.json(content_type=None)
            except (OSError, TimeoutError, aiohttp.ClientError, ValueError) as e:
                log.warning("action=token-review result=error error=%s", type(e).__name__)
                return False, 0.0
        status = answer.get("status") if isinstance(answer, dict) else None
        verdict = isinstance(status, dict) and accepted(status, self.audience, self.user)
        return verdict, ACCEPTED_TTL_S if verdict else REFUSED_TTL_S

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            context = ssl.create_default_context(
                cafile=str(self.server.ca_file) if self.server.ca_file else None
            )
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(ssl=context),
                timeout=aiohttp.ClientTimeout(total=10),
            )
        return self._session
