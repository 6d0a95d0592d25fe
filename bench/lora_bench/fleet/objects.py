"""What the fleet benchmark puts on the cluster (pure): the chart's values for real and simulated
pods, the adapters' sources and the Job that writes them, the load generator's pod and script,
and one round's request to it."""

from __future__ import annotations

import argparse
import json

from lora_demo import manifests
from lora_demo.manifests import MODEL_NAME, RELEASE, AdapterSource, Obj

NS = "fleet"
ROUTES = {  # label -> the Service it sends to
    "round-robin": f"{RELEASE}-inference-pods",
    "router": manifests.SERVICE,
}
ROUTER_LABELS = "app.kubernetes.io/component=router"
LOADGEN = "loadgen"
LOADGEN_PORT = 8080
RANKS = (16, 32, 64)


# The load generator: `POST /round` with {"url", "requests", "concurrency", "label"} sends the
# requests (each a generation body) from `concurrency` closed-loop clients, one connection per
# request (kube-proxy picks a pod per connection: kept-alive connections would pin the client to
# the few pods its connections landed on), and answers the wall time, the latencies, the
# failures and the router's x-lora-route reasons.
LOADGEN_SCRIPT = """
import asyncio, collections, json, random, sys, time
from aiohttp import ClientSession, ClientTimeout, TCPConnector, web

async def run_round(request):
    spec = await request.json()
    bodies = iter(spec["requests"])
    latencies, failures, routes = [], [], collections.Counter()
    done, sent = [], []  # when each answered request finished; when each request was sent
    rejected = 0
    # "pods": send each request straight to the pod with the fewest of this client's requests
    # in flight (least-queued, no affinity); else to "url" (a Service).
    pods = spec.get("pods") or []
    inflight = dict.fromkeys(pods, 0)
    rng = random.Random(spec.get("seed", 0))

    async def one(session, body, started):
        nonlocal rejected
        url = spec["url"]
        if pods:
            least = min(inflight.values())
            url = rng.choice([p for p, n in inflight.items() if n == least])
            inflight[url] += 1
        sent.append(time.perf_counter())
        try:
            async with session.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status == 429:
                    rejected += 1
                    return
                if resp.status != 200:
                    failures.append(f"{body['model']}: {resp.status} {text[:300]}")
                routes[resp.headers.get("x-lora-route", "none")] += 1
        finally:
            if pods:
                inflight[url] -= 1
        done.append(time.perf_counter())
        latencies.append(done[-1] - started)

    async def client(session):
        for body in bodies:
            await one(session, body, time.perf_counter())

    connector = TCPConnector(force_close=True, limit=0)
    async with ClientSession(connector=connector, timeout=ClientTimeout(total=900)) as session:
        started = time.perf_counter()
        rate = spec.get("rate")
        if rate:  # open loop: Poisson arrivals at `rate`, each timed from its arrival
            arrivals, tasks, at = random.Random(spec.get("seed", 0) + 1), [], started
            for body in bodies:
                at += arrivals.expovariate(rate)
                await asyncio.sleep(max(0.0, at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(session, body, at)))
            await asyncio.gather(*tasks)
        else:
            await asyncio.gather(*(client(session) for _ in range(spec["concurrency"])))
        wall = time.perf_counter() - started
    result = {"label": spec["label"], "requests": len(latencies), "wall": wall,
              "failures": failures, "routes": dict(routes), "rejected": rejected}
    print(json.dumps(result), flush=True)
    return web.json_response({**result, "latencies": latencies,
                              "done": [t - started for t in done],
                              "last_sent": max(sent) - started if sent else 0.0})

async def ready(request):
    return web.json_response({"status": "ready"})

app = web.Application(client_max_size=64 * 1024**2)
app.router.add_post("/round", run_round)
app.router.add_get("/ready", ready)
web.run_app(app, port=int(sys.argv[1]), print=None)
"""


# Every adapter written by one process: `lora-inference make-adapter` per adapter (what
# manifests.prepare_job runs) starts Python and loads the pipeline each time, minutes for 100.
WRITE_ADAPTERS = """
import json, sys
from pathlib import Path
from diffusers import DiffusionPipeline
from lora_inference.tools.random_adapters import write_random_adapter
model, adapters = Path(sys.argv[1]), json.loads(sys.argv[2])
pipe = DiffusionPipeline.from_pretrained(str(model))
for a in adapters:
    write_random_adapter(Path(a["uri"]), pipe, base_model=model.name, rank=a["rank"],
                         seed=a["seed"], text_encoder=a["text_encoder"], strength=a["strength"])
print(f"wrote {len(adapters)} adapters")
"""


def build_sources(k: int) -> tuple[AdapterSource, ...]:
    """K adapters named as `zipf_stream` names them, ranks 16/32/64, every other one with
    text-encoder layers (as bench_inference's representative mode)."""
    return tuple(
        AdapterSource(
            f"adapter-{i:02d}", seed=i, text_encoder=i % 2 == 1, rank=RANKS[i % len(RANKS)]
        )
        for i in range(k)
    )


def build_adapters_job(image: str, sources: tuple[AdapterSource, ...]) -> Obj:
    """The Job manifests.prepare_job builds (its claims, mounts and security context), with one
    process writing every adapter."""
    job = manifests.prepare_job("prepare-adapters", image, model=None, adapters=sources)
    spec = [
        {
            "uri": s.uri,
            "seed": s.seed,
            "rank": s.rank,
            "text_encoder": s.text_encoder,
            "strength": s.strength,
        }
        for s in sources
    ]
    model_dir = str(manifests.MODELS_MOUNT / MODEL_NAME)
    (container,) = job["spec"]["template"]["spec"]["containers"]
    container["command"] = ["python", "-c", WRITE_ADAPTERS, model_dir, json.dumps(spec)]
    return job


def build_values(args: argparse.Namespace) -> Obj:
    """The demo's CPU values with the chart's default tiers, one image per pipeline call (a
    lookup is then one request) and one torch thread per pod (four pods share two cores)."""
    return _values(args, maxQueue=64, extraEnv=[{"name": "OMP_NUM_THREADS", "value": "1"}])


def _values(args: argparse.Namespace, **inference: object) -> Obj:
    """The demo's local values for `args.pods` pods with the tiers of `args` and one image per
    pipeline call, and `inference`'s own settings of the inference pods."""
    values = manifests.local_values(NS, replicas=args.pods)
    values["inference"].update(
        maxLoras=args.max_loras, maxCpuLoras=args.max_cpu_loras, maxBatchSize=1, **inference
    )
    return values


def build_loadgen_pod(image: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": LOADGEN, "labels": {"app": LOADGEN}},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", LOADGEN_SCRIPT, str(LOADGEN_PORT)],
                    "securityContext": manifests.NON_ROOT,
                }
            ],
        },
    }


def build_round(stream: list[str], args: argparse.Namespace, label: str, seed: int) -> Obj:
    url = manifests.service_url(NS, "/v1/images/generations", service=ROUTES[label])
    bodies = [
        manifests.generation_request(model, size=args.size, steps=args.steps, seed=seed + i)
        for i, model in enumerate(stream)
    ]
    return {"url": url, "requests": bodies, "concurrency": args.concurrency, "label": label}


def build_sim_values(args: argparse.Namespace) -> Obj:
    """The chart's values for simulated pods: the profile's costs, no torch, the chart's
    default tiers, one image per call (a lookup is a request and the no-miss bound is exact)."""
    return _values(args, maxQueue=256, extraArgs=[f"--simulate={args.simulate}"])


def sim_adapter(source: AdapterSource, replicas: int | None) -> Obj:
    obj = manifests.adapter(source)
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    return obj


def sim_round(
    stream: list[str], args: argparse.Namespace, label: str, seed: int, pod_urls: list[str],
    rate: float | None,
) -> Obj:  # fmt: skip
    service = ROUTES["router" if label == "router" else "round-robin"]
    url = manifests.service_url(NS, "/v1/images/generations", service=service)
    bodies = [
        manifests.generation_request(model, size=args.size, steps=args.steps, seed=seed + i)
        for i, model in enumerate(stream)
    ]
    spec: Obj = {
        "url": url,
        "requests": bodies,
        "concurrency": args.concurrency,
        "label": label,
        "seed": seed,
    }
    if label == "least-queued":
        spec["pods"] = pod_urls
    if rate is not None:
        spec["rate"] = rate
    return spec
