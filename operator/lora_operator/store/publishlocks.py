"""Who may change the volume at once: publishing in one namespace excludes other publishing in
that namespace (its quota is decided one revision at a time) and every collection (between
storing an object and linking its revision, the object looks unreferenced); namespaces publish
side by side, so a burst across many namespaces is not one file-syncing queue. A collection
waits for the publishes under way and goes before any that start after it asked, so a steady
stream of publishes does not put it off for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class PublishLocks:
    def __init__(self) -> None:
        self._changed = asyncio.Condition()
        self._publishing = 0  # publishes holding their share
        self._collecting = False
        self._collections_waiting = 0
        self._namespaces: dict[str, asyncio.Lock] = {}  # one per namespace ever published in

    @contextlib.asynccontextmanager
    async def namespace(self, namespace: str) -> AsyncIterator[None]:
        """Publish in `namespace`: alone in it, beside other namespaces, never during a
        collection."""
        async with self._changed:
            await self._changed.wait_for(
                lambda: not self._collecting and not self._collections_waiting
            )
            self._publishing += 1
        try:
            async with self._namespaces.setdefault(namespace, asyncio.Lock()):
                yield
        finally:
            async with self._changed:
                self._publishing -= 1
                self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def everything(self) -> AsyncIterator[None]:
        """Collect: once no publish is under way, and none starts until it is done."""
        async with self._changed:
            self._collections_waiting += 1
            try:
                await self._changed.wait_for(lambda: not self._collecting and not self._publishing)
            finally:
                self._collections_waiting -= 1
                self._changed.notify_all()  # cancelled: the publishes it held back go on
            self._collecting = True
        try:
            yield
        finally:
            async with self._changed:
                self._collecting = False
                self._changed.notify_all()
