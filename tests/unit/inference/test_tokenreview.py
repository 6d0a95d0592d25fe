"""The operator's tokens checked by TokenReview: the pure verdict, the cache and its bounds over
real HTTP against a TokenReview endpoint of our own (the real API server's answers are
exercised by every chart install on the local cluster), and the server's load endpoint behind
it."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from lora_inference import tokenreview
from lora_inference.app import TOKENS
from lora_inference.tokenreview import ApiServer, TokenReviewer
from lora_volume import podauth

from tests.unit.inference.conftest import Assets, Server

OPERATOR = podauth.service_account_user("lora", "rel-operator")
AUDIENCE = podauth.audience("team-a")


def jwt(subject: str, exp: float | None = None) -> str:
    def part(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    claims: dict[str, Any] = {"sub": subject}
    if exp is not None:
        claims["exp"] = exp
    return f"{part({'alg': 'RS256'})}.{part(claims)}.c2lnbmF0dXJl"


@dataclass
class ReviewApi:
    """A TokenReview endpoint: which token is whose, for which audiences."""

    known: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    asked: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str | None] = field(default_factory=list)
    status: int = 200
    delay_s: float = 0.0

    async def review(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.asked.append(body)
        self.auth.append(request.headers.get("Authorization"))
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"message": "unavailable"}, status=self.status)
        token, wanted = body["spec"]["token"], body["spec"]["audiences"]
        user, audiences = self.known.get(token, ("", []))
        shared = [a for a in audiences if a in wanted]
        status: dict[str, Any] = {"authenticated": bool(user) and bool(shared)}
        if status["authenticated"]:
            status |= {"user": {"username": user}, "audiences": shared}
        return web.json_response({"kind": "TokenReview", "status": status})


@pytest_asyncio.fixture
async def api(tmp_path: Path) -> AsyncIterator[tuple[ReviewApi, ApiServer]]:
    fake = ReviewApi()
    app = web.Application()
    app.router.add_post("/apis/authentication.k8s.io/v1/tokenreviews", fake.review)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    own = tmp_path / "own-token"
    own.write_text("pod-own-token\n")
    yield fake, ApiServer(f"http://127.0.0.1:{port}", own, None)
    await runner.cleanup()


def test_the_verdict_needs_authentication_the_user_and_the_audience() -> None:
    good = {"authenticated": True, "user": {"username": OPERATOR}, "audiences": [AUDIENCE]}
    assert tokenreview.accepted(good, AUDIENCE, OPERATOR)
    assert not tokenreview.accepted({**good, "authenticated": False}, AUDIENCE, OPERATOR)
    assert not tokenreview.accepted({**good, "user": {"username": "x"}}, AUDIENCE, OPERATOR)
    other = podauth.audience("team-b")
    assert not tokenreview.accepted({**good, "audiences": [other]}, AUDIENCE, OPERATOR)
    assert not tokenreview.accepted({**good, "audiences": None}, AUDIENCE, OPERATOR)
    assert tokenreview.looks_like_jwt(jwt("x"))
    for not_jwt in ("", "static-admin-token", "a.b", "a.b.c.d", "a.b$.c", "a." * 5000 + "b.c"):
        assert not tokenreview.looks_like_jwt(not_jwt)
    assert tokenreview.expiry(jwt("x", exp=1234.0)) == 1234.0
    assert tokenreview.expiry(jwt("x")) is None
    assert tokenreview.expiry("bm90IGpzb24.bm90IGpzb24.c2ln") is None


async def test_the_operators_token_for_this_namespace_only(api: Any) -> None:
    fake, server = api
    token, elsewhere, stranger = jwt("op"), jwt("op-b"), jwt("stranger")
    fake.known = {
        token: (OPERATOR, [AUDIENCE]),
        elsewhere: (OPERATOR, [podauth.audience("team-b")]),
        stranger: ("system:serviceaccount:team-a:default", [AUDIENCE]),
    }
    reviewer = TokenReviewer(server, audience=AUDIENCE, user=OPERATOR)
    try:
        assert await reviewer.allows(token)
        assert not await reviewer.allows(elsewhere)  # bound to another namespace
        assert not await reviewer.allows(stranger)  # a tenant's pod's own token
        assert not await reviewer.allows("static-admin-token")  # never asked
        assert [a["spec"]["audiences"] for a in fake.asked] == [[AUDIENCE]] * 3
        assert set(fake.auth) == {"Bearer pod-own-token"}  # asked as the pod itself
    finally:
        await reviewer.close()


async def test_verdicts_are_kept_bounded_and_asked_once_at_a_time(api: Any) -> None:
    fake, server = api
    token = jwt("op")
    fake.known = {token: (OPERATOR, [AUDIENCE])}
    now = [1000.0]
    reviewer = TokenReviewer(server, audience=AUDIENCE, user=OPERATOR, clock=lambda: now[0])
    try:
        fake.delay_s = 0.2
        results = await asyncio.gather(*(reviewer.allows(token) for _ in range(50)))
        assert all(results) and len(fake.asked) == 1
        fake.delay_s = 0
        now[0] += tokenreview.ACCEPTED_TTL_S - 1
        assert await reviewer.allows(token) and len(fake.asked) == 1
        now[0] += 2
        assert await reviewer.allows(token) and len(fake.asked) == 2
        # A refusal is kept for a short while only, and at most MAX_ENTRIES verdicts are kept.
        bogus = [jwt(f"bogus-{i}") for i in range(tokenreview.MAX_ENTRIES + 10)]
        for b in bogus:
            assert not await reviewer.allows(b)
        asked = len(fake.asked)
        assert not await reviewer.allows(bogus[-1]) and len(fake.asked) == asked
        assert not await reviewer.allows(bogus[0]) and len(fake.asked) == asked + 1  # evicted
        now[0] += tokenreview.REFUSED_TTL_S + 1
        assert not await reviewer.allows(bogus[-1]) and len(fake.asked) == asked + 2
    finally:
        await reviewer.close()


async def test_a_token_is_not_trusted_past_its_own_expiry(api: Any) -> None:
    fake, server = api
    now = [1000.0]
    token = jwt("op", exp=1010.0)
    fake.known = {token: (OPERATOR, [AUDIENCE])}
    reviewer = TokenReviewer(server, audience=AUDIENCE, user=OPERATOR, clock=lambda: now[0])
    try:
        assert await reviewer.allows(token)
        now[0] = 1011.0
        fake.known = {}  # the API server no longer accepts it
        assert not await reviewer.allows(token) and len(fake.asked) == 2
    finally:
        await reviewer.close()


async def test_an_api_server_that_cannot_answer_refuses_for_now(api: Any) -> None:
    fake, server = api
    token = jwt("op")
    fake.known = {token: (OPERATOR, [AUDIENCE])}
    reviewer = TokenReviewer(server, audience=AUDIENCE, user=OPERATOR)
    try:
        fake.status = 503
        assert not await reviewer.allows(token)
        fake.status = 200
        assert await reviewer.allows(token)  # the refusal was not kept
        down = TokenReviewer(
            ApiServer("http://127.0.0.1:1", server.token_file, None),
            audience=AUDIENCE,
            user=OPERATOR,
        )
        assert not await down.allows(token)
        await down.close()
    finally:
        await reviewer.close()


def test_outside_a_pod_the_server_refuses_to_start_saying_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lora_inference.cli import build_parser, token_problem

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    args = build_parser().parse_args(
        ["serve", "--model", "m", "--operator-service-account", "lora/op", "--pod-namespace", "a"]
    )
    assert "KUBERNETES_SERVICE_HOST" in (token_problem(args) or "")


async def test_load_takes_the_operators_bound_token_and_refuses_another_namespaces(
    api: Any, start_server: Callable[..., Awaitable[Server]], assets: Assets
) -> None:
    fake, apiserver = api
    token, elsewhere = jwt("op"), jwt("op-b")
    fake.known = {
        token: (OPERATOR, [AUDIENCE]),
        elsewhere: (OPERATOR, [podauth.audience("team-b")]),
    }
    server = await start_server(admin_token=None, client_token="client-secret")
    reviewer = TokenReviewer(apiserver, audience=AUDIENCE, user=OPERATOR)
    server.app[TOKENS].reviewer = reviewer
    try:
        body = {"lora_name": "pixel", "lora_path": str(assets.adapter_a)}
        for given, expected in ((None, 401), (elsewhere, 401), ("client-secret", 401)):
            status, _ = await server.post("/v1/load_lora_adapter", body, token=given)
            assert status == expected, given
        status, _ = await server.post("/v1/load_lora_adapter", body, token=token)
        assert status == 200
        status, models = await server.get("/v1/models", token=token)  # the operator's reads
        assert status == 200 and "pixel" in {m["id"] for m in models["data"]}
        assert (await server.get("/v1/models", token=elsewhere))[0] == 401
    finally:
        await reviewer.close()
