"""Inference server benchmark: the adapter cache against a cacheless baseline and the base model.

For each mode, one run prints, side by side, for a Zipf(1.1) request stream over 20 adapters:
  (a) this server (`--max-loras 4`), (b) a naive server that loads, generates and unloads per
  request, (c) the base model with no LoRA at all (the limit),
with throughput, p50/p95 latency and the ratios a/c and a/b (the stream is cut into slices that
the three take turns at, so background load drifts hit them alike); then first-use, swap and
activation times as the number of resident adapters grows.

Modes:
  tiny            the tiny SD 1.5 pipeline: fast, but Python overhead dominates every layer
  representative  SD 1.5 at full width (random weights, built offline) at 64x64 pixels, with
                  rank 16, 32 and 64 adapters: a LoRA layer costs what it costs next to its base
                  layer on the real model, and a swap what it costs next to a step
  full-size       (--full-size, for a GPU) SDXL base at full size

    .venv/bin/python bench/bench_inference.py                 # tiny, then representative
    .venv/bin/python bench/bench_inference.py --full-size --device cuda \\
        --size 1024 --rank 64 --steps 20 --requests 60        # the three

The representative mode ends with the CPU part of a rank-64 adapter's first use (read, hash,
check, convert and pack: `parse_adapter`) against reading and hashing the same file once as the
server's reader does (`weightsfile.read`), medians of samples that take turns:
    first-use: cpu ms = X, read+hash ms = Y, ratio = Z.ZZ
The line
    serving: a/c tiny = X.XX, a/c representative = Y.YY, a/b representative = Z.ZZ
ends a run of the CPU modes; with --full-size the full-size mode also measures a call of four
different adapters against the base model's, a slot fill's bandwidth and the kernels a step
launches, and the last line reads
    serving-gpu: a/c full-size = X.XX, mixed-4/base = Y.YY, slot copy GB/s = Z.Z
Results go in docs/benchmarks.md together with the command.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_inference import weightsfile
from lora_inference.app import METRICS, create_app
from lora_inference.config import ServerConfig
from lora_inference.pipeline import DiffusionBackend, ImageJob, resolve_dtype
from lora_inference.tools.full_size import build_full_size_sd15, build_full_size_sdxl
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model
from lora_volume import files
from naive_server import create_naive_app

ADAPTERS = 20  # in the stream; the growth table writes more


@dataclass(frozen=True)
class Mode:
    name: str
    requests: int
    steps: int
    size: int
    ranks: tuple[int, ...]  # adapter i has rank ranks[i % len(ranks)]
    resident: tuple[int, ...]  # rows of the growth table
    # Random LoRA weights' scale: small enough on full-width layers that activations stay in
    # range (a real adapter changes its layer by a few percent, not by multiples).
    strength: float = 0.2


TINY = Mode("tiny", requests=120, steps=4, size=32, ranks=(4,), resident=(1, 5, 25, 50))
# Full-width slots are a few hundred MB each at rank 64: the growth table stops at 8.
REPRESENTATIVE = Mode(
    "representative",
    requests=32,
    steps=4,
    size=64,
    ranks=(16, 32, 64),
    resident=(1, 4, 8),
    strength=0.02,
)
FULL_SIZE = Mode(
    "full-size", requests=60, steps=20, size=1024, ranks=(64,), resident=(1, 4, 8), strength=0.02
)


@dataclass(frozen=True)
class RunResult:
    label: str
    throughput: float  # requests per second of wall-clock time
    own_throughput: float  # requests per second, the time other processes ran removed
    p50: float
    p95: float


@dataclass(frozen=True)
class ModeResult:
    a_c: float
    a_b: float
    engine: EngineFigures | None = None  # the full-size mode's


@dataclass(frozen=True)
class EngineFigures:
    """What a batch of adapters costs next to the base model, and what moving one costs."""

    base_s: float  # a call of four images, base model
    mixed_s: float  # the same call, four different adapters
    copy_gb_s: float  # a slot fill: bytes of the packed planes copied per second
    copy_mb: float  # what a fill copies (an adapter's packed planes), the median
    launches_base: int  # kernels per denoising step (CUDA only; 0 elsewhere)
    launches_mixed: int

    @property
    def mixed_over_base(self) -> float:
        return self.mixed_s / self.base_s


def engine_figures(
    backend: DiffusionBackend, adapters: list[Path], mode: Mode, samples: int = 3
) -> EngineFigures:
    """A call of four images with four different adapters against the same call of the base
    model (median of `samples`), a slot fill's bandwidth, and kernel launches per step."""
    parsed = [backend.parse_adapter(p, name=p.name, max_rank=64) for p in adapters[:4]]
    slots = [f"mix{i}" for i in range(len(parsed))]
    for slot, adapter in zip(slots, parsed, strict=True):
        backend.place(slot, adapter)
    jobs = [ImageJob(prompt="a lighthouse", negative_prompt=None, seeds=(i,)) for i in range(4)]
    scales = dict.fromkeys(slots, 1.0)

    def call(per_job: list[str | None], steps: int) -> None:
        backend.run_batch(
            jobs,
            per_job,
            scales,
            width=mode.size,
            height=mode.size,
            steps=steps,
            guidance_scale=5.0,
        )
        synchronize(backend)

    def call_seconds(per_job: list[str | None], steps: int) -> float:
        times = []
        for _ in range(samples + 1):  # the first warms up
            synchronize(backend)
            started = time.perf_counter()
            call(per_job, steps)
            times.append(time.perf_counter() - started)
        return statistics.median(times[1:])

    base = call_seconds([None] * 4, mode.steps)
    mixed = call_seconds(list(slots), mode.steps)
    rates, moved = [], []
    for i in range(samples * 3):
        adapter = parsed[i % len(parsed)]
        synchronize(backend)
        started = time.perf_counter()
        backend.place(slots[0], adapter)
        synchronize(backend)
        # A fill copies the adapter's planes, each cut to the prefix its layers lie in.
        moved.append(adapter.packed.numel() * adapter.packed.element_size())
        rates.append(moved[-1] / (time.perf_counter() - started))

    def launches(per_job: list[str | None]) -> int:
        if not backend.device.startswith("cuda"):
            return 0
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            call(per_job, 1)
        return sum(1 for e in prof.events() if e.device_type.name == "CUDA")

    figures = EngineFigures(
        base_s=base,
        mixed_s=mixed,
        copy_gb_s=statistics.median(rates) / 1e9,
        copy_mb=statistics.median(moved) / 1e6,
        launches_base=launches([None] * 4),
        launches_mixed=launches(list(slots)),
    )
    for slot in slots:
        backend.clear(slot)
    return figures


def first_use_figures(
    backend: DiffusionBackend, adapters: list[Path], samples: int
) -> tuple[float, float, float]:
    """Seconds of the CPU part of a first use (`parse_adapter`: read, hash, check, convert and
    pack) and of reading and hashing the same file once as it does (`weightsfile.read`), the
    median of `samples` each over `adapters`, taking turns so the machine's load hits both, and
    the median of their ratio per turn."""
    for adapter in adapters:  # the first parse of a process warms up what it imports
        backend.parse_adapter(adapter, name="probe", max_rank=64)
    cpu, read_hash = [], []
    for i in range(samples):
        adapter = adapters[i % len(adapters)]
        started = time.perf_counter()
        weightsfile.read(files.find_weights_file(adapter)).sha256()
        read_hash.append(time.perf_counter() - started)
        started = time.perf_counter()
        backend.parse_adapter(adapter, name="probe", max_rank=64)
        cpu.append(time.perf_counter() - started)
    ratio = statistics.median(c / r for c, r in zip(cpu, read_hash, strict=True))
    return statistics.median(cpu), statistics.median(read_hash), ratio


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
    base_model: str
    wall: float = 0.0
    own: float = 0.0  # wall-clock time less the time the pipeline waited for other processes
    latencies: list[float] = field(default_factory=list)

    def result(self) -> RunResult:
        ordered = sorted(self.latencies)
        return RunResult(
            label=self.label,
            throughput=len(ordered) / self.wall,
            own_throughput=len(ordered) / self.own,
            p50=statistics.median(ordered),
            p95=ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))],
        )


def thread_times() -> dict[int, tuple[int, int]]:
    """Per thread of this process: (ns on a CPU, ns ready to run but waiting for one).

    Linux's schedstat; empty where it is missing, and then no time is removed.
    """
    times = {}
    for task in Path("/proc/self/task").glob("*"):
        try:
            on_cpu, waiting, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):
            continue
        times[int(task.name)] = (on_cpu, waiting)
    return times


def time_lost_to_others(before: dict[int, tuple[int, int]]) -> float:
    """Seconds the busiest thread since `before` (the one running the pipeline) spent ready to
    run while the machine ran something else: on a shared machine, the neighbours' share of the
    wall-clock time. Our own threads never need to wait for each other with one torch thread
    on two cores."""
    after = thread_times()
    if not after:
        return 0.0

    def delta(tid: int, field: int) -> int:
        return after[tid][field] - before.get(tid, (0, 0))[field]

    busiest = max(after, key=lambda tid: delta(tid, 0))
    return delta(busiest, 1) / 1e9


async def measure_interleaved(targets: list[Target], mode: Mode, args: argparse.Namespace) -> None:
    """Drive every target with the same stream, in rounds that rotate the order.

    The machine's background load drifts; interleaving slices of the stream across the targets
    makes each ratio compare runs made under the same conditions. Each server is first warmed
    with two base-model requests, so every adapter's first use falls inside the measurement.
    """
    servers = [TestServer(t.app, host="127.0.0.1") for t in targets]
    for server in servers:
        await server.start_server()
    try:
        urls = [str(server.make_url("/v1/images/generations")) for server in servers]
        for target, url in zip(targets, urls, strict=True):
            warm = [target.base_model] * 2
            for attempt in range(6000):  # the servers load and calibrate in the background
                try:
                    await drive(url, warm, clients=1, steps=mode.steps, size=mode.size)
                    break
                except RuntimeError:
                    if attempt == 5999:
                        raise
                    await asyncio.sleep(0.1)
        rounds = args.rounds
        size = -(-len(targets[0].models) // rounds)
        for r in range(rounds):
            order = list(range(len(targets)))
            order = order[r % len(order) :] + order[: r % len(order)]
            for i in order:
                chunk = targets[i].models[r * size : (r + 1) * size]
                before = thread_times()
                wall, latencies = await drive(
                    urls[i], chunk, clients=args.clients, steps=mode.steps, size=mode.size
                )
                targets[i].wall += wall
                targets[i].own += wall - time_lost_to_others(before)
                targets[i].latencies += latencies
    finally:
        for server in servers:
            await server.close()


def growth(
    backend: DiffusionBackend, adapters: list[Path], resident: tuple[int, ...], samples: int
) -> list[tuple[int, float, float, float, int]]:
    """First use, swap and activation with more and more adapters resident in one pipeline.

    First use: parse the file and copy it into a slot that held another adapter (a miss whose
    adapter is not cached yet). Swap: copy a cached adapter into such a slot (every other miss).
    Activate: set up a call of one resident adapter, after another one.
    """
    # Only as many as become resident: a full-width adapter's planes are a few hundred MB.
    wanted = adapters[: max(3, *resident)]
    parsed = [backend.parse_adapter(p, name=p.name, max_rank=64) for p in wanted]
    probe_cycle = parsed[: min(3, len(parsed))]  # different ranks where the mode has several
    rows = []
    loaded = 0
    for target in resident:
        while loaded < target:
            backend.place(f"res{loaded}", parsed[loaded % len(parsed)])
            loaded += 1
        backend.place("probe", probe_cycle[0])
        first, swap, activate, touched = [], [], [], []
        for i in range(samples):
            started = time.perf_counter()
            fresh = backend.parse_adapter(adapters[i % len(adapters)], name="probe", max_rank=64)
            backend.place("probe", fresh)
            synchronize(backend)
            first.append(time.perf_counter() - started)
            started = time.perf_counter()
            backend.place("probe", probe_cycle[(i + 1) % len(probe_cycle)])
            synchronize(backend)
            swap.append(time.perf_counter() - started)
        for i in range(samples * 4):
            slot = f"res{i % loaded}"
            started = time.perf_counter()
            with backend.slots.call([slot], {slot: 1.0}):
                pass
            activate.append(time.perf_counter() - started)
            touched.append(len(backend.slots.footprint(slot)))
        backend.clear("probe")
        rows.append(
            (
                target,
                statistics.median(first),
                statistics.median(swap),
                statistics.median(activate),
                max(touched),
            )
        )
    for i in range(loaded):
        backend.clear(f"res{i}")
    return rows


def synchronize(backend: DiffusionBackend) -> None:
    """Wait for the device (a slot copy on a GPU runs asynchronously)."""
    if backend.device.startswith("cuda"):
        torch.cuda.synchronize()


def pipelines(
    mode: Mode, work: Path, device: str, dtype: torch.dtype
) -> tuple[Path, Callable[[Any], Any]]:
    """The model's name (and directory, for tiny) and a factory of fresh pipelines.

    The factory takes a pipeline whose weights the new one may share (None: its own weights).
    Only servers that never write their base weights share: the naive server and the limit.
    """
    if mode.name == "tiny":
        model = write_tiny_model(work / "model", "sd15")
        return model, lambda _: DiffusionBackend.load(model, device=device, dtype=dtype).pipe
    if mode.name == "representative":
        return work / "sd15-full-width", lambda shared: build_full_size_sd15(
            device, dtype, share_with=shared
        )
    return work / "sdxl-full-size", lambda _: build_full_size_sdxl(device, dtype)


async def run_mode(mode: Mode, args: argparse.Namespace) -> ModeResult:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = resolve_dtype("auto", device)
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        work = Path(scratch)
        model, pipeline = pipelines(mode, work, device, dtype)
        started = time.perf_counter()
        pipe = pipeline(None)
        root = work / "adapters"
        paths = [
            write_random_adapter(
                root / f"adapter-{i:02d}",
                pipe,
                base_model=model.name,
                seed=i,
                rank=mode.ranks[i % len(mode.ranks)],
                text_encoder=i % 2 == 1,
                strength=mode.strength,
                dtype=dtype,
            )
            for i in range(max(ADAPTERS, *mode.resident))
        ]
        stream = zipf_stream(mode.requests, ADAPTERS, 1.1, seed=0)
        # Room for (a)'s four slots, and afterwards for the growth table's resident adapters.
        backend = DiffusionBackend(
            pipe, device=device, dtype=dtype, slots=max(4, *mode.resident) + 1, max_rank=64
        )
        config = ServerConfig(
            model=model,
            adapter_root=root,
            max_loras=4,
            max_cpu_loras=ADAPTERS,
            max_batch_size=args.batch,
            device=device,
        )
        app_a = create_app(config, backend=backend)
        # (b) and (c) get a pipeline of their own that never held an adapter.
        limit_pipe = pipeline(None)
        targets = [
            Target("(a) lora-inference, max-loras 4", app_a, stream, model.name),
            Target(
                "(b) naive load/generate/unload",
                create_naive_app(model, root, pipeline(limit_pipe)),
                stream,
                model.name,
            ),
            Target(
                "(c) base model, no LoRA",
                create_app(
                    replace(config, merge="never"),
                    backend=DiffusionBackend(limit_pipe, device=device, dtype=dtype, slots=1),
                ),
                [model.name] * len(stream),
                model.name,
            ),
        ]
        prepared = time.perf_counter() - started
        await measure_interleaved(targets, mode, args)
        ours, naive, limit = (t.result() for t in targets)
        del targets, limit_pipe
        gc.collect()

        ranks = "/".join(str(r) for r in mode.ranks)
        print(
            f"\n[{mode.name}] Zipf(1.1) over {ADAPTERS} adapters: {len(stream)} requests "
            f"({len(set(stream))} distinct adapters), {args.clients} clients, {mode.steps} steps, "
            f"{mode.size}x{mode.size}, rank {ranks}, {model.name} on {device} "
            f"({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads); "
            f"models and adapters built in {prepared:.0f} s"
        )
        print(f"{'':36}{'req/s':>8}{'own req/s':>11}{'p50 s':>9}{'p95 s':>9}")
        for r in (ours, naive, limit):
            print(
                f"{r.label:36}{r.throughput:8.2f}{r.own_throughput:11.2f}{r.p50:9.3f}{r.p95:9.3f}"
            )
        registry = app_a[METRICS].registry

        def sample(name: str, **labels: str) -> float:
            return float(registry.get_sample_value(name, labels) or 0.0)

        paths_taken = {
            path: sample("lora_batches_total", path=path)
            for path in ("base", "adapter", "merged", "mixed")
        }
        calls = sample("lora_batch_images_count")
        print(
            f"(a) adapter lookups: {sample('lora_adapter_lookups_total', result='hit'):.0f} hits, "
            f"{sample('lora_adapter_lookups_total', result='miss'):.0f} misses, each a copy into "
            f"a slot; {sample('lora_batch_images_sum') / max(1.0, calls):.2f} images per call; "
            "calls: " + ", ".join(f"{v:.0f} {k}" for k, v in paths_taken.items())
        )
        result = ModeResult(
            a_c=ours.own_throughput / limit.own_throughput,
            a_b=ours.own_throughput / naive.own_throughput,
        )
        print(
            f"ratio a/c: {result.a_c:.2f} (wall clock {ours.throughput / limit.throughput:.2f})"
            f"   ratio a/b: {result.a_b:.2f} (wall clock {ours.throughput / naive.throughput:.2f})"
        )

        print(
            f"Growth with resident adapters (median of {args.growth_samples} first uses and "
            f"swaps, {args.growth_samples * 4} activations)"
        )
        print(
            f"{'resident':>8}{'first use ms':>14}{'swap ms':>10}{'activate ms':>13}"
            f"{'layers touched':>16}"
        )
        rows = growth(backend, paths, mode.resident, args.growth_samples)
        for resident, first, swap, activate, touched in rows:
            print(
                f"{resident:8d}{first * 1000:14.1f}{swap * 1000:10.1f}{activate * 1000:13.2f}"
                f"{touched:16d}"
            )
        if mode.name == "full-size":
            engine = engine_figures(backend, paths, mode)
            print(
                f"a call of 4 images: base model {engine.base_s:.3f} s, four different adapters "
                f"{engine.mixed_s:.3f} s (mixed-4/base {engine.mixed_over_base:.2f}); a slot fill "
                f"moves {engine.copy_mb:.0f} MB at {engine.copy_gb_s:.1f} GB/s; "
                f"kernels in one step of 4 images: base {engine.launches_base}, "
                f"mixed {engine.launches_mixed}"
            )
            result = replace(result, engine=engine)
        if mode.name == "representative":
            ranks = mode.ranks
            rank_64 = [p for i, p in enumerate(paths) if ranks[i % len(ranks)] == 64]
            cpu, read_hash, ratio = first_use_figures(backend, rank_64, args.growth_samples * 4)
            print(
                f"first-use: cpu ms = {cpu * 1000:.0f}, read+hash ms = {read_hash * 1000:.0f}, "
                f"ratio = {ratio:.2f}"
            )
        return result


async def main_async(args: argparse.Namespace) -> None:
    if args.threads:
        torch.set_num_threads(args.threads)
    modes = {"tiny": TINY, "representative": REPRESENTATIVE}
    if args.full_size:
        modes["full-size"] = replace(
            FULL_SIZE,
            requests=args.requests or FULL_SIZE.requests,
            steps=args.steps or FULL_SIZE.steps,
            size=args.size or FULL_SIZE.size,
            ranks=(args.rank,) if args.rank else FULL_SIZE.ranks,
        )
    wanted = args.modes.split(",") if args.modes else list(modes)
    results: dict[str, ModeResult] = {}
    started = time.perf_counter()
    for name in wanted:
        results[name] = await run_mode(modes[name], args)
    print(f"\nall modes in {time.perf_counter() - started:.0f} s")

    def figure(mode: str, ratio: str) -> str:
        return f"{getattr(results[mode], ratio):.2f}" if mode in results else "n/a"

    print(
        f"serving: a/c tiny = {figure('tiny', 'a_c')}, "
        f"a/c representative = {figure('representative', 'a_c')}, "
        f"a/b representative = {figure('representative', 'a_b')}"
    )
    engine = results["full-size"].engine if "full-size" in results else None
    if engine is not None:  # with --full-size the GPU's figures are the last line
        print(
            f"serving-gpu: a/c full-size = {figure('full-size', 'a_c')}, "
            f"mixed-4/base = {engine.mixed_over_base:.2f}, "
            f"slot copy GB/s = {engine.copy_gb_s:.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", help="comma-separated subset of tiny,representative,full-size")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per operation (0: torch's choice); see docs/benchmarks.md",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--growth-samples", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=4, help="interleaved slices of the stream")
    parser.add_argument(
        "--full-size",
        action="store_true",
        help="also run a random-weight full-size SDXL (GPU only); see the options below",
    )
    parser.add_argument("--requests", type=int, default=0, help="full-size mode: requests")
    parser.add_argument("--steps", type=int, default=0, help="full-size mode: denoising steps")
    parser.add_argument("--size", type=int, default=0, help="full-size mode: image side")
    parser.add_argument("--rank", type=int, default=0, help="full-size mode: adapter rank")
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
