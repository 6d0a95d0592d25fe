"""The aiohttp application: routes, the error middleware, and the engine's lifecycle.

`create_app(config, backend=...)` (or `load=...`) returns an application around the pipeline it
is given (a `backend.Backend`: the CLI picks the diffusers one or the simulated one; the app
imports neither). It starts answering /health at once and loads the pipeline, when given a way to
load it, in the background; /ready turns 200 when the model and the static adapters are loaded.
Route handlers only parse (api), authorise (the admin token for load/unload, the client token for
generation and reads; /health, /ready and /metrics stay open for probes and Prometheus) and
delegate to the engine; /metrics has the engine refresh the gauges read from its occupancy
first, so a scrape is never stale. Domain errors become HTTP errors in `error_middleware` and
nowhere else.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import lora_playground as playground
from aiohttp import web
from lora_podapi import adapters, models
from lora_podapi import headers as answers
from lora_runtime import metrics as prometheus
from lora_volume import boundedjson, podauth
from lora_volume import errors as volume_errors

from lora_inference import api, errors, payloads, tokenreview
from lora_inference import tokens as tokens_mod
from lora_inference.adapters.registry import AdapterRecord
from lora_inference.backend import Backend
from lora_inference.config import ServerConfig
from lora_inference.engine import Engine, GeneratedImage
from lora_inference.metrics import Metrics

log = logging.getLogger(__name__)

CONFIG = web.AppKey("config", ServerConfig)
METRICS = web.AppKey("metrics", Metrics)
ENGINE = web.AppKey("engine", Engine)
STARTUP = web.AppKey("startup", asyncio.Task[Engine])
STARTED_AT = web.AppKey("started_at", float)
TOKENS = web.AppKey("tokens", tokens_mod.Tokens)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(
    message: str, error_type: str, status: int, param: str | None = None
) -> dict[str, Any]:
    """vLLM's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status}}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except errors.DOMAIN_ERRORS as caught:
        e = caught if isinstance(caught, errors.InferenceError) else errors.from_volume(caught)
        headers = {"Retry-After": str(e.retry_after_s)} if isinstance(e, errors.QueueFull) else None
        return web.json_response(
            error_body(e.message, e.error_type, e.status, e.param), status=e.status, headers=headers
        )
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return web.json_response(error_body(e.reason, "HTTPError", e.status), status=e.status)
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return web.json_response(
            error_body("internal server error; see the server log", "InternalServerError", 500),
            status=500,
        )


# A request body (client_max_size bounds its bytes) nests a few levels: a generation's `lora`,
# a load's fields. Parsed within these bounds, a body of `[[[[...` is a 400, not a RecursionError.
BODY_LIMITS = boundedjson.Limits(max_bytes=1024**2, max_depth=8, max_values=20_000)


async def _json(request: web.Request) -> Any:
    body = await request.read()
    try:
        return boundedjson.parse(body, BODY_LIMITS, where="the request body")
    except volume_errors.InvalidJson as e:
        raise errors.InvalidRequest(f"the request body is not valid JSON: {e}") from e


def _engine(request: web.Request) -> Engine:
    task = request.app[STARTUP]
    if not task.done():
        raise errors.NotReady("the model is still loading; retry when /ready answers 200")
    if task.exception() is not None:
        raise errors.NotReady(f"the model failed to load: {task.exception()}")
    return task.result()


def _started(app: web.Application) -> Engine | None:
    """The engine once it has started, else None (for the answers that never wait for it)."""
    task = app[STARTUP]
    if task.done() and task.exception() is None:
        return task.result()
    return None


async def _authorise(request: web.Request) -> None:
    """Load and unload: the admin token (read from its file as it is now, so a rotation needs no
    restart) or the operator's token for this pod's namespace (TokenReview)."""
    if not await request.app[TOKENS].admits_admin(_bearer(request)):
        raise errors.Unauthorized(
            "this endpoint needs 'Authorization: Bearer <token>' with the server's admin token "
            "(or the operator's token for this pod's namespace)"
        )


async def _authorise_client(request: web.Request) -> None:
    """Generation and the read endpoints: the client token, when one is configured, or the
    admin token or the operator's (the operator reads /v1/models)."""
    if not await request.app[TOKENS].admits_client(_bearer(request)):
        raise errors.Unauthorized(
            "this endpoint needs 'Authorization: Bearer <token>' with the server's client "
            "token (or its admin token)"
        )


def _bearer(request: web.Request) -> str | None:
    scheme, _, given = request.headers.get("Authorization", "").partition(" ")
    return given.strip() if scheme.lower() == "bearer" else None


async def load_adapter(request: web.Request) -> web.Response:
    await _authorise(request)
    body = api.parse_load(await _json(request))
    engine = _engine(request)
    record = await engine.admission.register(
        body.name,
        body.path,
        pinned=body.pinned,
        load_inplace=body.load_inplace,
        scale=body.scale,
    )
    if "application/json" in request.headers.get("Accept", ""):
        # The adapter's card as `GET /v1/models` lists it now: a caller that asks for it (the
        # operator) need not read the whole list to see what the load did.
        app = request.app
        card = payloads.card(app[CONFIG], engine, record, int(app[STARTED_AT]))
        return web.json_response(models.render_card(card))
    return web.Response(text=f"Success: LoRA adapter '{body.name}' added successfully.")


async def unload_adapter(request: web.Request) -> web.Response:
    await _authorise(request)
    name = api.parse_unload(await _json(request))
    await _engine(request).admission.unregister(name)
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


async def list_models(request: web.Request) -> web.Response:
    """The base model's card and one per adapter (`lora_podapi.models`; `payloads` says what
    each holds)."""
    await _authorise_client(request)
    app = request.app
    listed = payloads.model_list(app[CONFIG], _started(app), int(app[STARTED_AT]))
    return web.json_response(models.render(listed))


async def list_adapters(request: web.Request) -> web.Response:
    """Residency, capacity and queue: what an adapter-aware router routes by
    (`lora_podapi.adapters`).

    `?view=residency` is the router's form: the adapters' names by tier, without the details of
    each. Either form carries an `ETag` and answers a matching `If-None-Match` with a bodiless
    304, so a router that polls every second reads next to nothing while nothing changed."""
    await _authorise_client(request)
    config, engine = request.app[CONFIG], _engine(request)
    if request.query.get("view") == "residency":
        view = adapters.render_residency(payloads.residency(config, engine))
        return _unless_unchanged(request, view)
    return _unless_unchanged(request, adapters.render_listing(payloads.listing(config, engine)))


def _unless_unchanged(request: web.Request, payload: dict[str, Any]) -> web.Response:
    """`payload` as JSON with its ETag, or a 304 when the client already has it."""
    body = json.dumps(payload).encode()
    etag = f'"{hashlib.blake2b(body, digest_size=12).hexdigest()}"'
    held = request.headers.get("If-None-Match", "")
    if etag in (t.strip().removeprefix("W/") for t in held.split(",")):
        return web.Response(status=304, headers={"ETag": etag})
    return web.Response(body=body, content_type="application/json", headers={"ETag": etag})


async def generate_images(request: web.Request) -> web.Response:
    await _authorise_client(request)
    engine = _engine(request)
    backend = engine.backend
    params, choice = api.parse_generation(
        await _json(request),
        base_model=request.app[CONFIG].model_id,
        default_size=backend.default_size,
        default_steps=backend.default_steps,
        default_guidance=backend.default_guidance,
    )
    record = None
    if choice.stack:
        record = await engine.admission.resolve_stack(choice.stack)
    elif choice.local_path is not None and choice.name is not None:
        record = await engine.admission.register_from_request(choice.name, choice.local_path)
    elif choice.name is not None:
        record = await engine.admission.resolve(choice.name, param=choice.param)
    transport = request.transport

    def client_gone() -> bool:
        return transport is None or transport.is_closing()

    images = await engine.generate(params, record, abandoned=client_gone)
    # PNG, base64 and JSON take tens of milliseconds per large image: off the event loop, so
    # other requests keep being admitted and answered while the next batch runs.
    body = await asyncio.to_thread(encode_images, images, int(time.time()))
    headers = served_headers(record, request.app[CONFIG].model_id)
    # This pod's queue as the answer leaves (this request no longer in it): a router learns it
    # with every answer, between its polls (docs/routing.md).
    headers[answers.QUEUE] = answers.render_queue(engine.queue_length())
    return web.Response(body=body, content_type="application/json", headers=headers)


def encode_images(images: Sequence[GeneratedImage], created: int) -> bytes:
    """The OpenAI Images answer for `images`, as JSON bytes (any thread: touches nothing shared)."""
    data = []
    for generated in images:
        buffer = io.BytesIO()
        generated.image.save(buffer, format="PNG")
        data.append(
            {
                "b64_json": base64.b64encode(buffer.getvalue()).decode("ascii"),
                "revised_prompt": None,
                "seed": generated.seed,
            }
        )
    return json.dumps({"created": created, "data": data}).encode()


def served_headers(record: AdapterRecord | None, base_model: str) -> dict[str, str]:
    """What the images were made with: `x-lora-model`, the adapter's name on this server (a
    rollout's canary: its alias; a stack: its members at their scales) or the base model's id,
    and `x-lora-revision`, the sha256 of the adapter's weights (a stack's: of its members')."""
    if record is None:
        return answers.served(base_model, None)
    return answers.served(record.name, record.sha256)


async def playground_page(request: web.Request) -> web.Response:
    """The playground (lora_playground): it calls the API above, as any client does."""
    return web.Response(body=playground.page(), headers=playground.headers())


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    _engine(request)
    return web.json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    engine = _started(request.app)
    if engine is not None:
        engine.update_fleet_gauges()
    return prometheus.exposition(request.app[METRICS].registry)


def create_app(
    config: ServerConfig,
    *,
    backend: Backend | None = None,
    load: Callable[[], Backend] | None = None,
) -> web.Application:
    """The server's application around `backend`, a pipeline already loaded (a simulated one,
    or one tests share), or the one `load` returns (blocking; run on a thread at startup, so
    /health answers meanwhile): exactly one of the two."""
    if (backend is None) == (load is None):
        raise TypeError("create_app takes exactly one of backend= and load=")
    config.check()
    app = web.Application(middlewares=[error_middleware], client_max_size=1024**2)
    app[CONFIG] = config
    app[TOKENS] = tokens_mod.Tokens.of(
        config.admin_token, config.client_token, config.admin_token_file, config.client_token_file
    )
    if config.operator_service_account is not None and config.pod_namespace is not None:
        reviewer = tokenreview.TokenReviewer(
            tokenreview.ApiServer.in_cluster(),
            audience=podauth.audience(config.pod_namespace),
            user=podauth.service_account_user(*config.operator_service_account.split("/", 1)),
        )
        app[TOKENS].reviewer = reviewer
        app.on_cleanup.append(lambda _: reviewer.close())
    app[METRICS] = Metrics()
    if config.simulate:
        app[METRICS].simulated.labels(config.simulate).set(1)
    app[STARTED_AT] = time.time()
    app.router.add_post("/v1/load_lora_adapter", load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_adapter)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/adapters", list_adapters)
    app.router.add_post("/v1/images/generations", generate_images)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", playground_page)
    app.cleanup_ctx.append(lambda app: _engine_lifecycle(app, backend, load))
    return app


async def _engine_lifecycle(
    app: web.Application, backend: Backend | None, load: Callable[[], Backend] | None
) -> AsyncIterator[None]:
    config = app[CONFIG]

    async def start() -> Engine:
        if backend is not None:
            loaded = backend
        elif load is not None:
            loaded = await asyncio.to_thread(load)
        else:  # create_app refuses it
            raise TypeError("no backend")
        engine = Engine(loaded, config, app[METRICS])
        try:
            await engine.start()
        except BaseException:
            await engine.stop()
            raise
        log.info("ready: %s (%s) on %s", config.model_id, loaded.family, config.device)
        return engine

    app[STARTUP] = asyncio.create_task(start(), name="engine-startup")
    yield
    task = app[STARTUP]
    if not task.done():
        task.cancel()
    try:
        engine = await task
    except (asyncio.CancelledError, Exception):
        return
    await engine.stop()
