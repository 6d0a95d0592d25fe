"""The Hub stand-in under the real client: examples/model-sdxl.yaml's command and environment
(`hf download` with its exclude patterns, HF_HUB_OFFLINE=0) run against a tiny diffusers
pipeline served by tests/support/hubstandin.py, and the folder that arrives loads as the server
loads its model. With the image's own HF_HUB_OFFLINE=1 the same command fails at once, before
any request; with a token set on the stand-in, only the right bearer token downloads."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web
from lora_inference.pipeline import DiffusionBackend
from lora_inference.tools.tiny_models import write_tiny_model

from tests.support import ROOT, hubstandin, modeljob

REPO_ID = "lora-test/tiny-sd15"
HF = Path(sys.executable).parent / "hf"
# Files a Hub repository of SDXL also holds, each left out by one of the example's patterns.
EXTRAS = {
    "unet/diffusion_pytorch_model.fp16.safetensors": "*.fp16.*",
    "text_encoder/model.onnx": "*.onnx*",
    "text_encoder/model.onnx_data": "*.onnx*",
    "unet/diffusion_flax_model.msgpack": "*.msgpack",
    "unet/diffusion_pytorch_model.bin": "*.bin",
    "sd_xl_base_1.0.safetensors": "sd_xl_*.safetensors",
    "text_encoder/openvino_model.xml": "*openvino*",
}


@dataclass(frozen=True)
class Repo:
    folder: Path
    pipeline_files: frozenset[str]  # what write_tiny_model wrote: all of it must arrive


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Repo:
    folder = write_tiny_model(tmp_path_factory.mktemp("hub") / "tiny-sd15", "sd15")
    written = frozenset(_files(folder))
    for i, name in enumerate(EXTRAS):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(os.urandom(64) + bytes([i]))
    return Repo(folder, written)


@dataclass
class Hub:
    url: str
    log: hubstandin.Log


async def _serve(folder: Path, token: str | None) -> AsyncIterator[Hub]:
    app = hubstandin.create_app(hubstandin.Repository.from_folder(REPO_ID, folder), token)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield Hub(f"http://127.0.0.1:{port}", app[hubstandin.LOG])
    finally:
        await runner.cleanup()


@pytest.fixture
async def hub(repo: Repo) -> AsyncIterator[Hub]:
    async for h in _serve(repo.folder, None):
        yield h


@pytest.fixture
async def gated_hub(repo: Repo) -> AsyncIterator[Hub]:
    async for h in _serve(repo.folder, "hf_right"):
        yield h


@dataclass(frozen=True)
class Run:
    code: int
    output: str


async def download(hub: Hub, target: Path, home: Path, env: dict[str, str] | None = None) -> Run:
    """The example Job's command and literal environment, on this machine: the repository and
    the folder replaced, HF_ENDPOINT the stand-in's, `env` on top."""
    job = modeljob.of_kind(modeljob.example(), "Job")
    command = modeljob.command_for(job, REPO_ID, str(target))
    # Nothing of this machine's Hub settings or caches: only what the Job sets.
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("HF_") and k not in ("XDG_CACHE_HOME", "HUGGINGFACE_HUB_CACHE")
    }
    job_env = {**modeljob.literal_env(job), "HOME": str(home), "HF_ENDPOINT": hub.url}
    extra = {"HF_HUB_DISABLE_TELEMETRY": "1", "NO_COLOR": "1"}
    proc = await asyncio.create_subprocess_exec(
        str(HF),
        *command[1:],
        env={**base, **job_env, **extra, **(env or {})},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=120)
    assert proc.returncode is not None
    return Run(proc.returncode, out.decode(errors="replace"))


def _files(folder: Path) -> Iterator[str]:
    for p in folder.rglob("*"):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and not rel.startswith(".cache/"):
            yield rel


def test_the_extras_are_what_the_examples_patterns_name() -> None:
    """Every exclude pattern of the example is exercised by one file here, and no file of the
    pipeline matches one (so the fixture's split is the example's)."""
    patterns = modeljob.excludes(modeljob.of_kind(modeljob.example(), "Job"))
    assert sorted(set(EXTRAS.values())) == sorted(patterns)
    for name, pattern in EXTRAS.items():
        assert fnmatch.fnmatch(name, pattern), (name, pattern)


async def test_the_jobs_download_arrives_byte_for_byte_and_loads(
    repo: Repo, hub: Hub, tmp_path: Path
) -> None:
    target = tmp_path / "models" / "tiny-sd15"
    run = await download(hub, target, tmp_path / "home")
    assert run.code == 0, run.output
    arrived = set(_files(target))
    assert arrived == set(repo.pipeline_files), (arrived ^ repo.pipeline_files, run.output)
    for name in arrived:
        assert (target / name).read_bytes() == (repo.folder / name).read_bytes(), name
    assert not set(EXTRAS) & arrived
    # Every file came over HTTP from the stand-in (HEAD, then GET), none of the excluded ones.
    fetched = {
        path.split("/resolve/", 1)[1].split("/", 1)[1]
        for method, path, _ in hub.log.requests
        if method == "GET" and "/resolve/" in path
    }
    assert fetched == set(repo.pipeline_files)
    # The folder is a model the server loads, as it loads its own at start.
    backend = await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: DiffusionBackend.load(target, device="cpu", dtype=torch.float32, slots=1),
    )
    assert backend.family == "StableDiffusionPipeline"


async def test_the_images_offline_default_fails_at_once(hub: Hub, tmp_path: Path) -> None:
    """What the Job did before it set HF_HUB_OFFLINE=0: the image's ENV makes the client
    offline, so it fails without one request, and nothing is written."""
    dockerfile = (ROOT / "docker" / "inference.Dockerfile").read_text()
    assert "HF_HUB_OFFLINE=1" in dockerfile
    target = tmp_path / "models" / "tiny-sd15"
    run = await download(hub, target, tmp_path / "home", {"HF_HUB_OFFLINE": "1"})
    assert run.code != 0, run.output
    assert "offline mode is enabled" in run.output, run.output
    assert hub.log.requests == []
    assert not target.exists() or list(_files(target)) == []


@pytest.mark.parametrize(
    ("token", "downloads"),
    [(None, False), ("hf_wrong", False), ("hf_right", True)],
    ids=["no-token", "wrong-token", "right-token"],
)
async def test_a_gated_repository_needs_the_token(
    repo: Repo, gated_hub: Hub, tmp_path: Path, token: str | None, downloads: bool
) -> None:
    target = tmp_path / "models" / "tiny-sd15"
    env = {"HF_TOKEN": token} if token else {}
    run = await download(gated_hub, target, tmp_path / "home", env)
    # The repository's requests (the CLI also asks the Hub for its agent registry).
    asked = [allowed for _, path, allowed in gated_hub.log.requests if REPO_ID in path]
    assert asked, run.output
    if downloads:
        assert run.code == 0, run.output
        assert set(_files(target)) == set(repo.pipeline_files)
        assert all(asked)
        return
    assert run.code != 0, run.output
    assert "requires approval" in run.output, run.output
    assert not target.exists() or list(_files(target)) == []
    assert not any(asked)


async def test_the_stand_in_answers_as_the_hub_does(repo: Repo, hub: Hub) -> None:
    """The pieces the client relies on, asked directly: unknown repositories and revisions,
    the LFS headers, a resumed range, and no Xet header anywhere."""
    name = "unet/diffusion_pytorch_model.safetensors"
    body = (repo.folder / name).read_bytes()
    async with aiohttp.ClientSession(hub.url) as s:
        async with s.get(f"/api/models/{REPO_ID}/revision/main") as r:
            info = await r.json()
        sha = info["sha"]
        assert len(sha) == 40 and {"rfilename": name} in info["siblings"]
        async with s.get("/api/models/other/repo/revision/main") as r:
            assert (r.status, r.headers["X-Error-Code"]) == (404, "RepoNotFound")
        async with s.get(f"/api/models/{REPO_ID}/revision/v9") as r:
            assert (r.status, r.headers["X-Error-Code"]) == (404, "RevisionNotFound")
        async with s.get(f"/api/models/{REPO_ID}/tree/{sha}", params={"recursive": "True"}) as r:
            tree = await r.json()
        files = {e["path"]: e for e in tree if e["type"] == "file"}
        assert set(files) == set(repo.pipeline_files) | set(EXTRAS)
        assert files[name]["lfs"]["size"] == len(body) and "xetHash" not in files[name]
        async with s.head(f"/{REPO_ID}/resolve/{sha}/{name}") as r:
            assert r.status == 200
            assert r.headers["X-Repo-Commit"] == sha
            assert r.headers["X-Linked-Size"] == r.headers["Content-Length"] == str(len(body))
            assert r.headers["X-Linked-Etag"].strip('"') == files[name]["lfs"]["oid"]
            assert not [h for h in r.headers if h.lower().startswith("x-xet")]
        async with s.get(f"/{REPO_ID}/resolve/main/{name}", headers={"Range": "bytes=10-"}) as r:
            assert r.status == 206 and await r.read() == body[10:]
        async with s.head(f"/{REPO_ID}/resolve/main/model_index.json") as r:
            assert (
                "X-Linked-Etag" not in r.headers
                and r.headers["ETag"].strip('"') == (files["model_index.json"]["oid"])
            )
