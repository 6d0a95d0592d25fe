"""bench/bench_operator.py's command line: the flags, the model and the adapters, the cluster with
the operator and the inference pods, every configuration measured, and the report."""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import signal
import tempfile
import time
from pathlib import Path

import psutil
from diffusers import DiffusionPipeline
from lora_devcluster import images
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model

from lora_bench import cluster as bench_cluster
from lora_bench.operator import apiserver, configuration, pods, report, scale, staging
from tests.support import ROOT, cluster
from tests.support.cluster import MODEL_NAME

CRD = ROOT / "crds" / "lora.dev_loraadapters.yaml"


def parse_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(description: str | None) -> None:
    """`description`: the --help text (the script's docstring)."""
    # Stopped with SIGTERM (`kill`, a CI timeout), the cluster and the operator process it
    # started are torn down as after Ctrl-C, not left running.
    signal.signal(signal.SIGTERM, _terminated)
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="N in 1,3 and K in 1,50")
    parser.add_argument("--pods", type=parse_list, default=None, help="N values (1,3,10)")
    parser.add_argument("--adapters", type=parse_list, default=None, help="K values (1,50,200)")
    parser.add_argument("--quiet", type=float, default=35.0, help="quiet window, seconds")
    parser.add_argument("--settle", type=float, default=5.0, help="wait before the window")
    parser.add_argument("--timeout", type=float, default=900.0, help="per wait, seconds")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the operator's log here")
    parser.add_argument(
        "--staging", choices=("also", "only", "no"), default="also", help="(d), staging speed"
    )
    parser.add_argument(
        "--staging-mib", type=parse_list, default=[64, 1024], help="file sizes for (d), MiB"
    )
    parser.add_argument("--staging-repeats", type=int, default=2, help="runs per row of (d)")
    parser.add_argument(
        "--replicas", type=int, default=None, help="spec.replicas of every adapter (default: none)"
    )
    parser.add_argument(
        "--cpu-loras", type=int, default=None, help="the pods' --max-cpu-loras (default: 32)"
    )
    parser.add_argument(
        "--simulate",
        metavar="PROFILE",
        help="the operator at scale on simulated GPU pods (lora-inference serve --simulate "
        "PROFILE): --pods, --adapters and --namespaces pair up, one (N, K, NS) after the other",
    )
    parser.add_argument(
        "--namespaces", type=parse_list, default=None, help="with --simulate: NS values"
    )
    parser.add_argument(
        "--rest",
        type=lambda text: [float(x) for x in text.split(",") if x],
        default=[300.0],
        help="with --simulate: the at-rest phase, seconds (one, or one per (N, K, NS))",
    )
    parser.add_argument(
        "--outage",
        type=float,
        default=60.0,
        help="with --simulate: seconds the API server is unavailable",
    )
    parser.add_argument(
        "--after-outage",
        type=float,
        default=30.0,
        help="with --simulate: seconds counted after every adapter is Ready again",
    )
    args = parser.parse_args()
    if args.simulate:
        if not args.pods or not args.adapters:
            parser.error("--simulate needs --pods and --adapters")
        args.timeout = max(args.timeout, 1800.0)
        scale.main(args)
        return

    with tempfile.TemporaryDirectory(prefix="lora-bench-operator-") as scratch:
        work = Path(scratch)
        if args.staging != "only":
            rows, totals = measure_cluster(work, args)
        if args.staging != "no":
            print("(d) staging speed", flush=True)
            staging_rows = staging.measure_staging(work, args.staging_mib, args.staging_repeats)
        cpus = os.cpu_count()
        memory = psutil.virtual_memory().total / 2**30
        print(
            f"\nlora-operator on lora-devcluster, tiny sd15 inference pods on cpu; "
            f"{platform.machine()}, {cpus} cores, {memory:.0f} GiB; "
            f"{datetime.date.today().isoformat()}; operator --resync-seconds 30, "
            "--max-concurrent-loads 16"
            + (f"; spec.replicas {args.replicas}" if args.replicas is not None else "")
            + (f"; pods --max-cpu-loras {args.cpu_loras}" if args.cpu_loras is not None else "")
        )
        if args.staging != "only":
            report.print_table(rows, args)
            print(f"the operator's API requests over the whole run: {dict(sorted(totals.items()))}")
        if args.staging != "no":
            staging.print_staging(staging_rows)


def measure_cluster(
    work: Path, args: argparse.Namespace
) -> tuple[list[configuration.Row], dict[str, int]]:
    ns_values = args.pods or ([1, 3] if args.quick else [1, 3, 10])
    ks = args.adapters or ([1, 50] if args.quick else [1, 50, 200])
    started = time.perf_counter()
    model = write_tiny_model(work / "models" / MODEL_NAME, "sd15")
    cluster.readable_by_pods(work / "models")
    pipe = DiffusionPipeline.from_pretrained(str(model))
    volume = work / "volume"
    for i in range(max(ks)):
        write_random_adapter(
            volume / pods.NS / "src" / f"a-{i:04d}", pipe, base_model=MODEL_NAME, seed=i
        )
    del pipe
    print(f"tiny model and {max(ks)} adapters written in {time.perf_counter() - started:.1f} s")
    log_dir = args.log_dir or work
    log_dir.mkdir(parents=True, exist_ok=True)
    rows: list[configuration.Row] = []
    # The images as `make images` built them for this tree (the cluster tests' rule: nothing is
    # built here).
    with bench_cluster.local_cluster(work / "cluster", images.built(), namespace=pods.NS) as h:
        h.kubectl("apply", "-f", str(CRD))
        h.kubectl(
            "wait", "--for=condition=Established", "crd/loraadapters.lora.dev", "--timeout=60s"
        )
        h.create(
            "/api/v1/namespaces",
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": pods.NS}},
        )
        kubeconfig = apiserver.operator_kubeconfig(h, work / "operator.kubeconfig")
        admin_kubeconfig = os.environ["KUBECONFIG"]
        os.environ["KUBECONFIG"] = str(kubeconfig)  # the operator's process only
        op = cluster.Operator(
            volume=volume,
            namespaces=[pods.NS],
            log_path=log_dir / "operator.log",
            extra=["--resync-seconds", "30"],  # the default; the tests' helper sets 5
        )
        op.start()
        os.environ["KUBECONFIG"] = admin_kubeconfig
        try:
            deployment = cluster.inference_deployment(
                h.image("inference"), "inference", 0, work / "models", volume
            )
            if args.cpu_loras is not None:
                container = deployment["spec"]["template"]["spec"]["containers"][0]
                container["args"] += ["--max-cpu-loras", str(args.cpu_loras)]
            h.apply(deployment, pods.NS)
            for n in ns_values:
                h.kubectl("scale", "-n", pods.NS, "deployment/inference", f"--replicas={n}")
                t0 = time.perf_counter()
                pods.pods(h, n)
                print(f"N={n}: pods Ready in {time.perf_counter() - t0:.1f} s", flush=True)
                for k in ks:
                    row = configuration.measure(h, op, volume, n, k, args)
                    rows.append(row)
                    print(
                        f"  K={k}: held {row.held_s:.2f} s, Ready {row.ready_s:.2f} s, bare "
                        f"{row.bare_s:.2f} s, delete {row.delete_s:.2f} s, bare unload "
                        f"{row.bare_unload_s:.2f} s, back after kill {row.back_s:.2f} s",
                        flush=True,
                    )
            totals = apiserver.operator_requests(h)
            if not totals:
                raise RuntimeError("the API server counted no request of the operator's")
        finally:
            op.stop()
    return rows, totals
