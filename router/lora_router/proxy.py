"""Forwarding a request to an inference pod: the handler every path the router does not answer
itself goes to.

Each request's body is read (at most `max_body_bytes`: 413 beyond), its adapter taken from
`model` (or `lora.name`), the pod chosen by `routing.route`, and the request sent there with its
method, path, query, headers and body unchanged, over the pool's kept-alive connections
(`upstream`); the pod's status, headers and body come back unchanged, streamed. When the
connection to the pod fails before its answer starts (refused, reset, the pod vanished from the
endpoints), the request is sent once more to another pod; when that fails too, or no pod is
Ready, the answer is a 503 in the servers' error shape. An answer that breaks off midway aborts
the client's connection: the client sees an error, never a hang; one whose head is not HTTP is
a 502.
Two headers say what happened: `x-lora-pod` (the pod that answered) and `x-lora-route` (why).
Only generation is forwarded (`paths.forwarded`, an allowlist); every other path answers 404
and is never sent to a pod: not load and unload, not a pod's /metrics or /v1/adapters. Neither
hop-by-hop headers nor those a Connection field names cross the router, either way
(`http1.forwarded_headers`); a body aiohttp's server decoded loses its Content-Encoding with
its coding, and any other body keeps both.

`forward` is the exchange itself, whichever server parsed the request: the router's own
(`server`, for the generations it reads whole) or aiohttp's (`proxy`, the handler of every
other request). Each gives it a `Reply`, the client's side of the answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Protocol

from aiohttp import web
from lora_podapi import headers as answers

from lora_router import bodies, http1, paths, routing, upstream
from lora_router.fleet import AdapterPlacement, Fleet, Split
from lora_router.metrics import Metrics
from lora_router.state import CONFIG, STATE, ProxyState

log = logging.getLogger("lora_router")

# Answers up to this size with a known length are read whole and sent in one write; longer
# ones (large images) stream through.
BUFFERED_ANSWER_BYTES = 256 * 1024


class Reply(Protocol):
    """Where one forwarded request's answer goes: the client's connection. An answer is either
    `error` (the router's own, in the servers' error shape), `send` (whole), or `start`, `write`
    as often as needed, then `end`; `abort` closes the connection whatever was sent."""

    def error(
        self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None
    ) -> None: ...

    def send(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None: ...

    async def start(
        self, status: int, reason: str, headers: dict[str, str], length: int | None
    ) -> None: ...

    async def write(self, data: bytes) -> None: ...

    async def end(self) -> None: ...

    def abort(self) -> None: ...


def json_error(message: str, error_type: str, status: int, **headers: str) -> web.Response:
    return web.json_response(
        bodies.error_body(message, error_type, status), status=status, headers=headers
    )


class _WebReply:
    """A `Reply` through aiohttp's server: the response the handler returns."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    def error(
        self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        self.response = json_error(message, error_type, status, **(headers or {}))

    def send(self, status: int, reason: str, headers: dict[str, str], body: bytes) -> None:
        self.response = web.Response(status=status, reason=reason, headers=headers, body=body)

    async def start(
        self, status: int, reason: str, headers: dict[str, str], length: int | None
    ) -> None:
        response = self.response = web.StreamResponse(status=status, reason=reason, headers=headers)
        if length is not None:
            response.content_length = length
        await response.prepare(self.request)

    async def write(self, data: bytes) -> None:
        if self.response is not None:
            await self.response.write(data)

    async def end(self) -> None:
        if self.response is not None:
            await self.response.write_eof()

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.close()


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


def _named(fleet: Fleet, method: str, path: str, body: bytes) -> tuple[str | None, str | None]:
    """The adapter a request names (None: none, or a base model) and the base model it names
    instead (None: none, or an adapter)."""
    if method != "POST" or path not in bodies.ADAPTER_PATHS:
        return None, None
    name = bodies.adapter_of(body)
    if name is not None and name in fleet.base_models():
        return None, name
    return name, None


async def proxy(request: web.Request) -> web.StreamResponse:
    """The handler of every path the router does not answer itself, under aiohttp's server."""
    config = request.app[CONFIG]
    if not paths.forwarded(request.method, request.path):
        # An allowlist: a pod's /metrics, /v1/adapters, load and unload never go through.
        return json_error(
            paths.refusal(
                request.method, request.path, " or ".join(s.name for s in config.services)
            ),
            "NotFoundError",
            404,
        )
    try:
        body = await _read_body(request)
    except _Refused as e:
        return json_error(e.message, e.error_type, e.status)
    headers: Iterable[tuple[str, str]] = request.headers.items()
    if _decoded(request):
        # aiohttp's server decoded the body it read: the coding goes with its header, so the
        # pod is not told the bytes it gets are still compressed.
        headers = [(k, v) for k, v in headers if k.lower() != "content-encoding"]
    reply = _WebReply(request)
    await forward(
        request.app[STATE], reply, request.method, request.path, request.raw_path, headers, body
    )
    if reply.response is None:
        raise RuntimeError("the proxy gave no answer")
    return reply.response


def _decoded(request: web.Request) -> bool:
    """Whether aiohttp's server decoded the request's body (its parser's `compression`: a
    single coding it knows, gzip, deflate, br or zstd); any other coding comes untouched."""
    message = getattr(request, "_message", None)
    return getattr(message, "compression", None) is not None


async def forward(
    state: ProxyState,
    reply: Reply,
    method: str,
    path: str,
    target: str,
    headers: Iterable[tuple[str, str]],
    body: bytes,
) -> None:
    """Route one request the router forwards (`paths.forwarded`, its body read whole) and
    answer it through `reply`: the pod's answer, or the router's 503."""
    config, fleet, metrics = state.config, state.fleet, state.metrics
    adapter, model = _named(fleet, method, path, body)
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
    if placement is not None:
        # Only the pods of its base model (in a release that serves several) ever get it.
        model = placement.base_model
    sent = http1.forwarded_headers(headers)
    tried: list[str] = []
    failures: list[str] = []
    now = time.monotonic()
    backends = fleet.backends(now, model)
    if adapter is not None:
        fleet.note_request(adapter)
    affinity = routing.affinity_pays(fleet.working_set(), fleet.fewest_slots(now))
    for attempt in range(2):
        decision = routing.route(
            adapter,
            fleet.backends(time.monotonic(), model) if attempt else backends,
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
            status = await _forward(state, reply, decision, method, target, sent, body)
        except upstream.Unanswered as e:
            failures.append(f"{decision.pod}: {e}")
            metrics.failure(e.kind)
            continue
        if revision is not None and placement is not None:
            metrics.rollout_requests.labels(placement.name, revision, str(status)).inc()
        return
    status, what = 503, "no inference pod is Ready"
    if model is not None and not failures and fleet.ready() and not backends:
        what = f"no inference pod of base model {model} is Ready"
    if failures:
        what = "the pods failed before answering (" + "; ".join(failures) + ")"
    metrics.answered("none", status)
    if revision is not None and placement is not None:
        metrics.rollout_requests.labels(placement.name, revision, str(status)).inc()
    reply.error(status, "ServiceUnavailable", f"{what}; retry later", {"Retry-After": "1"})


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
            body = bodies.with_adapter(body, adapter, split.alias)
            return split.alias, holders, body, split.canary[:12]
    return adapter, placement.pods, body, split.stable[:12]


async def _send(
    state: ProxyState, pod: str, method: str, target: str, headers: dict[str, str], body: bytes
) -> upstream.Answer:
    endpoint = state.fleet.ready().get(pod)
    if endpoint is None:
        raise upstream.Unanswered("gone", "no longer Ready")
    # When the pod leaves the endpoints before it answers, `endpoints_changed` has the pool
    # give up on it (Unanswered("gone")).
    return await state.upstream().request(endpoint.address, method, target, headers, body)


async def _forward(
    state: ProxyState,
    reply: Reply,
    decision: routing.Decision,
    method: str,
    target: str,
    headers: dict[str, str],
    body: bytes,
) -> int:
    """Send the request to the pod `decision` names and its answer to the client; the status
    answered."""
    metrics, fleet = state.metrics, state.fleet
    started = time.monotonic()
    fleet.inflight[decision.pod] = fleet.inflight.get(decision.pod, 0) + 1
    try:
        try:
            answer = await _send(state, decision.pod, method, target, headers, body)
        except TimeoutError:
            # The pod may still be working on it: never sent twice.
            metrics.failure("timeout")
            metrics.answered(decision.reason, 504)
            reply.error(
                504,
                "GatewayTimeout",
                f"pod {decision.pod} did not answer within {state.config.upstream_timeout_s:.0f} s",
            )
            return 504
        except upstream.Broken as e:
            # An answer whose head makes no sense: the pod had the request, never sent twice.
            metrics.failure("midstream")
            metrics.answered(decision.reason, 502)
            log.warning("action=proxy pod=%s result=broken error=%s", decision.pod, e)
            reply.error(502, "BadGateway", f"pod {decision.pod} answered badly: {e}")
            return 502
        queue = answers.parse_queue(answer.headers)
        if queue is not None:
            fleet.take_queue(decision.pod, queue)
        try:
            await _answer(reply, decision, answer, metrics)
        finally:
            answer.close()
        return answer.status
    finally:
        fleet.inflight[decision.pod] -= 1
        metrics.upstream_seconds.observe(time.monotonic() - started)


async def _answer(
    reply: Reply, decision: routing.Decision, answer: upstream.Answer, metrics: Metrics
) -> None:
    """The pod's answer to the client: its status, headers and bytes, and the router's two."""
    headers = http1.forwarded_headers(answer.headers)
    headers["x-lora-pod"] = decision.pod
    headers["x-lora-route"] = decision.reason.value
    length = answer.content_length
    if length is not None and length <= BUFFERED_ANSWER_BYTES:
        # Small, of known length (an image's JSON): read whole, then sent with its head in one
        # write, the bytes untouched.
        try:
            data = await answer.read()
        except upstream.Broken as e:
            await _broken(reply, decision, answer, headers, e, metrics, started=False)
            return
        metrics.answered(decision.reason, answer.status)
        reply.send(answer.status, answer.reason, headers, data)
        return
    await reply.start(answer.status, answer.reason, headers, length)
    try:
        async for chunk in answer.chunks():
            await reply.write(chunk)
    except upstream.Broken as e:
        await _broken(reply, decision, answer, headers, e, metrics, started=True)
        return
    await reply.end()
    metrics.answered(decision.reason, answer.status)


async def _broken(
    reply: Reply,
    decision: routing.Decision,
    answer: upstream.Answer,
    headers: dict[str, str],
    error: BaseException,
    metrics: Metrics,
    *,
    started: bool,
) -> None:
    """An answer that broke off midway: the client gets its head and then a closed connection,
    an error it sees, never a hang."""
    metrics.failure("midstream")
    log.warning("action=proxy pod=%s result=broken error=%s", decision.pod, error)
    if not started:
        await reply.start(answer.status, answer.reason, headers, answer.content_length)
    reply.abort()
