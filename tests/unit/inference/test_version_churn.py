"""Adapter versions that change while requests wait for them, over real HTTP on the tiny SD 1.5
pipeline: every admitted request is answered, by the version it was admitted with.

The first tests set each interleaving up by hand (a long base-model request holds the pipeline
while the adapter is unloaded, loaded again and pushed out of the CPU tier). The stress tests
race load, unload and `load_inplace` churn against generations from several clients while a
second process keeps the CPU busy, so that the worker, the reads and the admin calls interleave
in every order; each request has a deadline, so a request that is never answered fails the test
at once instead of hanging the suite.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import random
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lora_inference import residency
from lora_inference.adapters.registry import AdapterRecord, Registry
from lora_inference.backend import ParsedAdapter
from lora_inference.config import ServerConfig
from lora_inference.metrics import Metrics
from lora_inference.reader import new_record

from tests.unit.inference.conftest import Assets, Server, decode

ANSWER_S = 30.0  # far longer than any answer takes here: reaching it means a request was lost


@contextlib.asynccontextmanager
async def deadline(what: object) -> AsyncIterator[None]:
    """Fail the test, naming `what`, if the block takes `ANSWER_S`: a lost request or a hung
    worker fails at once, not at the suite's limit."""
    try:
        async with asyncio.timeout(ANSWER_S):
            yield
    except TimeoutError:
        raise AssertionError(f"no answer within {ANSWER_S:.0f} s: {what}") from None


async def generate(server: Server, **body: Any) -> tuple[int, Any, str | None]:
    """One generation's status, body and `x-lora-revision`, within the deadline."""
    request = {"prompt": "a lighthouse", "size": "32x32", "num_inference_steps": 2, "seed": 7}
    request.update(body)
    url = server.url("/v1/images/generations")
    async with deadline(f"generation {request}"), server.session.post(url, json=request) as resp:
        return resp.status, await resp.json(content_type=None), resp.headers.get("x-lora-revision")


async def pipeline_busy(server: Server) -> asyncio.Task[Any]:
    """A long base-model request, running: requests sent now wait in the queue behind it."""
    blocker = asyncio.create_task(server.image(num_inference_steps=40, seed=2))
    async with deadline("the long request starting"):
        while not server.engine._pipeline_lock.locked():
            await asyncio.sleep(0.005)
    return blocker


async def queued(server: Server, count: int) -> None:
    async with deadline(f"{count} requests queued"):
        while len(server.engine._queue) < count:
            await asyncio.sleep(0.005)


# -- residency alone: versions held, retired and dropped ----------------------------------------


class Slots:
    """The pipeline's slots as residency sees them (`backend.SlotPipeline`): names only."""

    def __init__(self) -> None:
        self.filled: dict[str, str] = {}

    def place(self, slot: str, adapter: ParsedAdapter) -> None:
        self.filled[slot] = adapter.sha256

    def clear(self, slot: str) -> None:
        self.filled.pop(slot, None)


class Versions:
    """One engine's residency with one GPU slot and one CPU place, without a pipeline: reads
    return a parse at once and count themselves; `woken` counts the worker's wake-ups."""

    def __init__(self) -> None:
        self.registry = Registry()
        self.reads = 0
        self.woken = 0
        self.slots = Slots()

        async def in_pipeline(fn: Callable[..., Any], *args: Any) -> Any:
            return fn(*args)

        async def read(path: Path, name: str) -> ParsedAdapter:
            self.reads += 1
            await asyncio.sleep(0)  # a read ends on a later turn of the loop, as a real one does
            return parsed_for(path)

        async def compose(members: Any, parts: Any) -> ParsedAdapter:
            raise AssertionError("no stacks here")

        def wake() -> None:
            self.woken += 1

        self.residency = residency.Residency(
            self.slots,
            ServerConfig(model=Path("tiny"), max_loras=1, max_cpu_loras=1),
            Metrics(),
            self.registry,
            in_pipeline=in_pipeline,
            lock=asyncio.Lock(),
            read=read,
            compose=compose,
            wake=wake,
        )

    def load(self, name: str) -> AdapterRecord:
        """What admission does for a load: a new version, its parse on the CPU tier."""
        path = Path(f"/adapters/{name}")
        record = new_record(name, path, parsed_for(path), origin="api")
        self.residency.add(record, parsed_for(path))
        previous = self.registry.put(record)
        if previous is not None:
            self.residency.retire(previous)
        return record

    def unload(self, name: str) -> None:
        record = self.registry.remove(name)
        assert record is not None
        self.residency.retire(record)

    async def read_ahead(self, record: AdapterRecord) -> None:
        """What the worker does for a queued request whose version is not ready."""
        woken = self.woken
        self.residency.prefetch([record])
        async with deadline("the read ahead"):  # the worker is woken when the read ends
            while self.woken == woken:
                await asyncio.sleep(0)


def parsed_for(path: Path) -> ParsedAdapter:
    return ParsedAdapter(
        sha256=hashlib.sha256(str(path).encode()).hexdigest(),
        size_bytes=1,
        rank=1,
        weights_file=path / "weights.safetensors",
        layers={},
        packed=torch.zeros(1),
    )


async def test_a_held_version_unloaded_and_dropped_is_ready_after_one_read_ahead() -> None:
    """A request holds `r` v1; v1 is unloaded and v2 takes the one CPU place. One read ahead
    makes v1 ready for its batch, and it stays ready while churn drops its parse again: the
    request never waits for a second read."""
    versions = Versions()
    v1 = versions.load("r")
    versions.residency.hold(v1)
    versions.unload("r")
    versions.load("r")
    assert not versions.residency.ready(v1)
    await versions.read_ahead(v1)
    assert versions.residency.ready(v1) and versions.reads == 1
    versions.load("other")  # takes the CPU place v1's read ahead had
    assert versions.residency.tier_of(v1) == "disk" and versions.residency.ready(v1)
    versions.residency.prefetch([v1])
    assert versions.reads == 1 and not versions.residency._preparing
    await versions.residency.make_resident(v1, wanted=set())  # its batch reads it again
    assert versions.residency.tier_of(v1) == "gpu" and versions.reads == 2
    versions.residency.release(v1)
    await versions.residency.collect()
    assert versions.residency.tier_of(v1) == "disk" and not versions.residency.ready(v1)
    assert v1.sha256 not in versions.slots.filled.values()


async def test_a_read_a_failed_batch_left_running_wakes_the_worker() -> None:
    """A batch's own read (`prepare`) can outlive the batch; when it ends, the worker wakes to
    batch the requests still waiting for that version."""
    versions = Versions()
    r = versions.load("r")
    versions.load("other")  # takes the one CPU place: r's parse goes
    versions.residency.hold(r)
    woken = versions.woken
    reading = asyncio.create_task(versions.residency.prepare(r))
    await asyncio.sleep(0)
    reading.cancel()  # the batch awaiting it failed on another adapter and moved on
    async with deadline("the batch's read"):
        while r.key in versions.residency._preparing:
            await asyncio.sleep(0)
    assert versions.woken > woken and versions.residency.ready(r)


async def test_a_version_held_after_it_was_collected_is_collected_again() -> None:
    """A request looked `r` v1 up just before v1 was unloaded and collected: it is served by
    v1, which then leaves every tier instead of staying cached under no name."""
    versions = Versions()
    v1 = versions.load("r")
    versions.unload("r")
    await versions.residency.collect()
    versions.residency.hold(v1)
    await versions.read_ahead(v1)
    await versions.residency.make_resident(v1, wanted=set())
    assert versions.residency.tier_of(v1) == "gpu"
    versions.residency.release(v1)
    await versions.residency.collect()
    assert versions.residency.tier_of(v1) == "disk" and not versions.slots.filled


async def test_the_queue_gauge_reads_zero_when_the_last_queued_client_left(
    start_server: Any,
) -> None:
    server = await start_server(max_batch_size=1)
    blocker = await pipeline_busy(server)
    body = {"prompt": "gone", "size": "32x32", "num_inference_steps": 2}
    leaving = asyncio.create_task(
        server.session.post(server.url("/v1/images/generations"), json=body)
    )
    await queued(server, 1)
    leaving.cancel()
    await asyncio.gather(leaving, return_exceptions=True)
    await blocker
    async with deadline("the queue emptying"):
        await server.engine.idle()
    assert server.metric("lora_generation_requests_total", outcome="dropped") == 1
    assert server.metric("lora_queue_depth") == 0


async def test_a_request_whose_version_is_unloaded_and_pushed_out_is_served(
    start_server: Any, assets: Assets
) -> None:
    """`r` v1 is unloaded while a request for it waits, `r` v2 takes the one CPU place: v1 is
    no longer registered and no tier holds its parse, but the waiting request holds v1 and is
    served by it; both versions' requests are answered and the queue empties."""
    server = await start_server(max_loras=1, max_cpu_loras=1, max_batch_size=1)
    await server.load("r", assets.adapter_a)
    v1 = server.engine.registry.get("r")
    blocker = await pipeline_busy(server)
    early = asyncio.create_task(generate(server, model="r"))
    await queued(server, 1)
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "r"})
    assert status == 200
    await server.load("r", assets.adapter_b)
    assert server.engine.residency.tier_of(v1) == "disk"
    late = asyncio.create_task(generate(server, model="r"))
    await blocker
    (
        (early_status, early_body, early_revision),
        (late_status, late_body, late_revision),
    ) = await asyncio.gather(early, late)
    assert (early_status, early_revision) == (200, v1.sha256), early_body
    assert (late_status, late_revision) == (200, server.engine.registry.get("r").sha256), late_body
    async with deadline("the queue emptying"):
        await server.engine.idle()
    assert server.metric("lora_queue_depth") == 0
    assert v1.key not in server.engine.residency.gpu and v1.key not in server.engine.residency.cpu


async def test_a_request_whose_unloaded_version_lost_its_files_gets_a_404(
    start_server: Any, assets: Assets, tmp_path: Path
) -> None:
    """As above, but v1's folder is deleted before its batch reads it again: the waiting
    request is answered with a 404 saying so, and the server goes on serving v2."""
    staged = tmp_path / "r-v1"
    shutil.copytree(assets.adapter_a, staged)
    server = await start_server(
        max_loras=1, max_cpu_loras=1, max_batch_size=1, allowed_roots=(assets.root, tmp_path)
    )
    await server.load("r", staged)
    blocker = await pipeline_busy(server)
    early = asyncio.create_task(generate(server, model="r"))
    await queued(server, 1)
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "r"})
    assert status == 200
    await server.load("r", assets.adapter_b)
    shutil.rmtree(staged)
    await blocker
    status, body, _ = await early
    assert status == 404 and "are gone from" in body["error"]["message"], body
    await server.image(model="r")
    async with deadline("the queue emptying"):
        await server.engine.idle()
    assert server.metric("lora_queue_depth") == 0


# -- stress -------------------------------------------------------------------------------------

VERSIONS = 2000  # adapter versions each stress test registers (loads and in-place loads)
CHURNED = ("r0", "r1", "r2")  # names loaded, swapped in place and unloaded over and over
CLIENTS = 6  # fewer than --max-queue: every request is queued, none turned away with a 429


@dataclass
class Tally:
    versions: int = 0
    unloads: int = 0
    served: collections.Counter[str] = field(default_factory=collections.Counter)
    unknown: int = 0  # 404s: the name was not registered when the request arrived
    stacks: collections.Counter[int] = field(default_factory=collections.Counter)  # by status
    worst_pixel: int = 0  # the largest difference from the reference of the revision served


@pytest.fixture
def busy_cpu() -> Iterator[None]:
    """A second process that spins on a core for the whole test: the worker, the reads and the
    admin calls are scheduled late and in more orders, as on a loaded node."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


async def churn(server: Server, name: str, paths: list[Path], tally: Tally) -> None:
    """Load `name`, swap it in place, unload it, in a random order, until the test has made
    `VERSIONS` versions; every admin call succeeds."""
    rng = random.Random(name)
    registered = False
    while tally.versions < VERSIONS:
        async with deadline(f"an admin call on {name}"):
            if registered and rng.random() < 0.4:
                status, body = await server.post("/v1/unload_lora_adapter", {"lora_name": name})
                tally.unloads += 1
                registered = False
            else:
                status, body = await server.post(
                    "/v1/load_lora_adapter",
                    {"lora_name": name, "lora_path": str(rng.choice(paths)), "load_inplace": True},
                )
                tally.versions += 1
                registered = True
        assert status == 200, body


async def client(
    server: Server, seed: int, references: dict[str, np.ndarray], tally: Tally, done: asyncio.Event
) -> None:
    """Ask for the churned names, now and then for two of them stacked or for the base model,
    until the churn is done. Each answer is a 200 made by the revision it names, or the 404 of
    a name unknown when the request arrived."""
    rng = random.Random(seed)
    while not done.is_set():
        name = rng.choice([*CHURNED, *CHURNED, "stack", None])
        if name == "stack":
            members = rng.sample(CHURNED, 2)
            status, body, _ = await generate(server, lora=[{"name": m} for m in members])
            assert status in (200, 404), body
            tally.stacks[status] += 1
            continue
        status, body, revision = await generate(server, model=name)
        if name is None:
            assert status == 200, body
            continue
        if status == 404:
            assert "does not exist" in body["error"]["message"], body
            tally.unknown += 1
            continue
        assert status == 200, body
        assert revision in references, (name, revision)
        image = decode(body["data"][0]["b64_json"]).astype(int)
        difference = int(np.abs(image - references[revision]).max())
        tally.worst_pixel = max(tally.worst_pixel, difference)
        tally.served[name] += 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "tiers",
    [
        pytest.param({"max_loras": 2, "max_cpu_loras": 4}, id="churn"),
        pytest.param({"max_loras": 1, "max_cpu_loras": 1}, id="eviction"),
    ],
)
async def test_churn_racing_generations_answers_every_request(
    start_server: Any, assets: Assets, busy_cpu: None, tiers: dict[str, int]
) -> None:
    """Thousands of versions of three names, loaded, swapped in place and unloaded while six
    clients ask for them over HTTP, the CPU busy: every request is answered (200 made by the
    revision it names, or 404), and when the churn stops the queue empties, its gauge reads 0
    and only registered versions stay in the tiers."""
    server = await start_server(max_queue=8, max_batch_size=4, **tiers)
    paths = [assets.adapter_a, assets.adapter_b]
    references = {}
    for path in paths:
        await server.load("reference", path, load_inplace=True)
        revision = server.engine.registry.get("reference").sha256
        references[revision] = (await server.image(model="reference")).astype(int)
    status, _ = await server.post("/v1/unload_lora_adapter", {"lora_name": "reference"})
    assert status == 200

    tally = Tally()
    done = asyncio.Event()

    async def churning() -> None:
        async with asyncio.TaskGroup() as names:
            for name in CHURNED:
                names.create_task(churn(server, name, paths, tally))
        done.set()

    async with asyncio.TaskGroup() as everyone:
        everyone.create_task(churning())
        for seed in range(CLIENTS):
            everyone.create_task(client(server, seed, references, tally, done))

    engine = server.engine
    async with deadline("the queue emptying"):
        await engine.idle()
    assert server.metric("lora_queue_depth") == 0
    assert sum(tally.served.values()) > 0 and tally.versions >= VERSIONS, tally
    # Batching and the merged path change float rounding, never by more than one 8-bit level.
    assert tally.worst_pixel <= 1, tally
    registered = {r.key for r in engine.registry.records()}
    assert set(engine.residency.gpu) <= registered and set(engine.residency.cpu) <= registered
