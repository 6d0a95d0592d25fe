"""Fixtures for the inference server: a tiny SD 1.5 model, adapters for it, and a live server.

The model and its pipeline are built once per session (building takes seconds); each test gets
a fresh engine and HTTP server on 127.0.0.1 around the shared pipeline, and the engine removes
its adapters from the pipeline when it stops. `browser` is headless Chromium for the playground.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import io
import shutil
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pytest
import pytest_asyncio
import torch
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from diffusers import DiffusionPipeline
from lora_inference.app import create_app
from lora_inference.config import ServerConfig
from lora_inference.pipeline import DiffusionBackend, load_backend
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model
from lora_volume.targeting import Target
from PIL import Image
from selenium import webdriver
from selenium.webdriver.chrome.service import Service

ADMIN_TOKEN = "test-admin-token"
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


@dataclass(frozen=True)
class Assets:
    model: Path
    root: Path  # the allowed root holding the adapters below
    adapter_a: Path  # peft directory, UNet only
    adapter_b: Path  # peft directory, UNet + text encoder
    kohya: Path  # single kohya file, UNet + text encoder


class BatchShape(TypedDict):
    """`DiffusionBackend.run_batch`'s image keywords, for the tests that pass them as `**shape`."""

    width: int
    height: int
    steps: int
    guidance_scale: float


@pytest.fixture(scope="session")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Assets:
    base = tmp_path_factory.mktemp("inference")
    model = write_tiny_model(base / "tiny-sd15", "sd15")
    pipe = DiffusionPipeline.from_pretrained(str(model))
    root = base / "adapters"
    a = write_random_adapter(root / "a", pipe, base_model=model.name, seed=1)
    b = write_random_adapter(root / "b", pipe, base_model=model.name, seed=2, text_encoder=True)
    kohya = write_random_adapter(
        root / "k.safetensors", pipe, base_model=model.name, seed=3, fmt="kohya", text_encoder=True
    )
    return Assets(model=model, root=root, adapter_a=a, adapter_b=b, kohya=kohya)


@pytest.fixture(scope="session")
def backend(assets: Assets) -> DiffusionBackend:
    return DiffusionBackend.load(assets.model, device="cpu", dtype=torch.float32)


@pytest.fixture
def config(assets: Assets) -> ServerConfig:
    return ServerConfig(
        model=assets.model,
        allowed_roots=(assets.root,),
        admin_token=ADMIN_TOKEN,
        max_loras=2,
        max_cpu_loras=4,
        max_batch_size=4,
    )


class Server:
    """A live server on 127.0.0.1 and an HTTP session to it."""

    def __init__(self, server: TestServer, session: ClientSession, app: web.Application) -> None:
        self.server = server
        self.session = session
        self.app = app

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def wait_ready(self) -> None:
        for _ in range(600):
            status, _ = await self.get("/ready")
            if status == 200:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("server did not become ready")

    async def post(
        self, path: str, body: Any, *, token: str | None = ADMIN_TOKEN
    ) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.post(self.url(path), json=body, headers=headers) as resp:
            text = await resp.text()
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, text

    async def get(self, path: str, *, token: str | None = None) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        async with self.session.get(self.url(path), headers=headers) as resp:
            return resp.status, await resp.json(content_type=None)

    async def load(self, name: str, path: Path, **extra: Any) -> None:
        status, body = await self.post(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra}
        )
        assert status == 200, body

    async def image(self, **body: Any) -> np.ndarray:
        """Generate one image and return its pixels; fails the test on any error. A field given
        as None is left out of the request (the server's default)."""
        request = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 7}
        request.update(body)
        request = {k: v for k, v in request.items() if v is not None}
        status, payload = await self.post("/v1/images/generations", request, token=None)
        assert status == 200, payload
        return decode(payload["data"][0]["b64_json"])

    def metric(self, name: str, **labels: str) -> float:
        """The current value of one Prometheus sample of this server (0 when absent)."""
        value = self.engine.metrics.registry.get_sample_value(name, labels)
        return float(value or 0.0)

    @property
    def engine(self) -> Any:
        from lora_inference.app import STARTUP

        return self.app[STARTUP].result()


@contextlib.asynccontextmanager
async def serving(model: Path, root: Path) -> AsyncIterator[Server]:
    """A real server on `model` over HTTP, adapters allowed from `root`."""
    config = ServerConfig(model=model, allowed_roots=(root,), admin_token=ADMIN_TOKEN, max_loras=4)
    app = create_app(config, load=functools.partial(load_backend, config))
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    async with ClientSession() as session:
        live = Server(server, session, app)
        try:
            await live.wait_ready()
            yield live
        finally:
            await server.close()


def publish(root: Path, name: str, adapter: Path, target: Target | None = None) -> None:
    """Lay `adapter` out on `root` as the operator does, with its target when given."""
    revision = root / name / "revisions" / ("0" * 64)
    revision.parent.mkdir(parents=True, exist_ok=True)
    revision.symlink_to(adapter)
    if target is not None:
        (root / name / "target.json").write_text(target.to_json())
    (root / name / "current").symlink_to("revisions/" + "0" * 64)


STALL_S = 10.0  # how long a stalled read waits at most if the test never lets it go


class Stall:
    """Wraps a function so that calls for one path block their thread until `release()`."""

    def __init__(self, real: Callable[..., Any], stalled: Callable[[Any], bool]) -> None:
        self._real = real
        self._stalled = stalled
        self.started = threading.Event()
        self.finished = threading.Event()
        self._released = threading.Event()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._stalled(args):
            return self._real(*args, **kwargs)
        self.started.set()
        self._released.wait(STALL_S)
        try:
            return self._real(*args, **kwargs)
        finally:
            self.finished.set()

    def release(self) -> None:
        self._released.set()

    async def wait_started(self) -> None:
        async with asyncio.timeout(2 * STALL_S):  # longer than a stall, so a blocked loop
            while not self.started.is_set():  # fails on the assertions below, saying why
                await asyncio.sleep(0.005)


def decode(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


Reference = Callable[..., np.ndarray]


@pytest.fixture(scope="session")
def reference(assets: Assets) -> Reference:
    """Images made the way diffusers users make them, on a pipeline of their own.

    `load_lora_weights` + `set_adapters`, then the call `Server.image` makes (its defaults: the
    prompt, 32x32, 2 steps, seed 7, SD 1.5's guidance 7.5); no adapter means the base model.
    """
    pipe = DiffusionPipeline.from_pretrained(str(assets.model))
    pipe.set_progress_bar_config(disable=True)
    for component in pipe.components.values():
        if isinstance(component, torch.nn.Module):
            component.eval()

    def render(
        adapter: Path | None = None,
        scale: float | dict[str, Any] = 1.0,
        *,
        seed: int = 7,
        steps: int = 2,
        stack: Sequence[tuple[Path, float]] = (),
    ) -> np.ndarray:
        """`stack`: several adapters at their scales, through diffusers' own `set_adapters`;
        `scale` may be its per-component, per-block form ({"unet": {"down": 0.5}, ...})."""
        loras = [(adapter, scale)] if adapter is not None else []
        loras += stack
        names = [f"reference{i}" for i in range(len(loras))]
        for name, (path, _) in zip(names, loras, strict=True):
            pipe.load_lora_weights(str(path), adapter_name=name)
        if loras:
            pipe.set_adapters(names, [s for _, s in loras])
        try:
            with torch.inference_mode():
                image = pipe(
                    ["a lighthouse"],
                    generator=[torch.Generator().manual_seed(seed)],
                    num_inference_steps=steps,
                    guidance_scale=7.5,
                    height=32,
                    width=32,
                ).images[0]
        finally:
            if loras:
                pipe.unload_lora_weights()
        return np.asarray(image.convert("RGB"))

    return render


ServerFactory = Callable[..., Any]


@pytest_asyncio.fixture
async def start_server(
    backend: DiffusionBackend, config: ServerConfig
) -> AsyncIterator[Callable[..., Awaitable[Server]]]:
    """Start servers around the shared pipeline; keyword arguments override the config."""
    started: list[tuple[TestServer, ClientSession]] = []

    async def start(**overrides: Any) -> Server:
        app = create_app(replace(config, **overrides), backend=backend)
        server = TestServer(app, host="127.0.0.1")
        await server.start_server()
        session = ClientSession()
        started.append((server, session))
        live = Server(server, session, app)
        await live.wait_ready()
        return live

    yield start
    for server, session in started:
        await session.close()
        await server.close()


@pytest_asyncio.fixture
async def server(start_server: Callable[..., Awaitable[Server]]) -> Server:
    return await start_server()


@pytest.fixture(scope="session")
def bad_adapters(assets: Assets, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    from tests.unit.inference.bad_adapters import write_bad_adapters

    outside = tmp_path_factory.mktemp("outside")
    return write_bad_adapters(assets.root / "bad", assets.adapter_a, assets.adapter_b, outside)


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    """Headless Chromium (Debian's, driven by its chromedriver), for the playground's tests."""
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are missing: run `make install`")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1000,1150"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
