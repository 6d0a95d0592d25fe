"""The admin token from its mounted file: refused when empty or missing at start, read again
whenever the file changes, so a rotated Secret reaches the operator without a restart.

The kubelet replaces a mounted Secret's files by swapping a symlink; a `stat` per call tells
whether to read again. A file that is empty or unreadable for a moment (mid-swap) keeps the
last good token. `LORA_ADMIN_TOKEN_SECRET` (set by the chart: "Secret NS/NAME, key KEY") names
where the file comes from, so the error at start says which Secret to fix.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("lora_operator")

SECRET_ENV = "LORA_ADMIN_TOKEN_SECRET"


class TokenError(Exception):
    pass


def origin(path: Path | None, env: str = "LORA_ADMIN_TOKEN") -> str:
    """Where the token comes from, for messages: the Secret when the chart says, else the file."""
    secret = os.environ.get(SECRET_ENV)
    where = f"the file {path}" if path is not None else f"the environment variable {env}"
    return f"{where} (from {secret})" if secret else where


def read_token(path: Path) -> str:
    """The token in `path`; TokenError naming the file and its Secret when missing or empty."""
    try:
        token = path.read_text().strip()
    except OSError as e:
        raise TokenError(
            f"the admin token cannot be read from {origin(path)}: {e.strerror or e}; "
            "create the Secret with the key mounted there"
        ) from e
    if not token:
        raise TokenError(
            f"the admin token in {origin(path)} is empty: put a token in the Secret's key "
            "(an empty token would turn authentication off)"
        )
    return token


class TokenFile:
    """The current token of a mounted file (read again when the file changes)."""

    def __init__(self, path: Path, token: str | None = None) -> None:
        self.path = path
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
                token = read_token(self.path)
            except TokenError as e:
                log.warning("action=read-admin-token result=kept-previous error=%s", e)
                return self._token
            if self._token is not None and token != self._token:
                log.info("action=read-admin-token result=rotated file=%s", self.path)
            self._seen, self._token = seen, token
        return self._token
