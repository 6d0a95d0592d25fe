"""The server's bearer tokens from their mounted files: refused when empty or missing at start,
read again whenever a file changes, so a rotated Secret is picked up without a restart.

The kubelet replaces a mounted Secret's files by swapping a symlink; one `stat` per request tells
whether to read again. A file that is empty or unreadable for a moment (mid-swap) keeps the last
good token. `LORA_ADMIN_TOKEN_SECRET` and `LORA_CLIENT_TOKEN_SECRET` (set by the chart, e.g.
"Secret lora/rel-admin-token, key token") name where a file comes from, so the error at start
says which Secret to fix.

`Tokens` decides who may call what: load and unload take the admin token or, with a reviewer
(`tokenreview`), the operator's ServiceAccount token bound to this pod's namespace; generation
and the reads take the client token, either of those, or anything when no client token is set.
"""

from __future__ import annotations

import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger(__name__)


class TokenError(ValueError):
    pass


def origin(kind: str, path: Path | None) -> str:
    """Where a token comes from, for messages: its file and Secret, or its variable."""
    secret = os.environ.get(f"LORA_{kind.upper()}_TOKEN_SECRET")
    where = f"the file {path}" if path is not None else f"LORA_{kind.upper()}_TOKEN"
    return f"{where} (from {secret})" if secret else where


def read_token(path: Path, kind: str) -> str:
    """The token in `path`; TokenError naming the file and its Secret when missing or empty."""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(
            f"the {kind} token cannot be read from {origin(kind, path)}: {e.strerror or e}; "
            "create the Secret with the key mounted there"
        ) from e
    if not token:
        raise TokenError(
            f"the {kind} token in {origin(kind, path)} is empty: put a token in the Secret's "
            "key (an empty token would turn authentication off)"
        )
    return token


class TokenFile:
    """The current token of a mounted file (read again when the file changes)."""

    def __init__(self, path: Path, kind: str, token: str | None = None) -> None:
        self.path, self.kind = path, kind
        self._token = token
        self._seen: tuple[int, int, int] | None = None

    def get(self) -> str | None:
        try:
            st = self.path.stat()
        except OSError:
            return self._token
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            try:
                token = read_token(self.path, self.kind)
            except TokenError as e:
                log.warning("%s token kept: %s", self.kind, e)
                return self._token
            if self._token is not None and token != self._token:
                log.info("%s token rotated (%s)", self.kind, self.path)
            self._seen, self._token = seen, token
        return self._token


class Reviewer(Protocol):
    async def allows(self, token: str) -> bool: ...


def same(given: str, token: str | None) -> bool:
    """Whether `given` is `token` (never an empty one), in constant time (pure)."""
    return bool(token) and hmac.compare_digest(given.encode(), str(token).encode())


@dataclass
class Tokens:
    """The admin and client tokens now: from their files when given, else the fixed values;
    and the reviewer of the operator's tokens, if any."""

    admin_token: str | None = None
    client_token: str | None = None
    admin_file: TokenFile | None = None
    client_file: TokenFile | None = None
    reviewer: Reviewer | None = None

    @classmethod
    def of(
        cls,
        admin_token: str | None,
        client_token: str | None,
        admin_token_file: Path | None,
        client_token_file: Path | None,
    ) -> Tokens:
        return cls(
            admin_token,
            client_token,
            TokenFile(admin_token_file, "admin", admin_token) if admin_token_file else None,
            TokenFile(client_token_file, "client", client_token) if client_token_file else None,
        )

    def admin(self) -> str | None:
        return self.admin_file.get() if self.admin_file is not None else self.admin_token

    async def admits_admin(self, given: str | None) -> bool:
        """Whether a caller presenting `given` (the bearer token, None when absent) may load
        and unload. With neither an admin token nor a reviewer (`--no-admin-token`), anyone."""
        admin = self.admin()
        if not admin and self.reviewer is None:
            return True
        if given is None:
            return False
        return same(given, admin) or (
            self.reviewer is not None and await self.reviewer.allows(given)
        )

    async def admits_client(self, given: str | None) -> bool:
        """Whether a caller presenting `given` may generate and read: anyone without a client
        token; else the client token, the admin token or the operator's."""
        client = self.client()
        if not client:
            return True
        if given is None:
            return False
        return (
            same(given, client)
            or same(given, self.admin())
            or (self.reviewer is not None and await self.reviewer.allows(given))
        )

    def client(self) -> str | None:
        return self.client_file.get() if self.client_file is not None else self.client_token
