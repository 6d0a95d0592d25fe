"""The simulated fleet (`--simulate`, `--simulate-suite`): a cluster per profile, each stream and
loop a cell of three routes, the cells' report and the suite's last line."""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from bench_inference import zipf_stream
from lora_demo import manifests
from lora_devcluster import images
from lora_devcluster.harness import Harness

from lora_bench import cluster
from lora_bench.fleet import counters, figures, objects, rounds

SIM_ROUTES = ("round-robin", "least-queued", "router")
SIM_PROFILES = ("h200-sdxl-4step", "h200-sdxl-20step")
STREAMS = ("zipf", "uniform")
LOOPS = ("closed", "open")


def stream_of(kind: str, count: int, k: int, zipf: float, seed: int) -> list[str]:
    if kind == "zipf":
        return zipf_stream(count, k, zipf, seed=seed)
    import random

    rng = random.Random(seed)
    return [f"adapter-{rng.randrange(k):02d}" for _ in range(count)]


@dataclass
class Cell:
    """One profile x stream x loop on one fleet: a Tally per route."""

    profile: str
    stream: str
    loop: str
    pods: int
    adapters: int
    bound: float  # images/s if every request hit a slot
    rate: float | None  # open loop: the requests per second sent
    tallies: dict[str, figures.Tally]
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)

    def ratio(self, route: str = "router") -> float:
        return self.tallies[route].steady_throughput / self.tallies["round-robin"].steady_throughput

    def p95_ratio(self, route: str = "router") -> float:
        return self.tallies[route].percentile(0.95) / self.tallies["round-robin"].percentile(0.95)


def measure_sim(h: Harness, pods: list[str], args: argparse.Namespace) -> list[Cell]:
    from lora_inference.simulate.profile import load_profile

    profile = load_profile(args.simulate)
    inference = counters.pids_of(h, manifests.INFERENCE_LABELS, "inference")
    router = counters.pids_of(h, objects.ROUTER_LABELS, "router")
    pod_urls = [
        f"http://{p['status']['podIP']}:8000/v1/images/generations"
        for p in h.pods(objects.NS, manifests.INFERENCE_LABELS)
    ]
    bound = profile.no_miss_images_per_s(args.pods)
    cells = []
    for stream_kind in args.streams:
        for loop in args.loops:
            rate = args.load_fraction * bound if loop == "open" else None
            cell = Cell(
                args.simulate, stream_kind, loop, args.pods, args.adapters, bound, rate,
                {label: figures.Tally(label) for label in SIM_ROUTES},
            )  # fmt: skip
            for r in range(args.rounds):
                seed = args.seed + 1 + r
                stream = stream_of(stream_kind, args.requests, args.adapters, args.zipf, seed)
                settle = stream_of(
                    stream_kind, args.settle, args.adapters, args.zipf, rounds.SETTLE_SEED + seed
                )
                order = SIM_ROUTES[r % 3 :] + SIM_ROUTES[: r % 3]
                line = []
                for label in order:
                    if settle:
                        rounds.send_round(
                            h,
                            objects.sim_round(
                                settle, args, label, rounds.SETTLE_SEED + seed, pod_urls, None
                            ),
                        )
                    before = counters.snapshot(h, pods, inference, router)
                    host = psutil.cpu_times()
                    result = rounds.send_round(
                        h, objects.sim_round(stream, args, label, seed * 1000, pod_urls, rate)
                    )
                    cell.tallies[label].add_host(host, psutil.cpu_times())
                    after = counters.snapshot(h, pods, inference, router)
                    cell.rejected[label] += int(result.get("rejected", 0))
                    tally = cell.tallies[label]
                    hits, lookups = tally.gpu_hits, tally.lookups
                    tally.add(stream, result, before, after)
                    hit = (tally.gpu_hits - hits) / max(1.0, tally.lookups - lookups)
                    line.append(
                        f"{label} {figures.steady_rate(result):.2f} images/s, hit {hit:.2f}"
                    )
                print(
                    f"  {stream_kind}/{loop} round {r + 1}/{args.rounds}: " + "; ".join(line),
                    flush=True,
                )
            print_cell(cell)
            cells.append(cell)
    return cells


def print_cell(cell: Cell) -> None:
    rate = f"open loop at {cell.rate:.2f} requests/s" if cell.rate else "closed loop"
    print(
        f"\n{cell.profile}, N={cell.pods}, K={cell.adapters}, {cell.stream}, {rate};"
        f" no-miss bound {cell.bound:.2f} images/s"
    )
    print(
        f"{'route':<14}{'images/s':>10}{'/rr':>7}{'/bound':>8}{'p50 s':>8}{'p95 s':>8}"
        f"{'p95/rr':>8}{'GPU hit':>9}{'fresh/100':>11}{'429s':>6}  routes"
    )
    for label, t in cell.tallies.items():
        routes = ", ".join(
            f"{k} {v / max(1, sum(t.routes.values())):.0%}" for k, v in t.routes.most_common(3)
        )
        print(
            f"{label:<14}{t.steady_throughput:>10.2f}{cell.ratio(label):>7.2f}"
            f"{t.steady_throughput / cell.bound:>8.2f}"
            f"{t.percentile(0.5):>8.2f}{t.percentile(0.95):>8.2f}"
            f"{cell.p95_ratio(label):>8.2f}{t.hit_rate:>9.2f}{t.per_100(t.fresh_loads):>11.1f}"
            f"{cell.rejected[label]:>6}  {routes}"
        )
    print(
        f"{'where the time went':<20}{'pipeline busy':>14}{'ms/image':>10}{'copy ms':>9}"
        f"{'read ms':>9}{'pod CPU ms':>12}{'router CPU ms':>15}{'machine busy':>14}"
    )
    for label, t in cell.tallies.items():
        busy = (t.generation_s + t.slot_copy_s) / (cell.pods * t.wall_s)
        print(
            f"{label:<20}{busy:>14.2f}{1000 * t.generation_s / max(1.0, t.generations):>10.0f}"
            f"{t.ms(t.slot_copy_s):>9.1f}{t.ms(t.fresh_load_s):>9.1f}{t.ms(t.inference_cpu_s):>12.2f}"
            f"{t.ms(t.router_cpu_s):>15.2f}{t.host_busy_s / max(1e-9, t.host_s):>14.2f}"
        )


def run_sim(args: argparse.Namespace, node_images: Sequence[images.Image]) -> list[Cell]:
    """One cluster: the chart with simulated pods, K adapters Ready, every cell measured."""
    with tempfile.TemporaryDirectory(prefix="lora-bench-fleet-") as scratch:
        work = Path(scratch)
        with cluster.local_cluster(work / "cluster", node_images, namespace=objects.NS) as h:
            pods = rounds.set_up(h, args, work)
            return measure_sim(h, pods, args)


def sim_summary(cells: list[Cell]) -> str:
    """The suite's last line: the Zipf closed-loop cells of each profile, and the worst cell."""

    def zipf(profile: str) -> Cell | None:
        return next(
            (c for c in cells if c.profile == profile and (c.stream, c.loop) == ("zipf", "closed")),
            None,
        )

    four, twenty = zipf("h200-sdxl-4step"), zipf("h200-sdxl-20step")
    nan = float("nan")
    bound = four.tallies["router"].steady_throughput / four.bound if four else nan
    return (
        f"fleet-sim: throughput router/round-robin 4step = {four.ratio() if four else nan:.2f},"
        f" 20step = {twenty.ratio() if twenty else nan:.2f}, bound fraction 4step = {bound:.2f},"
        f" worst cell = {min(c.ratio() for c in cells):.2f}"
    )


def main_sim(args: argparse.Namespace, node_images: Sequence[images.Image]) -> int:
    from lora_inference.simulate.profile import load_profile

    args.streams = [s for s in args.streams.split(",") if s]
    args.loops = [loop for loop in args.loops.split(",") if loop]
    args.concurrency = args.concurrency or 2 * args.pods
    started = time.monotonic()
    cells: list[Cell] = []
    for name in SIM_PROFILES if args.simulate_suite else (args.simulate,):
        profile = load_profile(name)
        args.simulate, args.size, args.steps = name, profile.size, profile.steps
        cells += run_sim(args, node_images)
    memory = psutil.virtual_memory().total / 2**30
    print(
        f"\nsimulated fleet on lora-devcluster: N={args.pods} pods, K={args.adapters} adapters"
        f" ({'on every pod' if args.replicas is None else f'spec.replicas {args.replicas}'}),"
        f" {args.rounds} rounds x {args.requests} requests per route and cell (each after"
        f" {args.settle} not counted), closed loop {args.concurrency} in flight; --max-loras"
        f" {args.max_loras}, --max-cpu-loras {args.max_cpu_loras}, --max-batch-size 1;"
        f" {platform.machine()}, {os.cpu_count()} cores, {memory:.0f} GiB;"
        f" {datetime.date.today().isoformat()}; {time.monotonic() - started:.0f} s"
    )
    for cell in cells:
        print_cell(cell)
    print(
        "\nGPU hit: lookups that found the adapter in a GPU slot (one per request); fresh/100:"
        " adapters read from the volume into the CPU tier per 100 requests; /bound: throughput"
        " over the no-miss bound (every pod generating back to back with no miss); 429s:"
        " requests the pods refused with a full queue (open loop), not counted in the latencies."
    )
    if args.simulate_suite:
        print(sim_summary(cells))
    else:
        print(
            f"fleet-sim {args.simulate}: worst cell router/round-robin ="
            f" {min(c.ratio() for c in cells):.2f}"
        )
    return 0
