"""The real pods' report: per route throughput, latency, hit rate, fresh loads, spread and
where the time went, against the targets."""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import platform
import statistics
from collections.abc import Callable

import psutil
from bench_inference import zipf_stream

from lora_bench.fleet import figures, objects

THROUGHPUT_TARGET = 1.5
HIT_RATE_TARGET = 2.0


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "not met"


def print_report(
    tallies: dict[str, figures.Tally], args: argparse.Namespace
) -> tuple[float, float]:
    rr, rt = tallies["round-robin"], tallies["router"]
    memory = psutil.virtual_memory().total / 2**30
    ranks = "/".join(str(r) for r in objects.RANKS)
    print(
        f"\nlora-router on lora-devcluster: N={args.pods} inference pods, K={args.adapters}"
        f" adapters, Zipf({args.zipf}); {args.rounds} rounds x {args.requests} requests per route"
        f" (each after {args.settle} not counted),"
        f" {args.concurrency} in flight; tiny sd15 on cpu, {args.size}x{args.size},"
        f" {args.steps} step(s), rank {ranks}; --max-loras {args.max_loras}, --max-cpu-loras"
        f" {args.max_cpu_loras}, --max-batch-size 1; {platform.machine()}, {os.cpu_count()}"
        f" cores, {memory:.0f} GiB; {datetime.date.today().isoformat()}"
    )
    throughput = rt.throughput / rr.throughput
    hit_ratio = rt.hit_rate / rr.hit_rate if rr.hit_rate else float("inf")

    def row(name: str, a: float, b: float, fmt: str, ratio: str = "", target: str = "") -> None:
        print(f"{name:<40}{a:>12{fmt}}{b:>10{fmt}}{ratio:>13}{target:>18}")

    print(f"{'':<40}{'round-robin':>12}{'router':>10}{'router/rr':>13}{'target':>18}")
    row(
        "throughput, images/s",
        rr.throughput,
        rt.throughput,
        ".2f",
        f"{throughput:.2f}",
        f">= {THROUGHPUT_TARGET} {verdict(throughput, THROUGHPUT_TARGET)}",
    )
    for q, name in ((0.5, "p50"), (0.95, "p95")):
        a, b = rr.percentile(q), rt.percentile(q)
        row(f"{name} latency, s", a, b, ".3f", f"{b / a:.2f}")
    row(
        "GPU-tier hit rate",
        rr.hit_rate,
        rt.hit_rate,
        ".2f",
        f"{hit_ratio:.2f}",
        f">= {HIT_RATE_TARGET} {verdict(hit_ratio, HIT_RATE_TARGET)}",
    )
    row("fresh loads (disk -> CPU tier)", rr.fresh_loads, rt.fresh_loads, ".0f")
    row("  per 100 requests", rr.per_100(rr.fresh_loads), rt.per_100(rt.fresh_loads), ".1f")
    row("pods serving a request's adapter", rr.spread / rr.served, rt.spread / rt.served, ".2f")
    row(
        "  holding it in memory at round start",
        rr.held / rr.requests,
        rt.held / rt.requests,
        ".2f",
    )
    per_request: list[tuple[str, Callable[[figures.Tally], float]]] = [
        ("the pods' ms per request: generation", lambda t: t.generation_s),
        ("                          fresh loads", lambda t: t.fresh_load_s),
        ("                          slot copies", lambda t: t.slot_copy_s),
        ("CPU ms per request: inference pods", lambda t: t.inference_cpu_s),
        ("                    router pods", lambda t: t.router_cpu_s),
    ]
    for name, seconds in per_request:
        row(name, rr.ms(seconds(rr)), rt.ms(seconds(rt)), ".1f")
    cpu = [t.ms(t.inference_cpu_s + t.router_cpu_s) for t in (rr, rt)]
    row("                    both", cpu[0], cpu[1], ".1f")
    pairs = [b / a for a, b in zip(rr.per_round, rt.per_round, strict=True)]
    print(
        "throughput router/round-robin per round pair: "
        + " ".join(f"{x:.2f}" for x in pairs)
        + f" (median {statistics.median(pairs):.2f})"
    )
    both = [rr, rt]
    generation = sum(t.generation_s for t in both) / sum(t.generations for t in both)
    fresh = sum(t.fresh_load_s for t in both) / max(1.0, sum(t.fresh_loads for t in both))
    copy = sum(t.slot_copy_s for t in both) / max(1.0, sum(t.slot_copies for t in both))
    print(
        f"each, as the pods timed it (both routes): a generation {generation * 1000:.1f} ms,"
        f" a fresh load {fresh * 1000:.1f} ms, a slot copy {copy * 1000:.1f} ms"
    )
    # What the hit rates alone are worth: a request costs a generation plus its route's misses,
    # each at the time per event of both routes together (a route's own times carry the
    # contention of its rounds).
    rr_ms, rt_ms = (
        1000 * (generation + (t.fresh_loads * fresh + t.slot_copies * copy) / t.requests)
        for t in (rr, rt)
    )
    print(
        f"a generation plus each route's misses: round-robin {rr_ms:.1f} ms, router"
        f" {rt_ms:.1f} ms a request; the throughput ratio the misses alone allow:"
        f" {rr_ms / rt_ms:.2f}"
    )
    print(
        f"throughput router/round-robin that a machine bound by these pods' CPU would give:"
        f" {cpu[0] / cpu[1]:.2f}"
    )
    streams = [
        zipf_stream(args.requests, args.adapters, args.zipf, seed=args.seed + 1 + r)
        for r in range(args.rounds)
    ]
    counts = sorted(collections.Counter(m for st in streams for m in st).values(), reverse=True)
    slots = args.pods * args.max_loras
    print(
        f"the measured streams: the {args.max_loras} most requested adapters took"
        f" {sum(counts[: args.max_loras]) / sum(counts):.0%} of the requests (what every pod's"
        f" slots can hold), the {slots} most {sum(counts[:slots]) / sum(counts):.0%} (what"
        f" {args.pods} x {args.max_loras} slots hold, one copy each)"
    )
    total = sum(rt.routes.values())
    reasons = ", ".join(f"{k} {v / total:.0%}" for k, v in rt.routes.most_common())
    print(f"the router's choices (x-lora-route): {reasons}")
    for t in both:
        if not (t.requests == round(t.lookups) == t.served):
            print(
                f"NOTE {t.label}: {t.requests} requests sent, the pods counted {t.lookups:.0f}"
                f" lookups and {t.served} adapter uses"
            )
    print(
        "hit rate: lookups that found the adapter in a GPU slot (the pods' counter); fresh loads:"
        " adapters read from disk\ninto the CPU tier; pods serving a request's adapter: in its"
        " round (GET /v1/adapters hits), and holding it in\nthe CPU or GPU tier at the round's"
        " start; the pods' ms: wall time in the pipeline per request (the pods share\nthe"
        " cores); CPU ms: the containers' processes per request (the router pods also poll the"
        " pods' residency\nduring round-robin rounds)."
    )
    return throughput, hit_ratio
