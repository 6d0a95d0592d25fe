"""Fixtures: LoRA-shaped safetensors bytes, a real HTTP origin, and the CRD on the cluster.

Staging tests bind 127.0.0.1 themselves and never use the devcluster fixture; the CRD and
operator tests do.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio
from aiohttp import web
from diffusers import DiffusionPipeline
from lora_devcluster.harness import Harness
from lora_inference.tools.tiny_models import write_tiny_model
from safetensors.numpy import save

from tests.operator.cluster import MODEL_NAME, Models, Operator, readable_by_pods

CRD = Path(__file__).resolve().parents[2] / "crds" / "lora.dev_loraadapters.yaml"


@pytest.fixture(scope="session")
def crd(devcluster: Any) -> Any:
    """The cluster with the LoRAAdapter CRD installed and established."""
    devcluster.kubectl("apply", "-f", str(CRD))
    devcluster.kubectl(
        "wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s"
    )
    return devcluster


def lora_bytes(seed: int = 0, rank: int = 4) -> bytes:
    """A small peft-style LoRA safetensors file, as bytes."""
    rng = np.random.default_rng(seed)
    tensors = {
        "unet.down.0.attn.to_q.lora_A.weight": rng.standard_normal((rank, 32)).astype(np.float32),
        "unet.down.0.attn.to_q.lora_B.weight": rng.standard_normal((32, rank)).astype(np.float32),
    }
    return save(tensors)


def not_lora_bytes() -> bytes:
    """A valid safetensors file holding a full weight, not a LoRA."""
    return save({"unet.conv_in.weight": np.zeros((4, 4), dtype=np.float32)})


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


Handler = Callable[[web.Request], web.StreamResponse]


@dataclass
class Origin:
    """A real aiohttp server on 127.0.0.1; tests add routes as path -> handler."""

    base: str = ""
    routes: dict[str, Handler] = field(default_factory=dict)
    hits: dict[str, int] = field(default_factory=dict)

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    def serve_bytes(self, path: str, data: bytes) -> str:
        async def handler(request: web.Request) -> web.StreamResponse:
            return web.Response(body=data, content_type="application/octet-stream")

        self.routes[path] = handler
        return self.url(path)


@pytest_asyncio.fixture
async def origin() -> AsyncIterator[Origin]:
    state = Origin()

    async def dispatch(request: web.Request) -> web.StreamResponse:
        state.hits[request.path] = state.hits.get(request.path, 0) + 1
        handler = state.routes.get(request.path)
        if handler is None:
            raise web.HTTPNotFound()
        return await handler(request)  # type: ignore[misc,no-any-return]

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", dispatch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    # Plain http on loopback: tests build HttpsSource directly; parse_source's https-only rule
    # is tested on its own in test_sources.py.
    state.base = f"http://127.0.0.1:{port}"
    try:
        yield state
    finally:
        await runner.cleanup()


# ---- the operator on the local cluster (tests/operator/test_operator_*.py)


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    root = tmp_path_factory.mktemp("models")
    write_tiny_model(root / MODEL_NAME, "sd15")
    readable_by_pods(root)
    pipe = DiffusionPipeline.from_pretrained(str(root / MODEL_NAME))
    return Models(root=root, pipe=pipe)


@pytest.fixture
def volume(tmp_path: Path) -> Path:
    v = tmp_path / "volume"
    v.mkdir()
    return v


@pytest.fixture
def operator(
    crd: None, devcluster: Harness, devcluster_namespace: str, volume: Path, tmp_path: Path
) -> Iterator[Operator]:
    op = Operator(volume=volume, namespaces=[devcluster_namespace], log_path=tmp_path / "op.log")
    with op.running():
        yield op
