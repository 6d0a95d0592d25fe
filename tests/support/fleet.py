"""Live inference servers behind a live router, both holding the same adapters (`fleet_of`):
for the tests of the router in front of real servers. Imports no torch itself (the servers'
fixtures do)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.unit.inference.conftest import Assets, Server
    from tests.unit.router.conftest import Router, StartRouter


async def fleet_of(
    start_server: Callable[..., Any], start_router: StartRouter, assets: Assets, n: int
) -> tuple[Router, list[Server]]:
    """`n` live servers holding `pixel-art` and `watercolor`, behind a live router that has heard
    from each of them."""
    servers = [await start_server() for _ in range(n)]
    for server in servers:
        await server.load("pixel-art", assets.adapter_a)
        await server.load("watercolor", assets.adapter_b)
    router = await start_router()
    router.set_pods({f"pod-{i}": f"127.0.0.1:{s.server.port}" for i, s in enumerate(servers)})
    for name in ("pixel-art", "watercolor"):
        router.place(name, None)
    await router.wait_reports({f"pod-{i}" for i in range(n)})
    return router, servers
