"""What the operator sends an inference pod to prove it may load and unload there.

Two kinds, one `header(namespace)` each:

- `AdminToken`: the release's admin token from its mounted file, the same for every pod (a pod
  run by hand, a vLLM pod with an API key). Read again whenever the file changes (rotation).
- `BoundTokens`: a token of the operator's own ServiceAccount per namespace, from the
  TokenRequest API, bound to that namespace's audience (`lora_volume.podauth.audience`) and
  renewed when two thirds of its lifetime have passed. The pods verify it with TokenReview. A
  token collected by a pod of one namespace opens no pod of another and expires on its own;
  nothing long-lived lives in a tenant's namespace.

Owns: the tokens in hand. Must not: log a token or put one in a message.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_runtime import tokenfiles
from lora_volume import podauth

# What the operator asks for; the API server may shorten it (its --service-account-max-token-
# expiration) and never gives less than 10 minutes.
DEFAULT_LIFETIME_S = 3600
RENEW_AT = 2 / 3  # of a token's lifetime


class Credentials(Protocol):
    async def header(self, namespace: str) -> dict[str, str]:
        """The headers that authorise a call to an inference pod of `namespace`."""

    def rejected(self, namespace: str) -> None:
        """A pod of `namespace` answered 401: what was sent may be stale."""


class AdminToken:
    """The admin token of a mounted file (read again when it changes), or a fixed one."""

    def __init__(self, token: str | None, path: Path | None = None) -> None:
        self._fixed = token
        self._file = tokenfiles.TokenFile(path, "admin", token) if path is not None else None

    async def header(self, namespace: str) -> dict[str, str]:
        token = self._file.get() if self._file is not None else self._fixed
        return {"Authorization": f"Bearer {token}"} if token else {}

    def rejected(self, namespace: str) -> None:
        return None  # the file is read again at every call anyway


class TokenSource(Protocol):
    async def request_token(
        self, namespace: str, service_account: str, audience: str, seconds: int
    ) -> tuple[str, float]: ...


@dataclass(frozen=True)
class _Held:
    token: str
    renew_at: float


def renew_at(now: float, lifetime_s: float) -> float:
    """When a token received at `now` with `lifetime_s` left is renewed (pure)."""
    return now + lifetime_s * RENEW_AT


class BoundTokens:
    """Per-namespace tokens of the operator's ServiceAccount (`namespace`/`name`)."""

    def __init__(
        self,
        api: Callable[[], Awaitable[TokenSource]],
        namespace: str,
        name: str,
        *,
        lifetime_s: int = DEFAULT_LIFETIME_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api, self.namespace, self.name = api, namespace, name
        self.lifetime_s, self._clock = lifetime_s, clock
        self._held: dict[str, _Held] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def header(self, namespace: str) -> dict[str, str]:
        held = self._held.get(namespace)
        if held is None or self._clock() >= held.renew_at:
            lock = self._locks.setdefault(namespace, asyncio.Lock())
            async with lock:  # one TokenRequest per namespace at a time, however many calls
                held = self._held.get(namespace)
                if held is None or self._clock() >= held.renew_at:
                    held = await self._mint(namespace)
        return {"Authorization": f"Bearer {held.token}"}

    def rejected(self, namespace: str) -> None:
        self._held.pop(namespace, None)

    async def _mint(self, namespace: str) -> _Held:
        api = await self._api()
        asked = self._clock()
        token, lifetime = await api.request_token(
            self.namespace, self.name, podauth.audience(namespace), self.lifetime_s
        )
        held = self._held[namespace] = _Held(token, renew_at(asked, lifetime))
        return held
