"""The router's aiohttp application: a reverse proxy in front of the inference pods.

Each request's body is read (at most `max_body_bytes`: 413 beyond), its adapter taken from
`model` (or `lora.name`), the pod chosen by `routing.route`, and the request sent there with its
method, path, query, headers and body unchanged; the pod's status, headers and body come back
unchanged, streamed. When the connection to the pod fails before its answer starts (refused,
reset, the pod vanished from the endpoints), the request is sent once more to another pod; when
that fails too, or no pod is Ready, the answer is a 503 in the servers' error shape. An answer
that breaks off midway aborts the client's connection: the client sees an error, never a hang.
Two headers say what happened: `x-lora-pod` (the pod that answered) and `x-lora-route` (why).

`GET /v1/models` is answered from every Ready pod at once (the union of their cards), since each
pod lists only the adapters it holds; the pods are asked with the client's own Authorization.
Only generation is forwarded (`paths.forwarded`, an allowlist); every other path that is not
the router's own (the playground, the model list, its probes) answers 404 and is never sent to a
pod: not load and unload, not a pod's /metrics or /v1/adapters.

The app owns the background work: the API watches (`sources`) and the residency poller, the
only requests that carry the router's own credential (`--client-token-file`, when the pods
require a client token).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from typing import Any

import aiohttp
import lora_playground as playground
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from lora_router import fleet as fleet_mod
from lora_router import paths, routing
from lora_router.config import RouterConfig, read_token
from lora_router.fleet import AdapterPlacement, Fleet, Split
from lora_router.metrics import Metrics

log = logging.getLogger("lora_router")

CONFIG = web.AppKey("config", RouterConfig)
FLEET = web.AppKey("fleet", Fleet)
METRICS = web.AppKey("metrics", Metrics)


# Hop-by-hop headers (RFC 9110 7.6.1) and what aiohttp sets itself.
_HOP = frozenset(
    h.lower()
    for h in (
        "Connection",
        "Keep-Alive",
        "Proxy-Authenticate",
        "Proxy-Authorization",
        "Proxy-Connection",
        "TE",
        "Trailer",
        "Transfer-Encoding",
        "Upgrade",
        "Host",
        "Content-Length",
    )
)
ADAPTER_PATHS = ("/v1/images/generations",)
# Answers up to this size with a known length are read whole and sent in one write; longer
# ones (large images) stream through.
BUFFERED_ANSWER_BYTES = 256 * 1024


def error_body(message: str, error_type: str, status: int) -> dict[str, Any]:
    """The inference server's (vLLM's) error shape."""
    return {"error": {"message": message, "type": error_type, "param": None, "code": status}}


def adapter_of(body: bytes) -> str | None:
    """The adapter a generation names: `lora.name` (a stack: its first member's), else `model`
    (pure; None: none named or a body the server will refuse, which any pod can do).

    A stack goes where its first member is: any pod that may serve every member builds the stack
    from them, so the first member, the one a client lists first, decides."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    lora = parsed.get("lora")
    if isinstance(lora, list) and lora:
        lora = lora[0]
    if isinstance(lora, dict) and isinstance(lora.get("name"), str):
        return str(lora["name"])
    model = parsed.get("model")
    return model if isinstance(model, str) and model else None


def with_adapter(body: bytes, adapter: str, served: str) -> bytes:
    """The generation `body` naming `served` wherever it names `adapter` (`model`, `lora.name`,
    a stack's members): how a request is sent to a rollout's canary (pure)."""
    parsed = json.loads(body)
    if parsed.get("model") == adapter:
        parsed["model"] = served
    lora = parsed.get("lora")
    for member in lora if isinstance(lora, list) else [lora]:
        if isinstance(member, dict) and member.get("name") == adapter:
            member["name"] = served
    return json.dumps(parsed).encode()


def forwarded_headers(headers: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP}


class PodGone(Exception):
    """The pod left the endpoints while a request to it waited for its answer."""


class ProxyState:
    """The I/O side of routing: the client session, requests in flight per pod, and the
    signal that a pod left (its waiting requests go elsewhere)."""

    def __init__(self, config: RouterConfig, fleet: Fleet, metrics: Metrics) -> None:
        self.config, self.fleet, self.metrics = config, fleet, metrics
        self.session: aiohttp.ClientSession | None = None
        self._gone: dict[str, asyncio.Event] = {}
        # pod -> the calls to it still waiting for their answer's head
        self.calls: dict[str, set[asyncio.Future[aiohttp.ClientResponse]]] = {}
        # Background loops that raised (each should run for ever): name -> the error. The
        # liveness probe fails while any did, so the kubelet restarts a router whose view froze.
        self.stopped: dict[str, str] = {}
        self.draining = False  # SIGTERM came: still answering, no longer Ready

    def gone_event(self, pod: str) -> asyncio.Event:
        return self._gone.setdefault(pod, asyncio.Event())

    def endpoints_changed(self) -> None:
        """Requests waiting on a pod that is no longer an endpoint at all give up on it."""
        present = set(self.fleet.endpoints())
        for pod in [p for p in self._gone if p not in present]:
            self._gone.pop(pod).set()
        for pod in [p for p in self.calls if p not in present]:
            for call in self.calls.pop(pod):
                call.cancel()
        self.fleet.forget_reports(present)
        self.update_gauges()

    def update_gauges(self) -> None:
        now = time.monotonic()
        backends = self.fleet.backends(now)
        self.metrics.pods.labels("ready").set(len(backends))
        self.metrics.pods.labels("reporting").set(
            sum(1 for b in backends if b.residency is not None)
        )
        self.metrics.load.set(sum(b.load for b in backends))

    def loop_ended(self, task: asyncio.Task[None]) -> None:
        """A background loop ended: one that raised is recorded for the liveness probe."""
        if task.cancelled() or task.exception() is None:
            return
        error = task.exception()
        log.error(
            "action=background loop=%s result=stopped error=%r", task.get_name(), error,
            exc_info=error,
        )  # fmt: skip
        self.stopped[task.get_name()] = repr(error)

    def http(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise web.HTTPServiceUnavailable(reason="the router is starting")
        return self.session


STATE = web.AppKey("state", ProxyState)
# Background work that keeps the fleet current: the API watches, the residency poller.
Source = Callable[[Fleet, ProxyState], Coroutine[Any, Any, None]]


def _json_error(message: str, error_type: str, status: int, **headers: str) -> web.Response:
    return web.json_response(
        error_body(message, error_type, status), status=status, headers=headers
    )


async def _read_body(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as e:
        raise _Refused(
            413,
            "RequestTooLarge",
            f"the request body is larger than the router accepts "
            f"({request.app[CONFIG].max_body_bytes} bytes)",
        ) from e


class _Refused(Exception):
    def __init__(self, status: int, error_type: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message = status, error_type, message


def _adapter_for(request: web.Request, body: bytes) -> str | None:
    if request.method != "POST" or request.path not in ADAPTER_PATHS:
        return None
    adapter = adapter_of(body)
    if adapter is not None and adapter in request.app[FLEET].base_models():
        return None
    return adapter


async def proxy(request: web.Request) -> web.StreamResponse:
    config, fleet, state = request.app[CONFIG], request.app[FLEET], request.app[STATE]
    metrics = request.app[METRICS]
    if not paths.forwarded(request.method, request.path):
        # An allowlist: a pod's /metrics, /v1/adapters, load and unload never go through.
        return _json_error(
            paths.refusal(request.method, request.path, config.service), "NotFoundError", 404
        )
    try:
        body = await _read_body(request)
    except _Refused as e:
        return _json_error(e.message, e.error_type, e.status)
    adapter = _adapter_for(request, body)
    placement = fleet.adapters.get(adapter) if adapter is not None else None
    placed = placement.pods if placement is not None else None
    revision = None
    if adapter is not None and placement is not None and placement.split is not None:
        adapter, placed, body, revision = _split(fleet, adapter, placement, placement.split, body)
    elif adapter is not None and placement is None:
        # A canary asked for by its alias (listed in /v1/models): the pods that hold it.
        placement = fleet.rolling_out_as(adapter)
        if placement is not None and placement.split is not None:
            placed = fleet.canary_holders(placement, placement.split, time.monotonic())
            revision = placement.split.canary[:12]
    tried: list[str] = []
    failures: list[str] = []
    now = time.monotonic()
    backends = fleet.backends(now)
    if adapter is not None:
        fleet.note_request(adapter)
    affinity = routing.affinity_pays(fleet.working_set(), fleet.fewest_slots(now))
    for attempt in range(2):
        decision = routing.route(
            adapter,
            fleet.backends(time.monotonic()) if attempt else backends,
            placed,
            known=placement is not None,
            load_factor=config.load_factor,
            exclude=frozenset(tried),
            affinity=affinity,
        )
        if decision is None:
            break
        if attempt:
            metrics.retries.inc()
        if decision.reason.affinity:
            metrics.affinity_hits.inc()
        tried.append(decision.pod)
        try:
            response = await _forward(request, state, decision, body)
        except _Unanswered as e:
            failures.append(f"{decision.pod}: {e}")
            metrics.failures.labels(e.kind).inc()
            continue
        if revision is not None and placement is not None:
            metrics.rollout_requests.labels(placement.name, revision, str(response.status)).inc()
        return response
    status, what = 503, "no inference pod is Ready"
    if failures:
        what = "the pods failed before answering (" + "; ".join(failures) + ")"
    metrics.requests.labels("none", str(status)).inc()
    if revision is not None and placement is not None:
        metrics.rollout_requests.labels(placement.name, revision, str(status)).inc()
    return _json_error(f"{what}; retry later", "ServiceUnavailable", status, **{"Retry-After": "1"})


def _split(
    fleet: Fleet, adapter: str, placement: AdapterPlacement, split: Split, body: bytes
) -> tuple[str, frozenset[str] | None, bytes, str]:
    """Where a request for an adapter under a rollout goes: its canary (the alias, on the pods
    that report holding it) for `split.weight` percent of them, else the stable revision under
    the adapter's name. Returns the name to route by, the pods it may go to, the body to send
    and the revision's sha256 prefix for the per-revision counts."""
    count = fleet.split_counts.get(adapter, 0)
    fleet.split_counts[adapter] = count + 1
    if routing.to_canary(count, split.weight):
        holders = fleet.canary_holders(placement, split, time.monotonic())
        if holders:  # else no Ready pod serves the canary yet: the stable revision answers
            return split.alias, holders, with_adapter(body, adapter, split.alias), split.canary[:12]
    return adapter, placement.pods, body, split.stable[:12]


class _Unanswered(Exception):
    """The request got no answer from the pod; sending it elsewhere is safe."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


async def _send(
    state: ProxyState, pod: str, request: web.Request, body: bytes
) -> aiohttp.ClientResponse:
    endpoint = state.fleet.ready().get(pod)
    if endpoint is None:
        raise _Unanswered("gone", "no longer Ready")
    url = f"http://{endpoint.address}{request.rel_url}"
    call = asyncio.ensure_future(
        state.http().request(
            request.method,
            url,
            data=body if body else None,
            headers=forwarded_headers(request.headers),
            allow_redirects=False,
        )
    )
    # One task per request: when the pod leaves the endpoints, `endpoints_changed` cancels the
    # calls waiting on it (no second waiter per request).
    waiting = state.calls.setdefault(pod, set())
    waiting.add(call)
    try:
        await asyncio.wait((call,))
    finally:
        waiting.discard(call)
        if not call.done():  # this request itself was cancelled (its client left)
            call.cancel()
    if call.cancelled():
        raise _Unanswered("gone", "left the endpoints before answering")
    try:
        return call.result()
    except aiohttp.ConnectionTimeoutError as e:
        raise _Unanswered(
            "connect", f"no connection within {state.config.connect_timeout_s} s"
        ) from e
    except aiohttp.ClientConnectorError as e:
        raise _Unanswered("connect", str(e)) from e
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        raise _Unanswered("disconnect", str(e) or type(e).__name__) from e


async def _forward(
    request: web.Request, state: ProxyState, decision: routing.Decision, body: bytes
) -> web.StreamResponse:
    metrics, fleet = state.metrics, state.fleet
    started = time.monotonic()
    fleet.inflight[decision.pod] = fleet.inflight.get(decision.pod, 0) + 1
    try:
        try:
            upstream = await _send(state, decision.pod, request, body)
        except TimeoutError:
            # The pod may still be working on it: never sent twice.
            metrics.failures.labels("timeout").inc()
            metrics.requests.labels(decision.reason, "504").inc()
            return _json_error(
                f"pod {decision.pod} did not answer within {state.config.upstream_timeout_s:.0f} s",
                "GatewayTimeout",
                504,
            )
        async with upstream:
            headers = forwarded_headers(upstream.headers)
            headers["x-lora-pod"] = decision.pod
            headers["x-lora-route"] = decision.reason.value
            length = upstream.content_length
            if length is not None and length <= BUFFERED_ANSWER_BYTES:
                # Small, of known length (an image's JSON): read whole, then sent with its head
                # in one write, the bytes untouched.
                try:
                    answer = await upstream.read()
                except (aiohttp.ClientError, TimeoutError) as e:
                    return await _broken(request, decision, upstream, headers, e, metrics)
                metrics.requests.labels(decision.reason, str(upstream.status)).inc()
                return web.Response(
                    status=upstream.status, reason=upstream.reason, headers=headers, body=answer
                )
            response = web.StreamResponse(
                status=upstream.status, reason=upstream.reason, headers=headers
            )
            if length is not None:
                response.content_length = length
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, TimeoutError) as e:
                return await _broken(request, decision, upstream, headers, e, metrics, response)
            await response.write_eof()
            metrics.requests.labels(decision.reason, str(upstream.status)).inc()
            return response
    finally:
        fleet.inflight[decision.pod] -= 1
        metrics.upstream_seconds.observe(time.monotonic() - started)


async def _broken(
    request: web.Request,
    decision: routing.Decision,
    upstream: aiohttp.ClientResponse,
    headers: dict[str, str],
    error: BaseException,
    metrics: Metrics,
    response: web.StreamResponse | None = None,
) -> web.StreamResponse:
    """An answer that broke off midway: the client gets its head and then a closed connection,
    an error it sees, never a hang."""
    metrics.failures.labels("midstream").inc()
    log.warning("action=proxy pod=%s result=broken error=%s", decision.pod, error)
    if response is None:
        response = web.StreamResponse(
            status=upstream.status, reason=upstream.reason, headers=headers
        )
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        await response.prepare(request)
    if request.transport is not None:
        request.transport.close()
    return response


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
        return _json_error("no inference pod answered; retry later", "ServiceUnavailable", 503)
    ordered = sorted(cards.values(), key=lambda c: (c.get("parent") is not None, str(c["id"])))
    return web.json_response({"object": "list", "data": ordered})


async def health(request: web.Request) -> web.Response:
    """Alive while no background loop has raised: one that did leaves the fleet's view frozen,
    and only a restart brings it back."""
    stopped = request.app[STATE].stopped
    if stopped:
        loops = ", ".join(f"{name} ({why})" for name, why in sorted(stopped.items()))
        return _json_error(f"background work stopped: {loops}", "ServiceUnavailable", 503)
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    """Ready once the pods and the adapters have been listed and every listed pod has been
    polled once (before, every answer would be a 503 or a guess: a restarted router taking
    traffic before it knows residency would warm adapters where they are not placed)."""
    if request.app[STATE].draining:
        return _json_error("the router is shutting down", "ServiceUnavailable", 503)
    missing = {"endpoints", "adapters", "residency"} - request.app[FLEET].synced
    if missing:
        return _json_error(
            f"the router has not read {', '.join(sorted(missing))} yet",
            "ServiceUnavailable",
            503,
        )
    return web.json_response({"status": "ready"})


async def metrics_handler(request: web.Request) -> web.Response:
    body = generate_latest(request.app[METRICS].registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def poll_headers(config: RouterConfig) -> dict[str, str]:
    """The headers of the router's own polls: the pods' client token when it has one. Read at
    every round, so a rotated Secret is picked up without a restart."""
    if config.client_token_file is None:
        return {}
    try:
        return {"Authorization": f"Bearer {read_token(config.client_token_file)}"}
    except (OSError, ValueError) as e:
        log.warning("action=poll result=no-token error=%s", e)
        return {}


async def poll_residency(fleet: Fleet, state: ProxyState) -> None:
    """Read every Ready pod's `/v1/adapters` each `poll_interval_s`, for ever."""
    config = state.config
    timeout = aiohttp.ClientTimeout(total=max(1.0, config.poll_interval_s * 2))

    async def one(pod: str, address: str, headers: dict[str, str]) -> None:
        url = f"http://{address}/v1/adapters"
        try:
            async with state.http().get(url, timeout=timeout, headers=headers) as resp:
                if resp.status != 200:
                    raise ValueError(f"GET /v1/adapters answered {resp.status}")
                report = fleet_mod.parse_report(await resp.json(), time.monotonic())
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            state.metrics.report_failures.inc()
            log.debug("action=poll pod=%s result=error error=%s", pod, e)
            return
        fleet.reports[pod] = report

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
    app.router.add_route("*", "/{tail:.*}", proxy)
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


def metrics_app(metrics: Metrics) -> web.Application:
    app = web.Application()
    app[METRICS] = metrics
    app.router.add_get("/metrics", metrics_handler)
    return app
