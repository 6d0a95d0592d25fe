"""Inference server benchmark: the adapter cache against a cacheless baseline and the base model.

One run prints, side by side, for a Zipf(1.1) request stream over 20 adapters:
  (a) this server (`--max-loras 4`), (b) a naive server that loads, generates and unloads per
  request, (c) the base model with no LoRA at all (the limit),
with throughput, p50/p95 latency and the ratios a/c and a/b (the stream is cut into slices that
the three take turns at, so background load drifts hit them alike); then cold-load and switch
times as the number of resident adapters grows (1, 5, 25, 50), with the in-place swap an
eviction uses when the incoming adapter fits the evicted one's layers.

    .venv/bin/python bench/bench_inference.py [--requests 120] [--clients 8] [--steps 4]

CPU on the tiny pipeline by default. On a GPU, the issue's full-size run is
    bench_inference.py --full-size --device cuda --size 1024 --rank 64 --steps 20 --requests 60
(a random-weight SDXL base architecture, see lora_inference/tools/full_size.py). Results go in
docs/benchmarks.md together with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_inference.app import create_app
from lora_inference.config import ServerConfig
from lora_inference.pipeline import DiffusionBackend, resolve_dtype
from lora_inference.tools.full_size import build_full_size_sdxl
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model
from naive_server import create_naive_app

ADAPTERS = 20


@dataclass(frozen=True)
class RunResult:
    label: str
    throughput: float  # requests per second
    p50: float
    p95: float


def zipf_stream(count: int, n_adapters: int, s: float, seed: int) -> list[str]:
    ranks = np.arange(1, n_adapters + 1)
    weights = 1.0 / ranks**s
    rng = np.random.default_rng(seed)
    picks = rng.choice(n_adapters, size=count, p=weights / weights.sum())
    return [f"adapter-{i:02d}" for i in picks]


async def drive(
    url: str, models: list[str], *, clients: int, steps: int, size: int
) -> tuple[float, list[float]]:
    """Send the stream from `clients` concurrent closed-loop clients; return (wall, latencies)."""
    queue: asyncio.Queue[tuple[int, str]] = asyncio.Queue()
    for i, model in enumerate(models):
        queue.put_nowait((i, model))
    latencies: list[float] = []

    async def client(session: ClientSession) -> None:
        while not queue.empty():
            i, model = queue.get_nowait()
            body = {
                "model": model,
                "prompt": "a lighthouse",
                "size": f"{size}x{size}",
                "num_inference_steps": steps,
                "seed": i,
            }
            started = time.perf_counter()
            async with session.post(url, json=body) as resp:
                payload = await resp.json()
                if resp.status != 200:
                    raise RuntimeError(f"{model}: {resp.status} {payload}")
            latencies.append(time.perf_counter() - started)

    async with ClientSession() as session:
        started = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        return time.perf_counter() - started, latencies


@dataclass
class Target:
    label: str
    app: web.Application
    models: list[str]  # the model named by each request of the stream
    wall: float = 0.0
    latencies: list[float] = field(default_factory=list)

    def result(self) -> RunResult:
        ordered = sorted(self.latencies)
        return RunResult(
            label=self.label,
            throughput=len(ordered) / self.wall,
            p50=statistics.median(ordered),
            p95=ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        )


async def measure_interleaved(targets: list[Target], args: argparse.Namespace) -> None:
    """Drive every target with the same stream, in rounds that rotate the order.

    The machine's background load drifts; interleaving slices of the stream across the targets
    makes each ratio compare runs made under the same conditions.
    """
    servers = [TestServer(t.app, host="127.0.0.1") for t in targets]
    for server in servers:
        await server.start_server()
    try:
        urls = [str(server.make_url("/v1/images/generations")) for server in servers]
        for target, url in zip(targets, urls, strict=True):
            for attempt in range(600):  # the servers load their pipeline in the background
                try:
                    await drive(url, target.models[:8], clients=1, steps=args.steps, size=args.size)
                    break
                except RuntimeError:
                    if attempt == 599:
                        raise
                    await asyncio.sleep(0.1)
        rounds = args.rounds
        size = -(-len(targets[0].models) // rounds)
        for r in range(rounds):
            order = list(range(len(targets)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                chunk = targets[i].models[r * size : (r + 1) * size]
                wall, latencies = await drive(
                    urls[i], chunk, clients=args.clients, steps=args.steps, size=args.size
                )
                targets[i].wall += wall
                targets[i].latencies += latencies
    finally:
        for server in servers:
            await server.close()


def growth(
    backend: DiffusionBackend, adapters: list[Path], steps: int
) -> list[tuple[int, float, float, float]]:
    """Cold load, in-place swap and switch times with 1, 5, 25, 50 resident adapters.

    Cold load: parse + check + a fresh peft load. In-place swap: copying an adapter into the
    layers of a resident one of the same layout (what an eviction does when it can). Switch:
    setting the active adapter on every layer before a batch.
    """
    rows = []
    loaded: list[str] = []
    parsed = [backend.parse_adapter(p, name=p.name, max_rank=1024) for p in adapters]
    unet_only = [a for a in parsed if a.components == (backend.components[0],)][:3]
    for adapter in unet_only:  # a first fresh load teaches each adapter its per-layer setup
        backend.add_adapter("warm", adapter)
        backend.remove_adapter("warm")
    for target in (1, 5, 25, 50):
        while len(loaded) < target:
            key = f"res_{len(loaded)}"
            backend.add_adapter(key, parsed[len(loaded) % len(parsed)])
            loaded.append(key)
        cold = []
        for i in range(steps):
            started = time.perf_counter()
            fresh = backend.parse_adapter(adapters[i % len(adapters)], name="probe", max_rank=1024)
            backend.add_adapter("probe", fresh)
            cold.append(time.perf_counter() - started)
            backend.remove_adapter("probe")
        backend.add_adapter("probe", unet_only[0])
        swap = []
        for i in range(steps):
            started = time.perf_counter()
            if not backend.replace("probe", unet_only[1 + i % (len(unet_only) - 1)]):
                raise RuntimeError("adapters of the same layers must swap in place")
            swap.append(time.perf_counter() - started)
        backend.remove_adapter("probe")
        switch = []
        for i in range(steps * 4):
            started = time.perf_counter()
            backend.activate({loaded[i % len(loaded)]: 1.0})
            switch.append(time.perf_counter() - started)
        rows.append(
            (target, statistics.median(cold), statistics.median(swap), statistics.median(switch))
        )
    for key in loaded:
        backend.remove_adapter(key)
    return rows


async def main_async(args: argparse.Namespace) -> None:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype("auto", device)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        work = Path(scratch)

        def pipeline() -> Any:
            """A fresh pipeline: each server gets its own."""
            if args.full_size:
                return build_full_size_sdxl(device, dtype)
            return DiffusionBackend.load(model, device=device, dtype=dtype).pipe

        if args.full_size:
            model = work / "sdxl-full-size"  # a name only: the weights live in memory
        else:
            model = write_tiny_model(work / "model", args.arch)
        pipe = pipeline()
        root = work / "adapters"
        paths = [
            write_random_adapter(
                root / f"adapter-{i:02d}",
                pipe,
                base_model=model.name,
                seed=i,
                rank=args.rank,
                text_encoder=i % 2 == 1,
                dtype=dtype,
            )
            for i in range(max(ADAPTERS, 50))
        ]
        stream = zipf_stream(args.requests, ADAPTERS, 1.1, seed=0)
        distinct = len(set(stream))
        backend = DiffusionBackend(pipe, device=device, dtype=dtype)
        config = ServerConfig(
            model=model,
            adapter_root=root,
            max_loras=4,
            max_cpu_loras=ADAPTERS,
            max_batch_size=args.batch,
            device=device,
        )

        from lora_inference.app import METRICS

        app_a = create_app(config, backend=backend)
        # The limit gets a pipeline of its own that never held an adapter.
        pristine = DiffusionBackend(pipeline(), device=device, dtype=dtype)
        targets = [
            Target("(a) lora-inference, max-loras 4", app_a, stream),
            Target(
                "(b) naive load/generate/unload",
                create_naive_app(model, root, pipeline()),
                stream,
            ),
            Target(
                "(c) base model, no LoRA",
                create_app(config, backend=pristine),
                [model.name] * len(stream),
            ),
        ]
        await measure_interleaved(targets, args)
        ours, naive, limit = (t.result() for t in targets)

        print(
            f"\nZipf(1.1) over {ADAPTERS} adapters: {len(stream)} requests "
            f"({distinct} distinct adapters), {args.clients} clients, {args.steps} steps, "
            f"{args.size}x{args.size}, rank {args.rank}, "
            f"{model.name if args.full_size else args.arch} on {device} "
            f"({platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads)"
        )
        print(f"{'':36}{'req/s':>8}{'p50 s':>9}{'p95 s':>9}")
        for r in (ours, naive, limit):
            print(f"{r.label:36}{r.throughput:8.2f}{r.p50:9.3f}{r.p95:9.3f}")
        m = app_a[METRICS].registry

        def sample(name: str, **labels: str) -> float:
            return float(m.get_sample_value(name, labels) or 0.0)

        print(
            f"(a) adapter lookups: {sample('lora_adapter_lookups_total', result='hit'):.0f} hits, "
            f"{sample('lora_adapter_lookups_total', result='miss'):.0f} misses "
            f"({sample('lora_adapter_inplace_swaps_total'):.0f} served by in-place swaps); "
            f"{sample('lora_batch_images_sum') / max(1.0, sample('lora_batch_images_count')):.2f} "
            "images per pipeline call"
        )
        print(
            f"ratio a/c (target >= 0.9): {ours.throughput / limit.throughput:.2f}   "
            f"ratio a/b (target >= 3): {ours.throughput / naive.throughput:.2f}"
        )

        print(
            f"\nGrowth with resident adapters (median of {args.growth_samples} cold loads, "
            f"{args.growth_samples * 4} switches)"
        )
        print(f"{'resident':>8}{'cold load ms':>14}{'in-place swap ms':>18}{'switch ms':>11}")
        for resident, cold, swap, switch in growth(backend, paths, args.growth_samples):
            print(f"{resident:8d}{cold * 1000:14.1f}{swap * 1000:18.1f}{switch * 1000:11.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--arch", default="sd15")
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="a random-weight full-size SDXL (GPU only); use with --size 1024 --rank 64",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--growth-samples", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved slices of the stream")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
