"""The operator's calls to an inference pod, over real HTTP on 127.0.0.1: what is retried."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from lora_operator.edges import config
from lora_operator.edges.podclient import PodClient, PodError
from lora_operator.edges.podtokens import AdminToken, BoundTokens
from lora_operator.rules import model, planning

SHA = "c" * 64


@pytest_asyncio.fixture
async def pod() -> AsyncIterator[tuple[model.PodInfo, dict[str, Any]]]:
    seen: dict[str, Any] = {"status": 200}

    async def load(request: web.Request) -> web.Response:
        seen["body"] = await request.json()
        seen["auth"] = request.headers.get("Authorization")
        seen["accept"] = request.headers.get("Accept")
        if seen["status"] != 200:
            return web.json_response({"error": {"message": "wrong shapes"}}, status=seen["status"])
        if "card" in seen:
            return web.json_response(seen["card"])
        return web.Response(text="Success: LoRA adapter 'a' added successfully.")

    async def unload(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "not loaded"}}, status=404)

    async def models(_: web.Request) -> web.Response:
        seen["models"] = seen.get("models", 0) + 1
        return web.json_response(seen.get("answer", {"data": [{"id": "b", "parent": None}]}))

    app = web.Application()
    app.router.add_post("/v1/load_lora_adapter", load)
    app.router.add_post("/v1/unload_lora_adapter", unload)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    info = model.pod_info(
        {
            "metadata": {
                "namespace": "ns",
                "name": "p",
                "annotations": {"lora.dev/port": str(port)},
            },
            "status": {"podIP": "127.0.0.1"},
        }
    )
    yield info, seen
    await runner.cleanup()


async def test_load_sends_the_pods_path_token_scale_and_pin(pod: Any) -> None:
    info, seen = pod
    async with PodClient(AdminToken("s3cret"), timeout_s=5) as client:
        await client.load(info, planning.Want("a", SHA, -1.5, True), inplace=True)
        assert (await client.models(info)).base_model == "b"
        await client.unload(info, "gone")  # 404: already gone is fine
    assert seen["auth"] == "Bearer s3cret"
    assert seen["body"] == {
        "lora_name": "a",
        "lora_path": f"/var/lib/lora/adapters/ns/a/revisions/{SHA}",
        "load_inplace": True,
        "pinned": True,
        "scale": -1.5,
    }


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        pytest.param(None, None, id="vllm-text"),
        pytest.param(
            {
                "id": "a",
                "parent": "b",
                "root": "a",
                "adapter": "a",
                "revision": SHA,
                "scale": 0.5,
                "pinned": False,
                "hits": 3,
            },
            planning.Card("a", SHA, 0.5, False, hits=3, adapter="a"),
            id="card",
        ),
        pytest.param(
            {"id": "other", "parent": "b", "adapter": "other", "revision": SHA},
            None,
            id="another-adapters-card",
        ),
        pytest.param({"id": "a", "parent": None}, None, id="a-base-card"),
        pytest.param({"data": []}, None, id="not-a-card"),
    ],
)
async def test_a_load_returns_the_card_the_pod_answers_with(
    pod: Any, answer: dict[str, Any] | None, expected: planning.Card | None
) -> None:
    # Asked for JSON, this project's server answers a load with the adapter's card; anything
    # else (vLLM's text, a card that is not this adapter's) is no answer, and the caller reads.
    info, seen = pod
    if answer is not None:
        seen["card"] = answer
    async with PodClient(AdminToken(None), timeout_s=5) as client:
        card = await client.load(info, planning.Want("a", SHA, 0.5, False), inplace=False)
    assert seen["accept"] == "application/json"
    assert card == expected


@pytest.mark.parametrize(
    ("status", "permanent"),
    [(422, True), (401, False), (503, False), (429, False)],
    ids=["refused", "token-rotating", "unavailable", "overloaded"],
)
async def test_refusals_are_permanent_and_overload_transient(
    pod: Any, status: int, permanent: bool
) -> None:
    info, seen = pod
    seen["status"] = status
    async with PodClient(AdminToken(None), timeout_s=5) as client:
        with pytest.raises(PodError) as e:
            await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
    assert e.value.permanent is permanent
    assert "wrong shapes" in e.value.message


async def test_a_rotated_token_file_is_sent_from_the_next_call(pod: Any, tmp_path: Path) -> None:
    info, seen = pod
    token = tmp_path / "token"
    token.write_text("old\n")
    async with PodClient(AdminToken("old", token), timeout_s=5) as client:
        await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        assert seen["auth"] == "Bearer old"
        # The kubelet swaps the file; mid-swap, an empty file keeps the token in use.
        token.write_text("")
        await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        assert seen["auth"] == "Bearer old"
        token.write_text("new-token\n")
        await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        assert seen["auth"] == "Bearer new-token"


class Minter:
    """The TokenRequest API as BoundTokens sees it (our seam): counts what it was asked."""

    def __init__(self, lifetime_s: float = 3600) -> None:
        self.asked: list[tuple[str, str, str, int]] = []
        self.lifetime_s = lifetime_s

    async def request_token(
        self, namespace: str, service_account: str, audience: str, seconds: int
    ) -> tuple[str, float]:
        self.asked.append((namespace, service_account, audience, seconds))
        return f"jwt-{audience}-{len(self.asked)}", self.lifetime_s


async def test_bound_tokens_are_per_namespace_renewed_and_dropped_on_a_401() -> None:
    minter = Minter(lifetime_s=900)
    now = [1000.0]

    async def api() -> Minter:
        return minter

    tokens = BoundTokens(api, "lora", "rel-operator", lifetime_s=3600, clock=lambda: now[0])
    a1 = await tokens.header("team-a")
    assert a1 == {"Authorization": "Bearer jwt-lora.dev/inference/team-a-1"}
    assert minter.asked == [("lora", "rel-operator", "lora.dev/inference/team-a", 3600)]
    # Many calls at once for one namespace: one TokenRequest.
    import asyncio

    headers = await asyncio.gather(*(tokens.header("team-b") for _ in range(20)))
    assert len(minter.asked) == 2 and len({h["Authorization"] for h in headers}) == 1
    assert await tokens.header("team-a") == a1
    # The API server gave 900 s: renewed after two thirds of that, not of the 3600 asked.
    now[0] += 599
    assert await tokens.header("team-a") == a1
    now[0] += 2
    assert await tokens.header("team-a") != a1
    assert len(minter.asked) == 3
    tokens.rejected("team-a")
    await tokens.header("team-a")
    assert len(minter.asked) == 4


async def test_a_pod_gets_its_own_namespaces_token_and_a_401_renews_it(pod: Any) -> None:
    info, seen = pod
    minter = Minter()

    async def api() -> Minter:
        return minter

    async with PodClient(BoundTokens(api, "lora", "op"), timeout_s=5) as client:
        await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        assert seen["auth"] == "Bearer jwt-lora.dev/inference/ns-1"
        seen["status"] = 401
        with pytest.raises(PodError):
            await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        seen["status"] = 200
        await client.load(info, planning.Want("a", SHA, 1.0, False), inplace=False)
        assert seen["auth"] == "Bearer jwt-lora.dev/inference/ns-2"


async def test_no_token_to_be_had_is_a_transient_pod_error(pod: Any) -> None:
    from lora_operator.edges import kube

    info, _ = pod

    class Refusing:
        async def request_token(self, *_: Any) -> tuple[str, float]:
            raise kube.ApiError(403, "cannot create serviceaccounts/token")

    async def api() -> Refusing:
        return Refusing()

    async with PodClient(BoundTokens(api, "lora", "op"), timeout_s=5) as client:
        with pytest.raises(PodError) as e:
            await client.models(info)
    assert not e.value.permanent and "TokenRequest" in e.value.message


async def test_an_unreachable_pod_is_transient() -> None:
    info = model.pod_info(
        {
            "metadata": {"name": "p", "annotations": {"lora.dev/port": "1"}},
            "status": {"podIP": "127.0.0.1"},
        }
    )
    async with PodClient(AdminToken(None), timeout_s=2) as client:
        with pytest.raises(PodError) as e:
            await client.models(info)
    assert e.value.permanent is False


def test_config_reads_the_token_file_and_refuses_nonsense(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("abc\n")
    c = config.parse_args(
        ["--namespace", "a", "--namespace", "b", "--admin-token-file", str(token)]
    )
    assert (c.namespaces, c.admin_token, c.standalone) == (("a", "b"), "abc", True)
    assert config.parse_args(["--peering", "lora"]).standalone is False
    with pytest.raises(SystemExit):
        config.parse_args(["--max-concurrent-loads", "0"])


@pytest.mark.parametrize(
    "answer",
    [b"[" * 100_000 + b"]" * 100_000, b'{"data": [' + b"1," * 3_000_000 + b"1]}"],
    ids=["nesting-bomb", "too-many-values"],
)
async def test_a_pods_answer_is_parsed_within_bounds(answer: bytes) -> None:
    """A pod that answers /v1/models with a bomb costs the operator a transient error, not its
    stack or its memory."""

    async def models(_: web.Request) -> web.Response:
        return web.Response(body=answer, content_type="application/json")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    info = model.pod_info(
        {
            "metadata": {
                "name": "p",
                "annotations": {"lora.dev/port": str(runner.addresses[0][1])},
            },
            "status": {"podIP": "127.0.0.1"},
        }
    )
    try:
        async with PodClient(AdminToken(None), timeout_s=10) as client:
            with pytest.raises(PodError) as e:
                await client.models(info)
        assert not e.value.permanent
    finally:
        await runner.cleanup()


async def test_an_answer_the_same_as_the_last_is_that_report_again(
    pod: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod read every resync mostly answers what it did last time: its report is not parsed
    again; a changed answer is."""
    info, seen = pod
    card = {"id": "a", "parent": "b", "root": f"/adapters/ns/a/revisions/{SHA}"}
    parsed: list[object] = []
    parse = planning.parse_models

    def counting(payload: object) -> planning.PodReport:
        parsed.append(payload)
        return parse(payload)

    monkeypatch.setattr(planning, "parse_models", counting)
    async with PodClient(AdminToken(None), timeout_s=5) as client:
        first = await client.models(info)
        again = await client.models(info)
        assert again is first and len(parsed) == 1 and seen["models"] == 2
        seen["answer"] = {"data": [{"id": "b", "parent": None}, card]}
        changed = await client.models(info)
        assert changed is not first and len(parsed) == 2
        assert changed.holds("a") and not first.holds("a")
