"""The router's residency polls over real HTTP: it asks for the residency view with the version
it holds, and a pod's 304 keeps the report it had, fresh again."""

from __future__ import annotations

import json

from aiohttp import web

from tests.support.stand_ins import StartBackend
from tests.unit.router.conftest import StartRouter


async def test_an_unchanged_residency_is_a_304_that_keeps_the_report_fresh(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    asked: list[tuple[str, str | None]] = []
    view = {"object": "residency", "gpu": ["x"], "cpu": [], "disk": ["y"], "max_loras": 2}

    async def adapters(request: web.Request) -> web.Response:
        asked.append((request.query_string, request.headers.get("If-None-Match")))
        if request.headers.get("If-None-Match") == '"v1"':
            return web.Response(status=304, headers={"ETag": '"v1"'})
        return web.Response(body=json.dumps(view), headers={"ETag": '"v1"'})

    app = web.Application()
    app.router.add_get("/v1/adapters", adapters)
    router = await start_router()
    router.set_pods({"a": await start_backend(app)})
    await router.wait_reports({"a"})
    first = router.fleet.reports["a"]
    assert first.residency.gpu == {"x"} and first.etag == '"v1"'
    await router.wait_until("a 304 taken", lambda: router.fleet.reports["a"].at > first.at)
    assert router.fleet.reports["a"].residency == first.residency
    assert asked[0] == ("view=residency", None)
    assert asked[1] == ("view=residency", '"v1"')
    assert router.metric("lora_router_report_failures_total") == 0
