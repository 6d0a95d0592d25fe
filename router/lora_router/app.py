"""The router's aiohttp application: the routes, its own answers, and the background work.

`create_app(config, sources=...)` sends every path it does not answer itself to `proxy.proxy`
(a reverse proxy in front of the inference pods). It answers the playground, the probes and
`GET /v1/models` from every Ready pod at once (the union of their cards), since each pod lists
only the adapters it holds; the pods are asked with the client's own Authorization.

The app owns the background work: the API watches (`sources`) and the residency poller, the
only requests that carry the router's own credential (`--client-token-file`, when the pods
require a client token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import lora_playground as playground
from aiohttp import web
from lora_runtime import tokenfiles

from lora_router import fleet as fleet_mod
from lora_router import paths, proxy, upstream
from lora_router.config import RouterConfig
from lora_router.fleet import Fleet
from lora_router.metrics import Metrics
from lora_router.state import CONFIG, FLEET, METRICS, STATE, ProxyState, Source

log = logging.getLogger("lora_router")


async def playground_page(request: web.Request) -> web.Response:
    """The playground (lora_playground), answered here so it loads with no pod Ready."""
    return web.Response(body=playground.page(), headers=playground.headers())


async def list_models(request: web.Request) -> web.StreamResponse:
    """The union of the Ready pods' `/v1/models` cards (the base model's first). Each pod is
    asked with the client's own Authorization; when none answers 200, the first pod's refusal
    (a 401 for a missing client token) comes back unchanged."""
    state, fleet = request.app[STATE], request.app[FLEET]
    endpoints = list(fleet.ready().values())
    auth = request.headers.get("Authorization")
    headers = {"Authorization": auth} if auth is not None else {}
    refusals: list[web.Response] = []

    async def one(address: str) -> list[dict[str, Any]]:
        async with state.http().get(f"http://{address}/v1/models", headers=headers) as resp:
            if resp.status != 200:
                refusals.append(
                    web.Response(
                        status=resp.status,
                        body=await resp.read(),
                        content_type=resp.content_type,
                    )
                )
                return []
            data = (await resp.json()).get("data")
            return [c for c in data if isinstance(c, dict)] if isinstance(data, list) else []

    answers = await asyncio.gather(*(one(ep.address) for ep in endpoints), return_exceptions=True)
    cards: dict[str, dict[str, Any]] = {}
    for answer in answers:
        if isinstance(answer, BaseException):
            continue
        for card in answer:
            cards.setdefault(str(card.get("id")), card)
    if not cards and refusals:
        return refusals[0]
    if not cards:
        return proxy.json_error("no inference pod answered; retry later", "ServiceUnavailable", 503)
    ordered = sorted(cards.values(), key=lambda c: (c.get("parent") is not None, str(c["id"])))
    return web.json_response({"object": "list", "data": ordered})


async def health(request: web.Request) -> web.Response:
    """Alive while no background loop has raised: one that did leaves the fleet's view frozen,
    and only a restart brings it back."""
    stopped = request.app[STATE].stopped
    if stopped:
        loops = ", ".join(f"{name} ({why})" for name, why in sorted(stopped.items()))
        return proxy.json_error(f"background work stopped: {loops}", "ServiceUnavailable", 503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready once the pods and the adapters have been listed and every listed pod has been
    polled once (before, every answer would be a 503 or a guess: a restarted router taking
    traffic before it knows residency would warm adapters where they are not placed)."""
    if request.app[STATE].draining:
        return proxy.json_error("the router is shutting down", "ServiceUnavailable", 503)
    missing = {"endpoints", "adapters", "residency"} - request.app[FLEET].synced
    if missing:
        return proxy.json_error(
            f"the router has not read {', '.join(sorted(missing))} yet",
            "ServiceUnavailable",
            503,
        )
    return web.json_response({"status": "ready"})


def poll_headers(config: RouterConfig) -> dict[str, str]:
    """The headers of the router's own polls: the pods' client token when it has one. Read at
    every round, so a rotated Secret is picked up without a restart."""
    if config.client_token_file is None:
        return {}
    try:
        token = tokenfiles.read_token(config.client_token_file, "client")
    except tokenfiles.TokenError as e:
        log.warning("action=poll result=no-token error=%s", e)
        return {}
    return {"Authorization": f"Bearer {token}"}


async def poll_residency(fleet: Fleet, state: ProxyState) -> None:
    """Read every Ready pod's residency (`/v1/adapters?view=residency`) each `poll_interval_s`,
    for ever. Each poll names the version it holds (`If-None-Match`): a pod whose residency and
    queue did not change answers a bodiless 304, and the report it had is fresh again."""
    config = state.config
    timeout = aiohttp.ClientTimeout(total=max(1.0, config.poll_interval_s * 2))

    async def one(pod: str, address: str, headers: dict[str, str]) -> None:
        url = f"http://{address}/v1/adapters?view=residency"
        held = fleet.reports.get(pod)
        if held is not None and held.etag is not None:
            headers = {**headers, "If-None-Match": held.etag}
        try:
            async with state.http().get(url, timeout=timeout, headers=headers) as resp:
                if resp.status == 304 and held is not None:
                    report = held.unchanged(time.monotonic())
                elif resp.status != 200:
                    raise ValueError(f"GET /v1/adapters answered {resp.status}")
                else:
                    report = fleet_mod.parse_report(
                        json.loads(await resp.read()), time.monotonic(), resp.headers.get("ETag")
                    )
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            state.metrics.report_failures.inc()
            log.debug("action=poll pod=%s result=error error=%s", pod, e)
            return
        fleet.take(pod, report)

    while True:
        headers = poll_headers(config)
        listed = "endpoints" in fleet.synced
        await asyncio.gather(*(one(p, ep.address, headers) for p, ep in fleet.ready().items()))
        if listed:
            # Every pod listed was asked once (answered or not): the router knows what it can.
            fleet.synced.add("residency")
        state.update_gauges()
        await asyncio.sleep(config.poll_interval_s)


def create_app(
    config: RouterConfig,
    *,
    sources: list[Source],
    fleet: Fleet | None = None,
    metrics: Metrics | None = None,
) -> web.Application:
    """The router. `sources` keep the fleet's pods and adapters current (the API watches of
    `kube_sources`; tests may pass their own)."""
    fleet = fleet or Fleet(stale_after_s=config.stale_after_s)
    metrics = metrics or Metrics()
    app = web.Application(client_max_size=config.max_body_bytes)
    app[CONFIG], app[FLEET], app[METRICS] = config, fleet, metrics
    app[STATE] = ProxyState(config, fleet, metrics)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/", playground_page)
    for method, path in sorted(paths.FORWARDED):  # found by a lookup, not the pattern below
        app.router.add_route(method, path, proxy.proxy)
    app.router.add_route("*", "/{tail:.*}", proxy.proxy)
    app.cleanup_ctx.append(lambda app: _background(app, sources))
    return app


async def _background(app: web.Application, sources: list[Source]) -> AsyncIterator[None]:
    state, config = app[STATE], app[CONFIG]
    state.session = aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(
            total=config.upstream_timeout_s, sock_connect=config.connect_timeout_s
        ),
        auto_decompress=False,
        connector=aiohttp.TCPConnector(limit=0),
    )
    state.pool = upstream.Pool(config.connect_timeout_s, config.upstream_timeout_s)
    tasks = [
        asyncio.create_task(source(app[FLEET], state), name=getattr(source, "__name__", str(i)))
        for i, source in enumerate([*sources, poll_residency])
    ]
    for task in tasks:
        task.add_done_callback(state.loop_ended)
    yield
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await state.session.close()
    state.pool.close()
