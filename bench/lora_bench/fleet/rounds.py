"""The fleet on the cluster: the chart, K adapters Ready and the load generator set up, and the
measured rounds of the real pods, each route in turn."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bench_inference import zipf_stream
from lora_demo import manifests, release
from lora_demo.manifests import Obj
from lora_devcluster.harness import Harness

from lora_bench.fleet import counters, figures, objects

SETTLE_SEED = 10_000  # settle streams' seeds: apart from the measured rounds' (seed + 1 + r)


def send_round(h: Harness, spec: Obj) -> Obj:
    target = f"pods/{objects.LOADGEN}:{objects.LOADGEN_PORT}"
    status, raw = h.proxy(objects.NS, target, "/round", spec, timeout=900)
    if status != 200:
        raise RuntimeError(f"the load generator answered {status}: {raw[:500]!r}")
    result: Obj = json.loads(raw)
    if result["failures"]:
        raise RuntimeError(
            f"{len(result['failures'])} of {len(spec['requests'])} requests through "
            f"{spec['label']} failed: {result['failures'][:3]}"
        )
    return result


def set_up(h: Harness, args: argparse.Namespace, work: Path) -> list[str]:
    """The model, the chart, K staged adapters Ready on every pod, the router and the load
    generator Ready. Returns the inference pods' names."""
    started = time.monotonic()

    def say(message: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {message}", flush=True)

    h.create(
        "/api/v1/namespaces",
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": objects.NS}},
    )
    release.prepare_model(h, objects.NS)
    say("tiny SD 1.5 written onto its claim")
    release.install_crd(h)
    values = objects.build_sim_values(args) if args.simulate else objects.build_values(args)
    release.install_chart(h, objects.NS, values, work)
    sources = objects.build_sources(args.adapters)
    release.run_job(h, objects.NS, objects.build_adapters_job(h.image("inference"), sources))
    say(f"helm install done; {len(sources)} adapter sources written onto the adapter volume")
    pods = release.ready_inference_pods(h, objects.NS, args.pods, timeout=args.timeout)
    say(f"{args.pods} inference pods Ready")
    h.apply([objects.sim_adapter(s, args.replicas) for s in sources], objects.NS)
    want = args.replicas or args.pods
    for s in sources:
        release.wait_adapter_ready(h, objects.NS, s.name, f"{want}/{want}", timeout=args.timeout)
    say(f"{len(sources)} LoRAAdapters Ready {want}/{want}")
    h.apply(objects.build_loadgen_pod(h.image("operator")), objects.NS)

    def routers_and_loadgen_ready() -> bool:
        routers = [p for p in h.pods(objects.NS, objects.ROUTER_LABELS) if release.is_ready(p)]
        status, _ = h.proxy(
            objects.NS, f"pods/{objects.LOADGEN}:{objects.LOADGEN_PORT}", "/ready", timeout=5
        )
        return len(routers) == 2 and status == 200

    h.wait_for("the router and the load generator", routers_and_loadgen_ready, timeout=300)
    say("router pods and the load generator Ready")
    return [p["metadata"]["name"] for p in pods]


def measure(h: Harness, pods: list[str], args: argparse.Namespace) -> dict[str, figures.Tally]:
    inference = counters.pids_of(h, manifests.INFERENCE_LABELS, "inference")
    router = counters.pids_of(h, objects.ROUTER_LABELS, "router")
    # Warm-up, not counted: every pod's first requests, and the router's first residency reports.
    warm = zipf_stream(args.requests, args.adapters, args.zipf, seed=args.seed)
    for label in objects.ROUTES:
        send_round(h, objects.build_round(warm, args, label, seed=0))
    time.sleep(3)  # the router reads residency every second
    tallies = {label: figures.Tally(label) for label in objects.ROUTES}
    labels = list(objects.ROUTES)
    for r in range(args.rounds):
        seed = args.seed + 1 + r
        stream = zipf_stream(args.requests, args.adapters, args.zipf, seed=seed)
        line = []
        settle = zipf_stream(args.settle, args.adapters, args.zipf, seed=SETTLE_SEED + seed)
        for label in labels if r % 2 == 0 else labels[::-1]:
            if settle:
                send_round(h, objects.build_round(settle, args, label, seed=SETTLE_SEED + seed))
            before = counters.snapshot(h, pods, inference, router)
            result = send_round(h, objects.build_round(stream, args, label, seed=seed * 1000))
            after = counters.snapshot(h, pods, inference, router)
            tally = tallies[label]
            hits, lookups = tally.gpu_hits, tally.lookups
            tally.add(stream, result, before, after)
            rate = (tally.gpu_hits - hits) / max(1.0, tally.lookups - lookups)
            line.append(
                f"{label} {result['requests'] / result['wall']:.2f} images/s, hit rate {rate:.2f}"
            )
        print(f"  round {r + 1}/{args.rounds}: " + "; ".join(line), flush=True)
    return tallies
