"""Bearer tokens from their mounted files: refused when empty or missing at start, read again
whenever a file changes, so a rotated Secret is picked up without a restart.

The operator reads the admin token this way, the inference server its admin and client tokens,
the router the pods' client token. A token has a kind (`admin`, `client`): the chart sets
`LORA_<KIND>_TOKEN_SECRET` (e.g. "Secret lora/rel-admin-token, key token") to say where its file
comes from, so an error at start names the Secret to fix; without a file, a token comes from
`LORA_<KIND>_TOKEN`.

The kubelet replaces a mounted Secret's files by swapping a symlink; one `stat` per read tells
whether to read again. A file that is empty or unreadable for a moment (mid-swap) keeps the last
good token.

Owns: reading a token. Must not: log a token, or decide who may call what (each server does).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)


class TokenError(ValueError):
    """A token file that cannot be read or holds no token; the message names it and its Secret."""


def secret_env(kind: str) -> str:
    """The variable the chart sets to name the Secret a `kind` token's file comes from."""
    return f"LORA_{kind.upper()}_TOKEN_SECRET"


def origin(kind: str, path: Path | None) -> str:
    """Where a `kind` token comes from, for messages: its file and Secret, or its variable."""
    secret = os.environ.get(secret_env(kind))
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
                log.warning("action=read-token kind=%s result=kept-previous error=%s", self.kind, e)
                return self._token
            if self._token is not None and token != self._token:
                log.info("action=read-token kind=%s result=rotated file=%s", self.kind, self.path)
            self._seen, self._token = seen, token
        return self._token
