"""Operator benchmark: apply -> Ready against the bare load calls, restart recovery, footprint.

One run starts its own local cluster (lora-devcluster, in a temporary directory), installs the
CRD, runs `python -m lora_operator` as a process and a Deployment of tiny SD 1.5 inference pods,
and prints one table with, for each N pods and K adapters:

  (a) apply -> Ready: from `kubectl apply -f` of K LoRAAdapters (one multi-document YAML) to all
      K Ready N/N, against the limit: the bare POST /v1/load_lora_adapter calls for the same K
      adapters on the same N pods with the operator's concurrency (one call at a time per pod,
      the pods in parallel), from copies of the revision directories the operator staged;
  (b) restart: SIGKILL one pod's server process and time it until the pod's /v1/models lists all
      K again, against the pod's own restart-to-Ready time plus the bare load of K on one pod;
  (c) at rest: the operator's RSS, and its requests to the API server over a quiet window after
      everything is Ready, per adapter (target: none beyond watches); then deletion: from
      `kubectl delete --all` to every object gone and no pod holding one, against the bare
      POST /v1/unload_lora_adapter calls for the same K on the same N pods;
  (d) staging: one large adapter file (64 MiB and 1 GiB by default) staged by the operator's
      store from a local https origin, a local S3 server (SeaweedFS) and a local OCI registry
      (docker-registry), against curl of the same bytes over the same HTTP to a file, with the
      staging process's peak RSS; the process stages a small file from the same kind of source
      first (its imports, its first client: timed apart), as a running operator has.

The operator authenticates as a ServiceAccount of its own, and FlowSchemas that match only that
account (by verb class and resource) let the API server count its requests exactly
(apiserver_flowcontrol_dispatched_requests_total), apart from the kubelet's and this script's:
the table gives API writes to LoRAAdapters and Event writes per adapter from apply to Ready,
and the detail the CPU time every kind of process on the machine used in that time. The script
observes cheaply, as it shares the machine: until every pod holds all K it reads the pods every
0.5 s, and it lists the K LoRAAdapters only after that; while they are deleted it asks for one.

    .venv/bin/python bench/bench_operator.py                          # N in 1,3,10; K in 1,50,200
    .venv/bin/python bench/bench_operator.py --pods 10 --adapters 1000  # the 1000-adapter row
    .venv/bin/python bench/bench_operator.py --quick                  # N in 1,3;    K in 1,50
    .venv/bin/python bench/bench_operator.py --staging only           # (d) alone, no cluster
    .venv/bin/python bench/bench_operator.py --pods 10 --adapters 1000 --replicas 2 --staging no

With `--replicas R` every adapter has `spec.replicas: R`: the operator places it on R of the N
pods, "held" means every adapter is on exactly its R placed pods, Ready means `Ready R/R`, the
bare limit loads each adapter on its placed pods only, and a killed pod is back when it lists
the adapters placed on it. The pods advertise a CPU tier of `--cpu-loras` adapters (placement
never gives a pod more).

With `--simulate PROFILE` it measures the operator at scale instead, on simulated GPU pods
(`lora-inference serve --simulate PROFILE`: no torch, so fifty fit on a small machine): K
adapters spread over NS namespaces, each namespace with N / NS pods of its own (an adapter
targets its own namespace's pods), each adapter on `spec.replicas: 2` pods or, for the Zipf head
that asks for half the requests, `spec.autoscale` from 2 to 4. `--pods`, `--adapters` and
`--namespaces` pair up, one (N, K, NS) after the other, each with an operator process of its
own; for each, phase by phase (apply -> every adapter Ready; at rest `--rest` s; an operator
restart -> the new process counts every adapter Ready; the API server frozen `--outage` s, then
restarted -> every adapter Ready again; delete all): wall time, the operator's API writes and
Events per adapter, its RSS and CPU, and its load and unload calls per pod; then the same placed
load calls made directly (the bare limit), the growth table, and the last line
`operator-scale: K=... N=... ready s = X, writes/adapter = Y.YY, rss MiB = Z, restart loads = W`.

    .venv/bin/python bench/bench_operator.py --simulate h200-sdxl-4step --pods 10,50
        --adapters 1000,10000 --namespaces 5,25                    # (one command line)
    .venv/bin/python bench/bench_operator.py --simulate h200-sdxl-4step --pods 6
        --adapters 200 --namespaces 3 --rest 20 --outage 15        # about 2 min

Needs root and the devcluster binaries (`make binaries`), like the cluster tests. Results go in
docs/benchmarks.md together with the command.
"""

from __future__ import annotations

import sys
from pathlib import Path

# The operator's cluster helpers are the cluster tests' (tests.support.cluster), from the checkout.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lora_bench.operator import cli

if __name__ == "__main__":
    cli.main(__doc__)
