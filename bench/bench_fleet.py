"""Fleet benchmark: the adapter-aware router against kube-proxy's spreading, on the same pods.

One run starts a local cluster (lora-devcluster, in a temporary directory, the project's images
built first if the tree changed), `helm install`s charts/lora-operator with N inference pods and
the router (the chart's defaults: 2 replicas), has the operator stage K LoRAAdapters without
spec.replicas (every pod holds every adapter: the best a plain Service can do), and sends a
Zipf(1.1) request stream over the K adapters to the same pods two ways:

  round-robin  through `<fullname>-inference-pods`, the Service that selects the pods: kube-proxy
               (iptables mode) picks a pod at random for each connection, and the client opens
               one connection per request, so requests spread evenly over the pods;
  router       through `<fullname>-inference`, which selects the router pods: each request goes
               to a pod holding its adapter in a GPU slot, else in the CPU tier, else with a
               free slot, within the router's load bound.

The load comes from inside the cluster: a load-generator pod (the operator image: python3 and
aiohttp) answers `POST /round` through the API server's proxy by sending one round of requests
to a Service's DNS name, a fixed number in flight, each on a new connection, and returns (and
logs, one JSON line per round) the wall time, each latency and how the router routed. The
routes alternate by rounds of `--requests` requests: each pair of rounds sends the same stream
(same seed), the route that goes first alternates, so drifts in the machine's load hit both
alike; a warm-up round per route comes first and is not counted (the router sees the pods
report their residency before measuring). Each measured round starts where the other route
left the pods, while a fleet runs one route only, so it begins with `--settle` requests of
its own (another stream of the same distribution, not counted): the pods' tiers come to what
that route makes of them, and the counted requests see that route's own state.

Per route it reports throughput (images/s), p50/p95 latency and, from the pods' own counters
read through the API server before and after every round (GET /metrics and GET /v1/adapters):
  GPU-tier hit rate  lora_adapter_lookups_total{result="hit"} / all lookups: the share of
                     requests whose adapter was already in a GPU slot. The pods count one lookup
                     per adapter per batch, so the pods run --max-batch-size 1 and a lookup is
                     one request (checked against GET /v1/adapters' per-adapter `hits`, which
                     counts requests);
  fresh loads        lora_adapter_loads_total{tier="cpu",result="ok"}: adapters read from disk
                     into the CPU tier during the round;
  spread             from /v1/adapters `hits` and `tier`: for each request, how many pods
                     served its adapter in its round, and how many held it in memory (CPU or
                     GPU tier) when the round began;
  the pods' own time per request: generation, fresh loads and slot copies
                     (lora_generation_seconds, lora_adapter_load_seconds), and the CPU time of the
                     inference and router containers (their host processes).
Targets: the router at least 1.5x round-robin's throughput and 2x its GPU-tier hit rate.

The model and the sizes. The cluster's preparation Job builds the tiny SD 1.5 only (a full-width
SD 1.5, 4 GB in float32 and about 7 s an image on one of these cores, does not fit four pods on
a 2-core machine), so the pods serve it with one torch thread each, at 64x64 pixels and 1
denoising step, with rank 16/32/64 adapters (half of them with text-encoder layers). Measured
alone on one core, a fresh load (read and convert the file) costs about 6 ms and a copy into a
slot about 2 ms against a generation of about 55 ms: about 12% and 3% of a request. On a GPU
with a full-size SDXL at 20 steps (bench/gpu_miss_costs.py) a rank-64 adapter's first use costs
about 45% of a one-image generation and its copy into a slot about 1%. The run prints the times
the pods measured. The tiers are the chart's defaults: --max-loras 4 GPU slots and
--max-cpu-loras 32 (< K) per pod.

    .venv/bin/python bench/bench_fleet.py             # N=4, K=100, 8 round pairs of 100 requests
    .venv/bin/python bench/bench_fleet.py --quick     # 2 round pairs of 40 requests

Needs root and the devcluster binaries (`make binaries`), like the cluster tests. The last line
always reads
    fleet: throughput router/round-robin = X.XX, hit rate router/round-robin = Y.YY
Results go in docs/benchmarks.md together with the command.

Simulated GPU pods (`--simulate PROFILE`, `--simulate-suite`). The pods run
`lora-inference serve --simulate PROFILE` (the chart's inference.extraArgs): the real server
with a pipeline that sleeps for a GPU's measured costs and imports no torch, so tens of pods
fit here. Three routes on the same pods: round-robin (the pods' Service), least-queued (the load
generator sends each request straight to the pod with the fewest of its requests in flight: a
least-request balancer without affinity) and the router; each cell is a stream (Zipf(1.1) or
uniform over the K adapters) and a loop: closed (`--concurrency` in flight, default 2 per pod)
or open (Poisson arrivals at `--load-fraction` of the fleet's no-miss bound, 0.8: every latency
timed from its arrival). Per route: throughput, p50/p95, GPU-tier hit rate, fresh loads per 100
requests and the throughput over the no-miss bound (the profile's one-image call, merged, on
every pod back to back); then where the time went: the pods' pipelines busy (generations and
slot copies over N x the rounds' wall time), the copies' and reads' milliseconds per request, the
CPU of the pods and the routers per request, and how busy the whole machine was. Throughput here
is steady-state: the rate of the answers between each round's first answer and its last request
sent (a least-squares slope, `steady_window`), so a round's fill and drain, which a short round
weighs heavily and a bound never counts, are left out; latencies count every request. Each
measured round of a route follows `--settle` requests of its own; the route that goes first
rotates. The adapters are placed on every pod (`--replicas N` sets spec.replicas instead). The
requests ask for the profile's size and steps.

    .venv/bin/python bench/bench_fleet.py --simulate h200-sdxl-4step --pods 16 --adapters 1000
    .venv/bin/python bench/bench_fleet.py --simulate-suite --pods 16 --adapters 1000

The suite runs both bundled profiles (a cluster each) over both streams and loops and ends with
    fleet-sim: throughput router/round-robin 4step = X.XX, 20step = Y.YY, bound fraction
    4step = Z.ZZ, worst cell = W.WW
(one line; the Zipf closed-loop cells; worst cell: the lowest router/round-robin throughput of
any cell).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from lora_demo import manifests, release
from lora_demo.manifests import MODEL_NAME, RELEASE, AdapterSource, Obj
from lora_devcluster import cluster as cluster_mod
from lora_devcluster import images
from lora_devcluster.harness import ApiError, Harness
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inference import zipf_stream

NS = "fleet"
ROUTES = {  # label -> the Service it sends to
    "round-robin": f"{RELEASE}-inference-pods",
    "router": manifests.SERVICE,
}
ROUTER_LABELS = "app.kubernetes.io/component=router"
LOADGEN = "loadgen"
LOADGEN_PORT = 8080
RANKS = (16, 32, 64)
THROUGHPUT_TARGET = 1.5
HIT_RATE_TARGET = 2.0
SETTLE_SEED = 10_000  # settle streams' seeds: apart from the measured rounds' (seed + 1 + r)

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


# -- what goes on the cluster (pure) -------------------------------------------------------------


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
    values = manifests.local_values(NS, replicas=args.pods)
    values["inference"].update(
        maxLoras=args.max_loras,
        maxCpuLoras=args.max_cpu_loras,
        maxBatchSize=1,
        maxQueue=64,
        extraEnv=[{"name": "OMP_NUM_THREADS", "value": "1"}],
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


# -- the pods' own counters ------------------------------------------------------------------------


@dataclass(frozen=True)
class Snapshot:
    """Every inference pod's counters at one moment, and the CPU time of the containers."""

    metrics: dict[str, dict[str, float]]  # pod -> sample -> value
    hits: dict[str, dict[str, int]]  # pod -> adapter -> requests (GET /v1/adapters `hits`)
    tiers: dict[str, dict[str, str]]  # pod -> adapter -> gpu, cpu or disk (GET /v1/adapters)
    inference_cpu_s: float
    router_cpu_s: float


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{label=value,...}': value}, buckets left out."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.endswith(("_bucket", "_created")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = float(s.value)
    return out


def cpu_seconds(processes: list[psutil.Process]) -> float:
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def snapshot(
    h: Harness, pods: list[str], inference: list[psutil.Process], router: list[psutil.Process]
) -> Snapshot:
    metrics, hits, tiers = {}, {}, {}
    for pod in pods:
        status, raw = h.proxy(NS, release.pod_target(pod), "/metrics", timeout=30)
        if status != 200:
            raise RuntimeError(f"/metrics of {pod} answered {status}")
        metrics[pod] = parse_metrics(raw.decode())
        listing = release.call(h, NS, release.pod_target(pod), "/v1/adapters")
        hits[pod] = {a["id"]: int(a["hits"]) for a in listing["data"]}
        tiers[pod] = {a["id"]: str(a["tier"]) for a in listing["data"]}
    return Snapshot(metrics, hits, tiers, cpu_seconds(inference), cpu_seconds(router))


def counted(before: Snapshot, after: Snapshot, sample: str) -> float:
    """The increase of one sample, summed over the pods."""
    return sum(
        after.metrics[p].get(sample, 0.0) - before.metrics[p].get(sample, 0.0)
        for p in after.metrics
    )


# -- one route's figures -------------------------------------------------------------------------


def steady_window(done: list[float], last_sent: float) -> tuple[float, float] | None:
    """A round's rate while its load was fully on, and over how many seconds (pure): from its
    first answer to its last request sent, the slope of the answers counted against time (a
    least-squares line). Before the first answer the pods are filling; after the last request is
    sent the round drains with fewer requests in flight than the route was given, pods idling
    while the last ones finish. Neither is the steady state a no-miss bound describes, and both
    weigh more the shorter the round. A slope, not a count over the window: pods that started
    together answer in waves, and a count's ends would fall on a wave or between two. None when
    the round is too short to have such a window (fewer than 3 answers in it)."""
    if not done:
        return None
    first = min(done)
    inside = sorted(t for t in done if t <= last_sent)
    seconds = last_sent - first
    if len(inside) < 3 or seconds <= 0 or inside[-1] == inside[0]:
        return None
    mean_t = statistics.fmean(inside)
    mean_n = (len(inside) - 1) / 2
    covariance = sum((t - mean_t) * (n - mean_n) for n, t in enumerate(inside))
    variance = sum((t - mean_t) ** 2 for t in inside)
    return covariance / variance, seconds


def steady_rate(result: Obj) -> float:
    """One round's requests a second in its steady window, else over the whole round."""
    steady = steady_window(result.get("done", []), result.get("last_sent", 0.0))
    return steady[0] if steady else result["requests"] / result["wall"]


@dataclass
class Tally:
    """One route, summed over its measured rounds."""

    label: str
    requests: int = 0
    wall_s: float = 0.0
    latencies: list[float] = field(default_factory=list)
    gpu_hits: float = 0.0
    lookups: float = 0.0
    served: int = 0  # requests the pods counted per adapter (/v1/adapters hits)
    fresh_loads: float = 0.0
    fresh_load_s: float = 0.0
    slot_copies: float = 0.0
    slot_copy_s: float = 0.0
    generations: float = 0.0
    generation_s: float = 0.0
    inference_cpu_s: float = 0.0
    router_cpu_s: float = 0.0
    spread: int = 0  # summed over requests: the pods that served its adapter in its round
    held: int = 0  # summed over requests: the pods holding its adapter in memory at round start
    per_round: list[float] = field(default_factory=list)  # images/s of each round
    steady_requests: float = 0.0  # each round's steady rate x its window (`steady_window`)
    steady_s: float = 0.0  # the steady windows' length, summed
    host_busy_s: float = 0.0  # the machine's CPU time spent (all cores) during the rounds
    host_s: float = 0.0  # the machine's CPU time available (all cores) during the rounds
    routes: collections.Counter[str] = field(default_factory=collections.Counter)

    def add_answers(self, result: Obj) -> None:
        """What the load generator measured of one round: its answers and their times."""
        self.requests += int(result["requests"])
        self.wall_s += float(result["wall"])
        self.per_round.append(result["requests"] / result["wall"])
        steady = steady_window(result.get("done", []), result.get("last_sent", 0.0))
        if steady is not None:
            self.steady_requests += steady[0] * steady[1]
            self.steady_s += steady[1]
        self.latencies += [float(x) for x in result["latencies"]]
        self.routes.update(result["routes"])

    def add(self, stream: list[str], result: Obj, before: Snapshot, after: Snapshot) -> None:
        self.add_answers(result)
        self.gpu_hits += counted(before, after, "lora_adapter_lookups_total{result=hit}")
        self.lookups += sum(
            counted(before, after, f"lora_adapter_lookups_total{{result={r}}}")
            for r in ("hit", "miss")
        )
        self.fresh_loads += counted(before, after, "lora_adapter_loads_total{result=ok,tier=cpu}")
        self.fresh_load_s += counted(before, after, "lora_adapter_load_seconds_sum{tier=cpu}")
        self.slot_copies += counted(before, after, "lora_adapter_load_seconds_count{tier=gpu}")
        self.slot_copy_s += counted(before, after, "lora_adapter_load_seconds_sum{tier=gpu}")
        self.generations += counted(before, after, "lora_generation_seconds_count{}")
        self.generation_s += counted(before, after, "lora_generation_seconds_sum{}")
        self.inference_cpu_s += after.inference_cpu_s - before.inference_cpu_s
        self.router_cpu_s += after.router_cpu_s - before.router_cpu_s
        uses: dict[str, list[int]] = collections.defaultdict(list)  # adapter -> uses per pod
        for pod, hits in after.hits.items():
            for adapter, n in hits.items():
                used = n - before.hits.get(pod, {}).get(adapter, 0)
                if used > 0:
                    uses[adapter].append(used)
        self.served += sum(sum(per_pod) for per_pod in uses.values())
        self.spread += sum(len(per_pod) * sum(per_pod) for per_pod in uses.values())
        self.held += sum(
            sum(tiers.get(adapter) in ("gpu", "cpu") for tiers in before.tiers.values())
            for adapter in stream
        )

    @property
    def throughput(self) -> float:
        return self.requests / self.wall_s

    @property
    def steady_throughput(self) -> float:
        """Requests a second while the rounds' load was fully on (`steady_window`, the rounds'
        rates weighted by their windows); the whole rounds' rate when no round had a window."""
        return self.steady_requests / self.steady_s if self.steady_s else self.throughput

    @property
    def hit_rate(self) -> float:
        return self.gpu_hits / self.lookups if self.lookups else 0.0

    def percentile(self, q: float) -> float:
        """As bench_inference reports them: the median, and the value at index int(q n)."""
        ordered = sorted(self.latencies)
        if q == 0.5:
            return statistics.median(ordered)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def add_host(self, before: Any, after: Any) -> None:
        """The machine's CPU time over a round, from two `psutil.cpu_times()` (guest time is
        counted in user time already)."""
        spent = {f: getattr(after, f) - getattr(before, f) for f in after._fields}
        for counted_twice in ("guest", "guest_nice"):
            spent.pop(counted_twice, None)
        self.host_s += sum(spent.values())
        self.host_busy_s += sum(v for f, v in spent.items() if f not in ("idle", "iowait"))

    def ms(self, seconds: float) -> float:
        """Milliseconds per request."""
        return 1000 * seconds / self.requests

    def per_100(self, count: float) -> float:
        return 100 * count / self.requests


# -- the run -------------------------------------------------------------------------------------


def pids_of(h: Harness, selector: str, container: str) -> list[psutil.Process]:
    out = []
    for pod in h.pods(NS, selector):
        out += [psutil.Process(pid) for pid in h.container_pids(pod["metadata"]["uid"], container)]
    if not out:
        raise RuntimeError(f"no process of the {container} containers ({selector}) on the node")
    return out


def send_round(h: Harness, spec: Obj) -> Obj:
    target = f"pods/{LOADGEN}:{LOADGEN_PORT}"
    status, raw = h.proxy(NS, target, "/round", spec, timeout=900)
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
        "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}}
    )
    release.prepare_model(h, NS)
    say("tiny SD 1.5 written onto its claim")
    release.install_crd(h)
    values = build_sim_values(args) if args.simulate else build_values(args)
    release.install_chart(h, NS, values, work)
    sources = build_sources(args.adapters)
    release.run_job(h, NS, build_adapters_job(h.image("inference"), sources))
    say(f"helm install done; {len(sources)} adapter sources written onto the adapter volume")
    pods = release.ready_inference_pods(h, NS, args.pods, timeout=args.timeout)
    say(f"{args.pods} inference pods Ready")
    h.apply([sim_adapter(s, args.replicas) for s in sources], NS)
    want = args.replicas or args.pods
    for s in sources:
        release.wait_adapter_ready(h, NS, s.name, f"{want}/{want}", timeout=args.timeout)
    say(f"{len(sources)} LoRAAdapters Ready {want}/{want}")
    h.apply(build_loadgen_pod(h.image("operator")), NS)

    def routers_and_loadgen_ready() -> bool:
        routers = [p for p in h.pods(NS, ROUTER_LABELS) if release.is_ready(p)]
        status, _ = h.proxy(NS, f"pods/{LOADGEN}:{LOADGEN_PORT}", "/ready", timeout=5)
        return len(routers) == 2 and status == 200

    h.wait_for("the router and the load generator", routers_and_loadgen_ready, timeout=300)
    say("router pods and the load generator Ready")
    return [p["metadata"]["name"] for p in pods]


def measure(h: Harness, pods: list[str], args: argparse.Namespace) -> dict[str, Tally]:
    inference = pids_of(h, manifests.INFERENCE_LABELS, "inference")
    router = pids_of(h, ROUTER_LABELS, "router")
    # Warm-up, not counted: every pod's first requests, and the router's first residency reports.
    warm = zipf_stream(args.requests, args.adapters, args.zipf, seed=args.seed)
    for label in ROUTES:
        send_round(h, build_round(warm, args, label, seed=0))
    time.sleep(3)  # the router reads residency every second
    tallies = {label: Tally(label) for label in ROUTES}
    labels = list(ROUTES)
    for r in range(args.rounds):
        seed = args.seed + 1 + r
        stream = zipf_stream(args.requests, args.adapters, args.zipf, seed=seed)
        line = []
        settle = zipf_stream(args.settle, args.adapters, args.zipf, seed=SETTLE_SEED + seed)
        for label in labels if r % 2 == 0 else labels[::-1]:
            if settle:
                send_round(h, build_round(settle, args, label, seed=SETTLE_SEED + seed))
            before = snapshot(h, pods, inference, router)
            result = send_round(h, build_round(stream, args, label, seed=seed * 1000))
            after = snapshot(h, pods, inference, router)
            tally = tallies[label]
            hits, lookups = tally.gpu_hits, tally.lookups
            tally.add(stream, result, before, after)
            rate = (tally.gpu_hits - hits) / max(1.0, tally.lookups - lookups)
            line.append(
                f"{label} {result['requests'] / result['wall']:.2f} images/s, hit rate {rate:.2f}"
            )
        print(f"  round {r + 1}/{args.rounds}: " + "; ".join(line), flush=True)
    return tallies


# -- the report ----------------------------------------------------------------------------------


def verdict(ratio: float, target: float) -> str:
    return "met" if ratio >= target else "not met"


def print_report(tallies: dict[str, Tally], args: argparse.Namespace) -> tuple[float, float]:
    rr, rt = tallies["round-robin"], tallies["router"]
    memory = psutil.virtual_memory().total / 2**30
    ranks = "/".join(str(r) for r in RANKS)
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
    per_request: list[tuple[str, Callable[[Tally], float]]] = [
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


# -- the simulated fleet (--simulate, --simulate-suite) -------------------------------------------

SIM_ROUTES = ("round-robin", "least-queued", "router")
SIM_PROFILES = ("h200-sdxl-4step", "h200-sdxl-20step")
STREAMS = ("zipf", "uniform")
LOOPS = ("closed", "open")


def build_sim_values(args: argparse.Namespace) -> Obj:
    """The chart's values for simulated pods: the profile's costs, no torch, the chart's
    default tiers, one image per call (a lookup is a request and the no-miss bound is exact)."""
    values = manifests.local_values(NS, replicas=args.pods)
    values["inference"].update(
        maxLoras=args.max_loras,
        maxCpuLoras=args.max_cpu_loras,
        maxBatchSize=1,
        maxQueue=256,
        extraArgs=[f"--simulate={args.simulate}"],
    )
    return values


def sim_adapter(source: AdapterSource, replicas: int | None) -> Obj:
    obj = manifests.adapter(source)
    if replicas is not None:
        obj["spec"]["replicas"] = replicas
    return obj


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
    tallies: dict[str, Tally]
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)

    def ratio(self, route: str = "router") -> float:
        return self.tallies[route].steady_throughput / self.tallies["round-robin"].steady_throughput

    def p95_ratio(self, route: str = "router") -> float:
        return self.tallies[route].percentile(0.95) / self.tallies["round-robin"].percentile(0.95)


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


def measure_sim(h: Harness, pods: list[str], args: argparse.Namespace) -> list[Cell]:
    from lora_inference.simulate.profile import load_profile

    profile = load_profile(args.simulate)
    inference = pids_of(h, manifests.INFERENCE_LABELS, "inference")
    router = pids_of(h, ROUTER_LABELS, "router")
    pod_urls = [
        f"http://{p['status']['podIP']}:8000/v1/images/generations"
        for p in h.pods(NS, manifests.INFERENCE_LABELS)
    ]
    bound = profile.no_miss_images_per_s(args.pods)
    cells = []
    for stream_kind in args.streams:
        for loop in args.loops:
            rate = args.load_fraction * bound if loop == "open" else None
            cell = Cell(
                args.simulate, stream_kind, loop, args.pods, args.adapters, bound, rate,
                {label: Tally(label) for label in SIM_ROUTES},
            )  # fmt: skip
            for r in range(args.rounds):
                seed = args.seed + 1 + r
                stream = stream_of(stream_kind, args.requests, args.adapters, args.zipf, seed)
                settle = stream_of(
                    stream_kind, args.settle, args.adapters, args.zipf, SETTLE_SEED + seed
                )
                order = SIM_ROUTES[r % 3 :] + SIM_ROUTES[: r % 3]
                line = []
                for label in order:
                    if settle:
                        send_round(
                            h, sim_round(settle, args, label, SETTLE_SEED + seed, pod_urls, None)
                        )
                    before = snapshot(h, pods, inference, router)
                    host = psutil.cpu_times()
                    result = send_round(
                        h, sim_round(stream, args, label, seed * 1000, pod_urls, rate)
                    )
                    cell.tallies[label].add_host(host, psutil.cpu_times())
                    after = snapshot(h, pods, inference, router)
                    cell.rejected[label] += int(result.get("rejected", 0))
                    tally = cell.tallies[label]
                    hits, lookups = tally.gpu_hits, tally.lookups
                    tally.add(stream, result, before, after)
                    hit = (tally.gpu_hits - hits) / max(1.0, tally.lookups - lookups)
                    line.append(f"{label} {steady_rate(result):.2f} images/s, hit {hit:.2f}")
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


def run_sim(args: argparse.Namespace, node_images: object) -> list[Cell]:
    """One cluster: the chart with simulated pods, K adapters Ready, every cell measured."""
    with tempfile.TemporaryDirectory(prefix="lora-bench-fleet-") as scratch:
        work = Path(scratch)
        with cluster_mod.joined(
            work / "cluster", node_images=node_images, die_with_parent=True
        ) as c:
            h = Harness(c)
            try:
                pods = set_up(h, args, work)
                cells = measure_sim(h, pods, args)
            except BaseException:
                print(h.describe_pods(NS), file=sys.stderr)
                print(h.container_logs(NS)[-6000:], file=sys.stderr)
                raise
        left = cluster_mod.leftovers(work / "cluster")
    print(f"cluster torn down; {f'LEFT BEHIND: {left}' if left else 'nothing left behind'}")
    return cells


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


def main_sim(args: argparse.Namespace, node_images: object) -> int:
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="2 round pairs of 40 requests")
    parser.add_argument("--pods", type=int, default=4, help="inference pods (N)")
    parser.add_argument("--adapters", type=int, default=100, help="LoRAAdapters (K)")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds per route")
    parser.add_argument("--requests", type=int, default=100, help="requests per round")
    parser.add_argument(
        "--concurrency", type=int, help="requests in flight (default: 8; simulated: 2 per pod)"
    )
    parser.add_argument(
        "--settle",
        type=int,
        default=50,
        help="requests a route sends before each of its rounds, not counted (0: none)",
    )
    parser.add_argument("--zipf", type=float, default=1.1, help="the stream's Zipf exponent")
    parser.add_argument("--size", type=int, default=64, help="image side, pixels")
    parser.add_argument("--steps", type=int, default=1, help="denoising steps")
    parser.add_argument("--max-loras", type=int, default=4, help="GPU slots per pod")
    parser.add_argument("--max-cpu-loras", type=int, default=32, help="CPU tier per pod")
    parser.add_argument("--seed", type=int, default=0, help="the streams' first seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="per wait, seconds")
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="simulated GPU pods (lora-inference serve --simulate PROFILE, e.g. h200-sdxl-4step)"
        ": round-robin, least-queued and the router, on each stream and loop",
    )
    parser.add_argument(
        "--simulate-suite",
        action="store_true",
        help=f"every cell: {', '.join(SIM_PROFILES)} x {', '.join(STREAMS)} x {', '.join(LOOPS)}",
    )
    parser.add_argument(
        "--replicas", type=int, help="spec.replicas of every adapter (default: on every pod)"
    )
    parser.add_argument("--streams", default=",".join(STREAMS), help="simulated: zipf, uniform")
    parser.add_argument("--loops", default=",".join(LOOPS), help="simulated: closed, open")
    parser.add_argument(
        "--load-fraction",
        type=float,
        default=0.8,
        help="open loop: requests per second as a fraction of the no-miss bound",
    )
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.requests = 2, 40
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # tear the cluster down
    node_images = images.ensure()
    if args.simulate or args.simulate_suite:
        return main_sim(args, node_images)
    args.concurrency = args.concurrency or 8
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="lora-bench-fleet-") as scratch:
        work = Path(scratch)
        with cluster_mod.joined(
            work / "cluster", node_images=node_images, die_with_parent=True
        ) as c:
            h = Harness(c)
            try:
                pods = set_up(h, args, work)
                tallies = measure(h, pods, args)
            except BaseException:
                print(h.describe_pods(NS), file=sys.stderr)
                print(h.container_logs(NS)[-6000:], file=sys.stderr)
                raise
        left = cluster_mod.leftovers(work / "cluster")
    print(
        f"cluster up to torn down in {time.monotonic() - started:.0f} s; "
        + (f"LEFT BEHIND: {left}" if left else "nothing left behind")
    )
    throughput, hit_ratio = print_report(tallies, args)
    print(
        f"fleet: throughput router/round-robin = {throughput:.2f}, "
        f"hit rate router/round-robin = {hit_ratio:.2f}"
    )
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (cluster_mod.ClusterError, ApiError, AssertionError, RuntimeError) as e:
        print(f"bench_fleet failed: {e}", file=sys.stderr)
        sys.exit(1)
