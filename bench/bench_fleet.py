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

import sys

from lora_bench.fleet import cli

if __name__ == "__main__":
    sys.exit(cli.run(__doc__))
