"""`GET /v1/adapters` as a router polls it, over real HTTP on 127.0.0.1: the compact residency
view says what the full listing says (both as `lora_podapi.adapters` reads them), and an
unchanged listing is a bodiless 304."""

from __future__ import annotations

from lora_podapi import adapters

from tests.unit.inference.conftest import Assets, Server


async def test_the_residency_view_and_its_304(server: Server, assets: Assets) -> None:
    await server.load("pixel", assets.adapter_a)
    await server.load("idle", assets.adapter_b)
    await server.image(model="pixel", seed=1)
    async with server.session.get(server.url("/v1/adapters")) as resp:
        full = await resp.json()
    url = server.url("/v1/adapters?view=residency")
    async with server.session.get(url) as resp:
        assert resp.status == 200
        etag = resp.headers["ETag"]
        compact = await resp.json()
    by_tier = {t: sorted(a["id"] for a in full["data"] if a["tier"] == t) for t in ("gpu", "cpu")}
    assert {t: sorted(compact[t]) for t in ("gpu", "cpu")} == by_tier
    assert sorted(compact["gpu"] + compact["cpu"] + compact["disk"]) == ["idle", "pixel"]
    for key in ("model", "max_loras", "max_cpu_loras", "num_requests_waiting"):
        assert compact[key] == full[key]
    listing = adapters.parse_listing(full)
    assert adapters.parse_residency(compact) == listing.residency()
    assert adapters.render_listing(listing) == full  # rendered by the same definition
    assert compact["api_version"] == full["api_version"] == adapters.VERSION
    async with server.session.get(url, headers={"If-None-Match": etag}) as resp:
        assert resp.status == 304 and resp.headers["ETag"] == etag
        assert await resp.read() == b""
    await server.image(model="idle", seed=1)  # residency moves: a new ETag, a whole answer
    async with server.session.get(url, headers={"If-None-Match": etag}) as resp:
        assert resp.status == 200 and resp.headers["ETag"] != etag
        assert "idle" in (await resp.json())["gpu"]
