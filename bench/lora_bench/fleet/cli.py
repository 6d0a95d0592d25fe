"""bench/bench_fleet.py's command line: the flags, the cluster, the run and its last line."""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
from pathlib import Path

from lora_devcluster import cluster as cluster_mod
from lora_devcluster import images
from lora_devcluster.harness import ApiError

from lora_bench import cluster
from lora_bench.fleet import objects, report, rounds, simulated


def main(description: str | None) -> int:
    """`description`: the --help text (the script's docstring)."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawDescriptionHelpFormatter
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
        help=f"every cell: {', '.join(simulated.SIM_PROFILES)} x {', '.join(simulated.STREAMS)}"
        f" x {', '.join(simulated.LOOPS)}",
    )
    parser.add_argument(
        "--replicas", type=int, help="spec.replicas of every adapter (default: on every pod)"
    )
    parser.add_argument(
        "--streams", default=",".join(simulated.STREAMS), help="simulated: zipf, uniform"
    )
    parser.add_argument(
        "--loops", default=",".join(simulated.LOOPS), help="simulated: closed, open"
    )
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
        return simulated.main_sim(args, node_images)
    args.concurrency = args.concurrency or 8
    with tempfile.TemporaryDirectory(prefix="lora-bench-fleet-") as scratch:
        work = Path(scratch)
        with cluster.local_cluster(work / "cluster", node_images, namespace=objects.NS) as h:
            pods = rounds.set_up(h, args, work)
            tallies = rounds.measure(h, pods, args)
    throughput, hit_ratio = report.print_report(tallies, args)
    print(
        f"fleet: throughput router/round-robin = {throughput:.2f}, "
        f"hit rate router/round-robin = {hit_ratio:.2f}"
    )
    return 0


def run(description: str | None) -> int:
    """The script's exit status: a cluster, API or measurement failure is one line and 1."""
    try:
        return main(description)
    except (cluster_mod.ClusterError, ApiError, AssertionError, RuntimeError) as e:
        print(f"bench_fleet failed: {e}", file=sys.stderr)
        return 1
