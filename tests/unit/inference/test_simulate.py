"""The simulated GPU (`lora-inference serve --simulate`): its cost function, the real server
around it charging a miss its first use and a hit nothing, the same answers and errors as the
real server on every endpoint the operator and the router use, and a process that serves
without importing torch."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession
from aiohttp.test_utils import TestServer
from lora_inference.app import create_app
from lora_inference.backend import Backend, BatchPath
from lora_inference.config import ServerConfig
from lora_inference.simulate import backend as sim_backend
from lora_inference.simulate import profile as sim_profile
from lora_inference.simulate.profile import Profile, ProfileError, load_profile

from tests.unit.inference.bad_adapters import BadAdapter
from tests.unit.inference.conftest import ADMIN_TOKEN, Assets, Server

PROFILE = Profile(
    name="test",
    family="StableDiffusionXLPipeline",
    size=1024,
    steps=20,
    guidance=5.0,
    generation_s=((1, 1.0), (4, 2.5)),
    merged_factor=1.0,
    adapter_factor=1.1,
    mixed_per_adapter=0.25,
    unet_mb_per_rank=2.0,
    text_encoders_mb_per_rank=1.0,
    first_use_s_per_mb=0.01,
    slot_copy_s_per_mb=0.002,
)

# What a simulated pod cannot refuse: it has no model to check shapes against and does not read
# the weights' values (docs/inference-server.md says so).
NEEDS_THE_MODEL = {"wrong-shapes", "te-mismatch", "unknown-module", "nan-weights", "inf-weights"}


# -- the cost function (pure) ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("images", "seconds"),
    [(1, 1.0), (2, 1.5), (4, 2.5), (8, 4.5), (0, 1.0)],
    ids=["measured-1", "between", "measured-4", "beyond", "none"],
)
def test_a_base_call_follows_the_measured_points(images: int, seconds: float) -> None:
    assert PROFILE.base_call_s(images) == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("path", "adapters", "factor"),
    [
        ("base", 0, 1.0),
        ("merged", 1, 1.0),
        ("adapter", 1, 1.1),
        ("mixed", 2, 1.5),
        ("mixed", 4, 2.0),
    ],
)
def test_a_call_costs_its_path(path: Any, adapters: int, factor: float) -> None:
    call = PROFILE.call_s(4, path=path, adapters=adapters, steps=20, width=1024, height=1024)
    assert call == pytest.approx(2.5 * factor)


def test_a_call_scales_with_steps_and_pixels() -> None:
    call = PROFILE.call_s(1, path="base", adapters=0, steps=10, width=512, height=1024)
    assert call == pytest.approx(1.0 * 0.5 * 0.5)


def test_a_first_use_is_the_read_and_the_copy_by_size() -> None:
    mb = PROFILE.adapter_mb(64, text_encoders=False)
    assert mb == 128 and PROFILE.adapter_mb(64, text_encoders=True) == 192
    assert PROFILE.read_s(mb) == pytest.approx(128 * 0.008)
    assert PROFILE.copy_s(mb) == pytest.approx(128 * 0.002)
    assert PROFILE.first_use_s(mb) == pytest.approx(1.28)


def test_the_no_miss_bound_is_every_pod_running_hits() -> None:
    assert PROFILE.no_miss_images_per_s(16) == pytest.approx(16.0)
    assert PROFILE.no_miss_images_per_s(2, batch=4) == pytest.approx(2 * 4 / 2.5)


# What bench/gpu_engine.sh measured (docs/benchmarks.md): per profile, base-model calls by images
# per call, and 4-image calls by path at 20 steps, whose ratios both profiles take.
MEASURED_BASE = {"h200-sdxl-20step": {1: 1.074, 4: 3.62}, "h200-sdxl-4step": {1: 0.345, 4: 1.186}}
MEASURED_20_STEP_4_IMAGES: list[tuple[BatchPath, int, float]] = [
    ("base", 0, 3.62),
    ("merged", 1, 3.65),
    ("mixed", 4, 4.18),
]


@pytest.mark.parametrize("name", ["h200-sdxl-20step", "h200-sdxl-4step"])
def test_the_bundled_profiles_say_what_the_gpu_measured(name: str) -> None:
    profile = load_profile(name)
    raw = json.loads((sim_profile.PROFILES / f"{name}.json").read_text())
    assert raw["provenance"]["measured"] and raw["provenance"]["commands"]
    for images, measured in MEASURED_BASE[name].items():
        assert profile.base_call_s(images) == pytest.approx(measured, rel=0.005)
    base = MEASURED_BASE[name][4]
    for path, adapters, measured in MEASURED_20_STEP_4_IMAGES:
        call = profile.call_s(4, path=path, adapters=adapters, steps=profile.steps, width=1024,
                              height=1024)  # fmt: skip
        assert call / base == pytest.approx(measured / 3.62, rel=0.01), (path, call)
    # bench/gpu_miss_costs.py and the growth table: rank-64 adapters of 186 MB (UNet) or 237 MB,
    # first uses 362-611 ms (median 489.5), a copy into a slot 9.3 ms whatever the size.
    assert profile.adapter_mb(64, text_encoders=False) == pytest.approx(186, rel=0.01)
    assert profile.adapter_mb(64, text_encoders=True) == pytest.approx(237, rel=0.01)
    for mb in (186, 237):
        assert 0.362 <= profile.first_use_s(mb) <= 0.611
        assert profile.copy_s(mb) == pytest.approx(0.0093, rel=0.15)
    assert profile.first_use_s(211.5) == pytest.approx(0.4895, rel=0.01)


def test_an_unknown_profile_names_the_bundled_ones(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="h200-sdxl-20step"):
        load_profile("no-such-gpu")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"name": "bad"}))
    with pytest.raises(ProfileError, match="not a simulation profile"):
        load_profile(str(bad))


# -- one Protocol, two backends -------------------------------------------------------------------


def test_the_simulated_backend_is_a_backend() -> None:
    """mypy checks the assignment: the simulated backend satisfies `backend.Backend` (the
    diffusers pipeline's fixtures are typed as one where the app is given them)."""
    backend: Backend = sim_backend.SimulatedBackend(PROFILE)
    assert backend.family == f"{PROFILE.family}, simulated as {PROFILE.name}"


def test_the_app_is_given_its_backend_and_picks_none(config: ServerConfig) -> None:
    """The CLI (or a test) passes the backend, or how to load one; the app never picks one."""
    backend = sim_backend.SimulatedBackend(PROFILE)
    with pytest.raises(TypeError, match="exactly one"):
        create_app(config)
    with pytest.raises(TypeError, match="exactly one"):
        create_app(config, backend=backend, load=lambda: backend)


# -- the real server around a simulated pipeline ---------------------------------------------------


class Charges:
    """A sleep that counts instead of waiting."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def __call__(self, seconds: float) -> None:
        self.calls.append(seconds)


@pytest_asyncio.fixture
async def start_simulated(config: ServerConfig) -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[TestServer, ClientSession]] = []

    async def start(
        profile: Profile = PROFILE, sleep: Callable[[float], None] | None = None, **overrides: Any
    ) -> tuple[Server, sim_backend.SimulatedBackend]:
        backend = sim_backend.SimulatedBackend(profile, sleep=sleep or Charges())
        app = create_app(replace(config, simulate=profile.name, **overrides), backend=backend)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        session = ClientSession()
        started.append((server, session))
        live = Server(server, session, app)
        await live.wait_ready()
        return live, backend

    yield start
    for server, session in started:
        await session.close()
        await server.close()


async def test_a_miss_takes_the_first_use_and_a_hit_does_not(
    start_simulated: Callable[..., Any], assets: Assets
) -> None:
    server, backend = await start_simulated()
    await server.load("a", assets.adapter_a)  # read into the CPU tier: the first use's read
    rank = (await server.get("/v1/adapters"))[1]["data"][0]["rank"]
    mb = PROFILE.adapter_mb(rank, text_encoders=False)
    assert backend.charged == {"read": pytest.approx(PROFILE.read_s(mb))}
    call = PROFILE.call_s(1, path="merged", adapters=1, steps=2, width=32, height=32)

    await server.image(model="a")  # a miss: copied into a slot, then generated
    assert backend.charged["copy"] == pytest.approx(PROFILE.copy_s(mb))
    assert backend.charged["read"] + backend.charged["copy"] == pytest.approx(
        PROFILE.first_use_s(mb)
    )
    assert backend.charged["generation"] == pytest.approx(call)
    assert server.metric("lora_adapter_lookups_total", result="miss") == 1

    before = dict(backend.charged)
    await server.image(model="a")  # a hit: the generation only
    assert backend.charged["read"] == before["read"]
    assert backend.charged["copy"] == before["copy"]
    assert backend.charged["generation"] == pytest.approx(before["generation"] + call)
    assert server.metric("lora_adapter_lookups_total", result="hit") == 1


async def test_a_simulated_pod_says_so_and_names_what_it_served(
    start_simulated: Callable[..., Any], assets: Assets
) -> None:
    server, _ = await start_simulated()
    await server.load("a", assets.adapter_a)
    _, models = await server.get("/v1/models")
    assert models["data"][0]["simulated"] == PROFILE.name
    assert server.metric("lora_simulated_gpu", profile=PROFILE.name) == 1
    one = await server.image(model="a", seed=3)
    assert (one == await server.image(model="a", seed=3)).all()  # deterministic
    assert not (one == await server.image(model="a", seed=4)).all()
    assert not (one == await server.image(seed=3)).all()  # the base model draws another


async def _answers(server: Server, bad: list[BadAdapter], assets: Assets) -> dict[str, Any]:
    """What a server answers to every call the operator and the router make, good and bad."""

    def error(status: int, body: Any) -> Any:
        return (status, body["error"]["type"], body["error"]["param"]) if status != 200 else 200

    out: dict[str, Any] = {}
    for b in bad:
        if b.name not in NEEDS_THE_MODEL:
            out[f"load {b.name}"] = error(
                *await server.post(
                    "/v1/load_lora_adapter", {"lora_name": b.name, "lora_path": str(b.path)}
                )
            )
    load = {"lora_name": "a", "lora_path": str(assets.adapter_a)}
    out["load"] = error(*await server.post("/v1/load_lora_adapter", load))
    out["load again"] = error(*await server.post("/v1/load_lora_adapter", load))
    out["load in place"] = error(
        *await server.post("/v1/load_lora_adapter", {**load, "load_inplace": True})
    )
    out["load, no token"] = error(*await server.post("/v1/load_lora_adapter", load, token=None))
    out["load, not JSON"] = error(*await server.post("/v1/load_lora_adapter", "{"))
    gen = {"prompt": "p", "size": "32x32", "num_inference_steps": 2}
    for label, body in (
        ("generate a", {**gen, "model": "a"}),
        ("generate base", gen),
        ("generate unknown", {**gen, "model": "nope"}),
        ("generate stack", {**gen, "lora": [{"name": "a", "scale": 0.5}]}),
        ("generate bad size", {**gen, "model": "a", "size": "7x7"}),
        ("generate no prompt", {"model": "a"}),
    ):
        out[label] = error(*await server.post("/v1/images/generations", body, token=None))
    status, models = await server.get("/v1/models")
    out["models"] = (status, [(c["id"], c["parent"], c.get("sha256")) for c in models["data"]])
    status, adapters = await server.get("/v1/adapters")
    out["adapters"] = (status, sorted((a["id"], a["tier"]) for a in adapters["data"]))
    out["unload"] = error(*await server.post("/v1/unload_lora_adapter", {"lora_name": "a"}))
    out["unload again"] = error(*await server.post("/v1/unload_lora_adapter", {"lora_name": "a"}))
    for path in ("/health", "/ready"):
        out[path] = (await server.get(path))[0]
    return out


async def test_a_simulated_pod_answers_as_the_real_server_does(
    start_server: Callable[..., Any],
    start_simulated: Callable[..., Any],
    bad_adapters: list[BadAdapter],
    assets: Assets,
) -> None:
    real = await _answers(await start_server(), bad_adapters, assets)
    simulated, _ = await start_simulated()
    assert await _answers(simulated, bad_adapters, assets) == real


async def test_a_queue_that_is_full_answers_429(
    start_simulated: Callable[..., Any], assets: Assets
) -> None:
    slow = replace(PROFILE, size=32, generation_s=((1, 2.0),))
    server, _ = await start_simulated(slow, sleep=time.sleep, max_queue=1, max_batch_size=1)
    body = {"prompt": "p", "size": "32x32", "num_inference_steps": 20}
    answers = await asyncio.gather(
        *(server.post("/v1/images/generations", body, token=None) for _ in range(4))
    )
    assert sorted(status for status, _ in answers)[-1] == 429


async def test_each_answer_counts_the_queue_it_leaves_behind(
    start_simulated: Callable[..., Any],
) -> None:
    """`x-lora-queue`: the requests waiting and running as an answer leaves, itself not counted
    (what routers read between their polls)."""
    slow = replace(PROFILE, size=32, generation_s=((1, 0.3),))
    server, _ = await start_simulated(slow, sleep=time.sleep, max_batch_size=1)
    body = {"prompt": "p", "size": "32x32", "num_inference_steps": 20}

    async def queue_left() -> int:
        async with server.session.post(server.url("/v1/images/generations"), json=body) as r:
            assert r.status == 200, await r.text()
            return int(r.headers["x-lora-queue"])

    assert sorted(await asyncio.gather(*(queue_left() for _ in range(3)))) == [0, 1, 2]
    assert await queue_left() == 0


# -- a process that serves without torch ---------------------------------------------------------

# What a simulated server must never import: the frameworks, and the real pipeline's modules.
HEAVY = ("torch", "diffusers", "peft", "transformers")
REAL = ("lora_inference.pipeline", "lora_inference.parsing", "lora_inference.slots")
# The CLI, which writes to the file named by its first argument what it imported of those when
# it exits (atexit: after `serve` has answered SIGTERM and stopped).
SERVE = (
    "import atexit, json, sys; out = sys.argv.pop(1); "
    "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(m for m in sys.modules "
    f"if m.split('.')[0] in {HEAVY!r} or m.startswith({REAL!r}))))); "
    "from lora_inference.cli import main; sys.exit(main(sys.argv[1:]))"
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_simulated_server_serves_without_importing_torch(
    assets: Assets, tmp_path: Path
) -> None:
    """`serve --simulate` loads adapters, serves a stack and an adapter, its card and its
    metric, and when it stops it has imported neither torch nor the real pipeline."""
    port = _free_port()
    env = {**os.environ, "LORA_ADMIN_TOKEN": ADMIN_TOKEN}
    imported = tmp_path / "imported.json"
    args = [str(imported), "serve", "--simulate", "h200-sdxl-4step", "--model", str(assets.model)]
    args += ["--allowed-root", str(assets.root), "--host", "127.0.0.1", "--port", str(port)]
    log = (tmp_path / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-c", SERVE, *args], stdout=log, stderr=log, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        async with ClientSession() as session:
            for _ in range(600):
                try:
                    async with session.get(f"{base}/ready") as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    pass
                assert proc.poll() is None, (tmp_path / "server.log").read_text()
                await asyncio.sleep(0.1)
            headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
            for name, path in (("a", assets.adapter_a), ("b", assets.adapter_b)):
                load = {"lora_name": name, "lora_path": str(path)}
                async with session.post(
                    f"{base}/v1/load_lora_adapter", json=load, headers=headers
                ) as r:
                    assert r.status == 200, await r.text()
            members = [{"name": "b", "scale": 1.0}, {"name": "a", "scale": 0.5}]
            stack = {"prompt": "p", "lora": members, "size": "64x64"}
            async with session.post(f"{base}/v1/images/generations", json=stack) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-lora-model"] == "a*0.5+b*1"
            async with session.post(
                f"{base}/v1/images/generations", json={**stack, "lora": None, "model": "a"}
            ) as r:
                assert r.status == 200, await r.text()
                assert r.headers["x-lora-model"] == "a" and len(r.headers["x-lora-revision"]) == 64
            async with session.get(f"{base}/v1/models") as r:
                assert (await r.json())["data"][0]["simulated"] == "h200-sdxl-4step"
            async with session.get(f"{base}/metrics") as r:
                assert 'lora_simulated_gpu{profile="h200-sdxl-4step"} 1.0' in await r.text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert "Traceback" not in (tmp_path / "server.log").read_text()
    assert proc.returncode == 0, (tmp_path / "server.log").read_text()
    assert json.loads(imported.read_text()) == []


def test_an_unknown_profile_stops_the_server_before_it_starts(
    assets: Assets, tmp_path: Path
) -> None:
    args = [str(tmp_path / "imported.json"), "serve", "--simulate", "nope"]
    proc = subprocess.run(
        [sys.executable, "-c", SERVE, *args, "--model", str(assets.model)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "LORA_ADMIN_TOKEN": ADMIN_TOKEN},
    )
    assert proc.returncode == 2 and "h200-sdxl-4step" in proc.stderr, proc.stderr
