"""The router over real HTTP, in front of stand-in pods that fail in the ways real ones do:
answers pass through unchanged, bodies are bounded, a connection that fails before the answer is
retried once on another pod, nothing hangs, and a pod that is not Ready gets nothing."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import math
import time
import zlib
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import lora_playground as playground
import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer, unused_port
from lora_router.__main__ import serve
from lora_router.app import create_app
from lora_router.fleet import AdapterPlacement, Endpoint, Fleet, Report, Split
from lora_router.proxy import BUFFERED_ANSWER_BYTES
from lora_router.routing import Residency
from lora_router.state import STATE, ProxyState

from tests.support.http import free_port
from tests.support.stand_ins import Pod, StartBackend, pods
from tests.unit.router.conftest import ROUTER_CONFIG, StartRouter, listed


def generation(model: str = "x") -> dict[str, Any]:
    return {"model": model, "prompt": "a lighthouse"}


async def test_answers_and_requests_pass_through_unchanged(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    payload = json.dumps(generation())
    async with router.session.post(
        router.url("/v1/images/generations?x=1"),
        data=payload,
        headers={"Authorization": "Bearer t", "Content-Type": "application/json"},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["x-lora-pod"] == "a"
        echo = await resp.json()
    assert echo == {
        "pod": "a",
        "method": "POST",
        "path": "/v1/images/generations?x=1",
        "authorization": "Bearer t",
        "body": payload,
    }
    async with router.session.post(
        router.url("/v1/images/generations?status=418"), json=generation()
    ) as resp:
        assert resp.status == 418
        assert resp.headers["X-Upstream"] == "yes"
        assert (await resp.json())["error"]["message"] == "teapot"
    async with router.session.post(
        router.url("/v1/images/generations?big=5000000"), json=generation()
    ) as resp:
        assert resp.status == 200
        assert await resp.read() == b"\x01\x02" * 2_500_000
    assert router.metric("lora_router_requests_total", reason="unplaced", code="418") == 1


async def test_request_bodies_are_bounded(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router(max_body_bytes=1000)
    pod = Pod("a")
    await pods(start_backend, router, pod)
    big = {"model": "x", "prompt": "p" * 2000}
    async with router.session.post(router.url("/v1/images/generations"), json=big) as resp:
        assert resp.status == 413
        error = (await resp.json())["error"]
    assert error["code"] == 413 and "1000 bytes" in error["message"]
    assert pod.calls == Counter()


@pytest.mark.parametrize("failure", ["reset", "refused"])
async def test_a_connection_that_fails_before_the_answer_is_retried_once_elsewhere(
    start_router: StartRouter, start_backend: StartBackend, failure: str
) -> None:
    router = await start_router()
    good = Pod("good")
    addresses = await pods(start_backend, router, good, Pod("bad", gpu=("x",), mode="reset"))
    if failure == "refused":
        addresses["bad"] = f"127.0.0.1:{free_port()}"  # nobody listens
        router.set_pods(addresses)
    router.place("x", None)
    # The failing pod holds the adapter, for ever fresh: the router tries it first.
    residency = Residency(gpu=frozenset({"x"}), cpu=frozenset(), free_slot=False)
    router.fleet.reports["bad"] = Report(residency, queue=0, base_model=None, at=math.inf)
    async with router.session.post(router.url("/v1/images/generations"), json=generation()) as r:
        assert r.status == 200
        assert r.headers["x-lora-pod"] == "good"
    assert router.metric("lora_router_retries_total") == 1
    assert good.calls["/v1/images/generations"] == 1


async def test_when_the_retry_fails_too_the_answer_is_a_clear_503(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a", mode="reset"), Pod("b", mode="reset"))
    async with router.session.post(router.url("/v1/images/generations"), json=generation()) as r:
        assert r.status == 503
        assert r.headers["Retry-After"] == "1"
        error = (await r.json())["error"]
    assert error["code"] == 503
    assert "a:" in error["message"] and "b:" in error["message"]
    assert router.metric("lora_router_retries_total") == 1  # once, not more


async def test_a_pod_that_leaves_the_endpoints_while_a_request_waits_is_given_up_on(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    stuck, other = Pod("stuck", mode="hang"), Pod("other")
    addresses = await pods(start_backend, router, stuck)
    addresses["other"] = await start_backend(other.app())
    request = asyncio.ensure_future(
        router.session.post(router.url("/v1/images/generations"), json=generation())
    )
    await router.wait_until("the stuck call", lambda: stuck.calls["/v1/images/generations"] > 0)
    router.set_pods({"other": addresses["other"]})  # the pod was deleted
    async with await request as resp:
        assert resp.status == 200
        assert resp.headers["x-lora-pod"] == "other"
    assert router.metric("lora_router_upstream_failures_total", kind="gone") == 1
    stuck.release.set()


async def test_an_answer_broken_midway_ends_the_clients_connection(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a", mode="midstream"))
    with pytest.raises(aiohttp.ClientPayloadError):
        async with router.session.post(
            router.url("/v1/images/generations"), json=generation()
        ) as resp:
            await resp.read()
    assert router.metric("lora_router_upstream_failures_total", kind="midstream") == 1


async def test_a_pod_that_is_not_ready_gets_nothing(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    pod = Pod("a")
    await pods(start_backend, router, pod, ready=False)
    async with router.session.post(router.url("/v1/images/generations"), json=generation()) as r:
        assert r.status == 503
        assert "no inference pod is Ready" in (await r.json())["error"]["message"]
    assert pod.calls == Counter()


async def test_requests_go_where_the_adapter_is_resident_and_by_queue_without_reports(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    a, b = Pod("a", gpu=("x",)), Pod("b", gpu=("y",))
    await pods(start_backend, router, a, b)
    router.place("x", None)
    router.place("y", frozenset({"a", "b"}))
    await router.wait_reports({"a", "b"})
    for model, expected in (("x", "a"), ("y", "b")):
        async with router.session.post(
            router.url("/v1/images/generations"), json=generation(model)
        ) as r:
            assert (r.headers["x-lora-pod"], r.headers["x-lora-route"]) == (
                expected,
                "gpu-resident",
            )
    assert router.metric("lora_router_affinity_hits_total") == 2
    # Pod b stops reporting: once its report is stale, y is routed by queue alone.
    b.reporting = False
    a.reporting = False
    await router.wait_until(
        "both reports stale",
        lambda: all(x.residency is None for x in router.fleet.backends(time.monotonic())),
    )
    async with router.session.post(router.url("/v1/images/generations"), json=generation("y")) as r:
        assert r.status == 200 and r.headers["x-lora-route"] == "no-residency"


async def test_each_answer_tells_the_router_its_pods_queue(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    a = Pod("a", gpu=("x",))
    a.queue = (0, 0)
    await pods(start_backend, router, a)
    router.place("x", None)
    await router.wait_reports({"a"})
    a.answered_queue = 5  # another router's requests arrived since the poll
    async with router.session.post(router.url("/v1/images/generations"), json=generation("x")) as r:
        assert r.status == 200 and r.headers["x-lora-queue"] == "5"
    report = router.fleet.reports["a"]
    assert (report.queue, report.mine) == (5, 0)
    assert [b.load for b in router.fleet.backends(time.monotonic())] == [5]


async def test_a_stack_goes_where_its_first_member_is_resident(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a", gpu=("x",)), Pod("b", gpu=("y",)))
    router.place("x", None)
    router.place("y", None)
    await router.wait_reports({"a", "b"})
    for first, second, expected in (("x", "y", "a"), ("y", "x", "b")):
        body = {"prompt": "p", "lora": [{"name": first}, {"name": second, "scale": 0.5}]}
        async with router.session.post(router.url("/v1/images/generations"), json=body) as r:
            assert (r.headers["x-lora-pod"], r.headers["x-lora-route"]) == (
                expected,
                "gpu-resident",
            )


async def test_the_polls_carry_the_client_token_and_client_requests_only_their_own(
    start_router: StartRouter, start_backend: StartBackend, tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    router = await start_router(client_token_file=token)
    pod = Pod("a", gpu=("x",), token="s3cret")
    await pods(start_backend, router, pod)
    router.place("x", None)
    await router.wait_reports({"a"})
    url = router.url("/v1/images/generations")
    # Routed by residency either way; a client without the token gets the pod's own 401: the
    # router lends it nothing.
    async with router.session.post(url, json=generation()) as r:
        assert (r.status, r.headers["x-lora-route"]) == (401, "gpu-resident")
        assert (await r.json())["error"]["message"] == "needs the client token"
    client = {"Authorization": "Bearer s3cret"}
    async with router.session.post(url, json=generation(), headers=client) as r:
        assert (r.status, r.headers["x-lora-route"]) == (200, "gpu-resident")
        assert (await r.json())["authorization"] == "Bearer s3cret"
    async with router.session.get(router.url("/v1/models")) as r:
        assert r.status == 401
    async with router.session.get(router.url("/v1/models"), headers=client) as r:
        assert [c["id"] for c in (await r.json())["data"]] == ["base", "x"]
    assert router.metric("lora_router_report_failures_total") == 0

    # A rotated token is read again: refused until the file says the new one.
    pod.token = "rotated"
    refused = router.metric("lora_router_report_failures_total")
    await router.wait_until(
        "a refused poll", lambda: router.metric("lora_router_report_failures_total") > refused
    )
    token.write_text("rotated")
    written = time.monotonic()
    await router.wait_until(
        "a poll with the new token", lambda: router.fleet.reports["a"].at > written
    )


async def test_without_the_token_the_polls_are_refused_and_routing_is_by_queue(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a", gpu=("x",), token="s3cret"))
    router.place("x", None)
    await router.wait_until(
        "refused polls", lambda: router.metric("lora_router_report_failures_total") >= 3
    )
    assert router.fleet.reports == {}
    client = {"Authorization": "Bearer s3cret"}
    async with router.session.post(
        router.url("/v1/images/generations"), json=generation(), headers=client
    ) as r:
        assert (r.status, r.headers["x-lora-route"]) == (200, "no-residency")


async def test_per_pod_endpoints_are_not_routed(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    pod = Pod("a")
    await pods(start_backend, router, pod)
    async with router.session.post(router.url("/v1/load_lora_adapter"), json={}) as r:
        assert r.status == 404
        assert "per pod" in (await r.json())["error"]["message"]
    assert pod.calls == Counter()


async def test_the_playground_page_is_served_without_any_pod(start_router: StartRouter) -> None:
    router = await start_router()
    async with router.session.get(router.url("/")) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/html")
        assert await r.read() == playground.page()
        assert "frame-ancestors 'none'" in r.headers["Content-Security-Policy"]


async def test_models_are_the_union_of_the_pods_cards(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a", gpu=("x",)), Pod("b", gpu=("y", "x")))
    async with router.session.get(router.url("/v1/models")) as r:
        ids = [c["id"] for c in (await r.json())["data"]]
    assert ids == ["base", "x", "y"]


async def test_ready_only_once_the_api_has_been_listed() -> None:
    async def never(*_: Any) -> None:
        await asyncio.Event().wait()

    app = create_app(ROUTER_CONFIG, sources=[never])
    async with TestClient(TestServer(app)) as client:
        resp = await client.get("/ready")
        assert resp.status == 503
        assert "endpoints" in (await resp.json())["error"]["message"]
        assert (await client.get("/health")).status == 200


async def test_ready_only_once_every_listed_pod_has_been_polled(
    start_backend: StartBackend,
) -> None:
    pod = Pod("a", gpu=("x",))
    pod.report_gate = asyncio.Event()
    address = await start_backend(pod.app())

    async def lists_one_pod(fleet: Fleet, _: ProxyState) -> None:
        fleet.slices = {"slice": [Endpoint("a", address, True)]}
        fleet.synced.update({"endpoints", "adapters"})

    app = create_app(ROUTER_CONFIG, sources=[lists_one_pod])
    async with TestClient(TestServer(app)) as client:
        # Listed, but the pod has not answered its first poll: a restarted router would route
        # blind, so it stays out of the Service.
        for _ in range(5):
            resp = await client.get("/ready")
            assert resp.status == 503
            assert "residency" in (await resp.json())["error"]["message"]
            await asyncio.sleep(0.05)
        pod.report_gate.set()
        for _ in range(100):
            if (await client.get("/ready")).status == 200:
                break
            await asyncio.sleep(0.02)
        else:
            raise AssertionError("never Ready after the first poll")
        assert "a" in app[STATE].fleet.reports


async def test_not_alive_once_a_background_loop_has_raised() -> None:
    async def broken(*_: Any) -> None:
        raise RuntimeError("the watch broke")

    app = create_app(ROUTER_CONFIG, sources=[broken])
    async with TestClient(TestServer(app)) as client:
        for _ in range(100):
            resp = await client.get("/health")
            if resp.status != 200:
                break
            await asyncio.sleep(0.01)
        assert resp.status == 503
        message = (await resp.json())["error"]["message"]
        assert "broken" in message and "the watch broke" in message


async def test_the_load_gauge_is_the_queues_the_pods_report(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    a, b = Pod("a"), Pod("b")
    a.queue, b.queue = (2, 1), (0, 1)
    await pods(start_backend, router, a, b)
    await router.wait_until("a load of 4", lambda: router.metric("lora_router_load") == 4)
    a.queue = b.queue = (0, 0)
    await router.wait_until("no load", lambda: router.metric("lora_router_load") == 0)


async def test_a_stopping_router_answers_for_its_shutdown_delay_not_ready() -> None:
    config = replace(
        ROUTER_CONFIG, port=unused_port(), metrics_port=unused_port(), shutdown_delay_s=1.0
    )
    stop = asyncio.Event()
    serving = asyncio.create_task(serve(config, stop, sources=[listed]))
    url = f"http://127.0.0.1:{config.port}"
    async with ClientSession() as session:
        for _ in range(100):
            with contextlib.suppress(aiohttp.ClientConnectionError):
                async with session.get(f"{url}/ready") as r:
                    if r.status == 200:
                        break
            await asyncio.sleep(0.02)
        stop.set()
        await asyncio.sleep(0.1)
        # Draining: new connections are still answered, and /ready says it is leaving.
        async with session.get(f"{url}/ready") as r:
            assert r.status == 503
            assert "shutting down" in (await r.json())["error"]["message"]
        async with session.get(f"{url}/health") as r:
            assert r.status == 200
        assert not serving.done()
        await asyncio.wait_for(serving, timeout=10)
        with pytest.raises(aiohttp.ClientConnectionError):
            async with session.get(f"{url}/health"):
                pass


async def test_a_rollout_sends_its_weight_to_the_canary_on_the_pods_that_hold_it(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    canary, stable = "c" * 64, "5" * 64
    alias = f"x_{canary[:12]}"
    both, old_only = Pod("both", gpu=("x", alias)), Pod("old", gpu=("x",))
    await pods(start_backend, router, both, old_only)
    await router.wait_reports({"both", "old"})
    router.fleet.adapters["x"] = AdapterPlacement(
        "x", None, Split(alias=alias, weight=30, canary=canary, stable=stable)
    )
    models: Counter[tuple[str, str]] = Counter()
    for _ in range(200):
        request = {"lora": [{"name": "x", "scale": 0.5}, {"name": "y"}], "prompt": "p"}
        async with router.session.post(router.url("/v1/images/generations"), json=request) as resp:
            echo = await resp.json()
        sent = json.loads(echo["body"])
        assert sent["lora"][1] == {"name": "y"} and sent["lora"][0]["scale"] == 0.5
        models[(sent["lora"][0]["name"], echo["pod"])] += 1
    # Exactly the weight, every canary request on the pod that holds the alias.
    assert models[(alias, "both")] == 60 and models[(alias, "old")] == 0
    assert models[("x", "both")] + models[("x", "old")] == 140
    count = router.metric
    assert (
        count("lora_router_rollout_requests_total", adapter="x", revision=canary[:12], code="200")
        == 60
    )
    assert (
        count("lora_router_rollout_requests_total", adapter="x", revision=stable[:12], code="200")
        == 140
    )

    # The canary asked for by its alias (the playground lists it): the pod that holds it.
    for _ in range(5):
        async with router.session.post(
            router.url("/v1/images/generations"), json=generation(alias)
        ) as resp:
            assert (await resp.json())["pod"] == "both"
    assert (
        count("lora_router_rollout_requests_total", adapter="x", revision=canary[:12], code="200")
        == 65
    )

    # No Ready pod holds the canary (yet): the stable revision answers every request.
    both.gpu = ("x",)
    await router.wait_until(
        "the alias gone from the reports",
        lambda: all(not r.residency.holds(alias) for r in router.fleet.reports.values()),
    )
    for _ in range(10):
        async with router.session.post(
            router.url("/v1/images/generations"), json=generation("x")
        ) as resp:
            assert json.loads((await resp.json())["body"])["model"] == "x"


async def test_once_the_working_set_fits_every_pods_slots_requests_are_balanced(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    router.fleet.window = 4
    a, b = Pod("a", gpu=("x",)), Pod("b")
    a.queue, b.queue = (2, 0), (1, 0)
    await pods(start_backend, router, a, b)
    router.place("x", frozenset({"a", "b"}))
    await router.wait_reports({"a", "b"})
    routes = []
    for _ in range(4):
        async with router.session.post(
            router.url("/v1/images/generations"), json=generation("x")
        ) as r:
            assert r.status == 200
            routes.append((r.headers["x-lora-pod"], r.headers["x-lora-route"]))
    # Three requests do not yet say what the working set is: affinity; the fourth fills the
    # window, one adapter for two slots a pod: every pod can hold it, so the least queued.
    assert routes == [("a", "gpu-resident")] * 3 + [("b", "balanced")]


async def test_the_pods_answer_and_its_headers_pass_through_buffered_or_streamed(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    router = await start_router()
    await pods(start_backend, router, Pod("a"))
    for size in (1000, BUFFERED_ANSWER_BYTES + 2):
        async with router.session.post(
            router.url(f"/v1/images/generations?big={size}"), json=generation()
        ) as r:
            assert r.status == 200 and r.headers["x-lora-pod"] == "a"
            assert await r.read() == b"\x01\x02" * (size // 2)


async def raw_pod(answer: bytes) -> tuple[str, list[bytes], asyncio.Server]:
    """A pod that answers every request with `answer` and keeps each request's bytes."""
    received: list[bytes] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.partition(b":")[2])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                received.append(head + await reader.readexactly(length))
                if not head.startswith(b"GET /v1/adapters"):
                    writer.write(answer)
                else:
                    report = b'{"object": "list", "data": [], "max_loras": 2}'
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(report))
                    writer.write(report)
        writer.close()

    server = await asyncio.start_server(connection, "127.0.0.1", 0)
    return f"127.0.0.1:{server.sockets[0].getsockname()[1]}", received, server


@pytest.mark.parametrize("chunked", [False, True], ids=["own-server", "aiohttp"])
async def test_hop_by_hop_fields_and_those_connection_names_cross_neither_way(
    start_router: StartRouter, chunked: bool
) -> None:
    router = await start_router()
    address, received, pod = await raw_pod(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: X-Pod-Secret\r\n"
        b"X-Pod-Secret: 1\r\nKeep-Alive: timeout=5\r\nProxy-Authenticate: Basic\r\n"
        b"Trailer: X-Sum\r\nUpgrade: h2c\r\nX-Kept: answer\r\nContent-Length: 2\r\n\r\n{}"
    )
    router.set_pods({"a": address})
    body = json.dumps(generation()).encode()
    framing = (
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        if chunked
        else b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    request = (
        b"POST /v1/images/generations HTTP/1.1\r\nHost: router\r\n"
        b"Connection: X-Secret, close\r\nX-Secret: 1\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\n"
        b"Proxy-Authorization: Basic eDp5\r\nProxy-Connection: keep-alive\r\nX-Kept: request\r\n"
    ) + framing
    reader, writer = await asyncio.open_connection("127.0.0.1", router.site.port)
    writer.write(request)
    answer = await asyncio.wait_for(reader.read(), timeout=10)
    writer.close()
    pod.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    names = {line.partition(b":")[0].lower() for line in head.split(b"\r\n")[1:]}
    assert head.startswith(b"HTTP/1.1 200") and rest == b"{}" and b"x-kept" in names
    assert not names & {b"x-pod-secret", b"keep-alive", b"proxy-authenticate", b"trailer"}
    assert b"upgrade" not in names
    (sent,) = [r for r in received if r.startswith(b"POST")]
    sent_head, _, sent_body = sent.partition(b"\r\n\r\n")
    sent_names = {line.partition(b":")[0].lower() for line in sent_head.split(b"\r\n")[1:]}
    assert sent_body == body and b"x-kept" in sent_names
    assert not sent_names & {
        b"connection", b"x-secret", b"keep-alive", b"te", b"proxy-authorization",
        b"proxy-connection", b"transfer-encoding",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("coding", "decoded"), [("gzip", True), ("deflate", True), ("x-unknown", False)]
)
async def test_a_compressed_body_is_sent_decoded_without_its_coding_or_untouched_with_it(
    start_router: StartRouter, start_backend: StartBackend, coding: str, decoded: bool
) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "encoding": request.headers.get("Content-Encoding"),
                "body": (await request.read()).hex(),
            }
        )

    router = await start_router()
    app = web.Application()
    app.router.add_post("/v1/images/generations", echo)
    router.set_pods({"a": await start_backend(app), "b": await start_backend(app)})
    router.place("pixel-art", frozenset({"b"}))
    body = json.dumps(generation("pixel-art")).encode()
    sent = gzip.compress(body) if coding == "gzip" else zlib.compress(body)
    if not decoded:
        sent = b"\x00" + body  # bytes of a coding no one here knows
    async with router.session.post(
        router.url("/v1/images/generations"),
        data=sent,
        headers={"Content-Encoding": coding, "Content-Type": "application/json"},
        compress=None,
    ) as resp:
        assert resp.status == 200
        echoed = await resp.json()
        pod = resp.headers["x-lora-pod"]
    if decoded:
        # Decoded, the body names its adapter: the request goes where the adapter is placed.
        assert echoed == {"encoding": None, "body": body.hex()} and pod == "b"
    else:
        assert echoed == {"encoding": coding, "body": sent.hex()}


async def test_in_a_release_of_two_base_models_a_request_reaches_only_pods_of_its_model(
    start_router: StartRouter, start_backend: StartBackend
) -> None:
    """Each model's pods behind a Service of their own: an adapter's requests, and a request for
    a base model by name, go only to pods of that model, even when the other model's pods are
    idle, hold a same-named adapter, or are all that is Ready."""
    router = await start_router()
    sdxl, sd15 = Pod("sdxl-0", gpu=("pixel",)), Pod("sd15-0", gpu=("pixel", "ink"))
    addresses = {p.name: await start_backend(p.app()) for p in (sdxl, sd15)}
    router.fleet.slices = {
        "sdxl-abc": [Endpoint("sdxl-0", addresses["sdxl-0"], True, frozenset({"sdxl-base"}))],
        "sd15-abc": [Endpoint("sd15-0", addresses["sd15-0"], True, frozenset({"sd15"}))],
    }
    router.app[STATE].endpoints_changed()
    router.fleet.adapters["pixel"] = AdapterPlacement("pixel", None, base_model="sdxl-base")
    router.fleet.adapters["ink"] = AdapterPlacement("ink", None, base_model="sd15")
    await router.wait_reports({"sdxl-0", "sd15-0"})
    url = router.url("/v1/images/generations")
    for _ in range(8):  # the least-queued pod would otherwise alternate
        for name, expected in (("pixel", "sdxl-0"), ("ink", "sd15-0"), ("sd15", "sd15-0")):
            async with router.session.post(url, json=generation(name)) as r:
                assert r.status == 200 and r.headers["x-lora-pod"] == expected, name
    assert sdxl.calls["/v1/images/generations"] == 8 and sd15.calls["/v1/images/generations"] == 16
    # The SDXL pod leaves: its adapter is refused with the reason, never sent to the SD 1.5 pod.
    router.fleet.slices["sdxl-abc"] = []
    router.app[STATE].endpoints_changed()
    async with router.session.post(url, json=generation("pixel")) as r:
        assert r.status == 503
        assert (
            "no inference pod of base model sdxl-base is Ready"
            in (await r.json())["error"]["message"]
        )
    assert sd15.calls["/v1/images/generations"] == 16
