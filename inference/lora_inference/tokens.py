"""Who may call what on the server: load and unload take the admin token or, with a reviewer
(`tokenreview`), the operator's ServiceAccount token bound to this pod's namespace; generation
and the reads take the client token, either of those, or anything when no client token is set.

The tokens themselves come from their mounted files (`lora_runtime.tokenfiles`: refused when
empty or missing at start, read again whenever a file changes, so a rotated Secret is picked
up without a restart).
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from lora_runtime.tokenfiles import TokenFile


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
