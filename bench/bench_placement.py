"""Placement benchmark: the pure placement function alone, at fleet sizes this machine cannot run.

K adapters on N pods with simulated capacities (CPU-tier slots drawn from a few pod sizes) and
simulated request rates (Zipf over the adapters); each adapter's replicas come from its rate
through the autoscaler's own rule (`autoscale.plan_scale` from a cold start, between 1 and 8),
some adapters are pinned, a tenth target only half the pods (a selector), and each has a
creation time (the added adapter is the newest, as a newly applied one is). It reports:

- the time of a full placement (median of 5; the first, which fills the hash caches, apart),
- the moves (new placements) when a pod joins, and when one leaves, against K x replicas / N
  with replicas the mean,
- the moves when an adapter is added, and how full the pods are.

    .venv/bin/python bench/bench_placement.py                  # K=10000 N=200
    .venv/bin/python bench/bench_placement.py --adapters 1000 --pods 10

The last line reads `placement: K=... N=... full=...s join=... leave=... bound=...`.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / d) for d in ("operator", "inference")]

from lora_operator.rules import autoscale, placement  # noqa: E402
from lora_operator.rules.placement import Demand, PodCapacity  # noqa: E402

POD_SIZES = (64, 128, 256)  # CPU-tier slots of three simulated pod sizes


def build_pods(n: int, rnd: random.Random, prefix: str = "pod") -> list[PodCapacity]:
    return [PodCapacity(f"{prefix}-{i}", rnd.choice(POD_SIZES), 3) for i in range(n)]


def build_demands(
    k: int, pods: list[PodCapacity], rnd: random.Random, total_rps: float
) -> list[Demand]:
    weights = [1 / (i + 1) ** 1.1 for i in range(k)]  # Zipf(1.1)
    norm = sum(weights)
    policy = autoscale.Policy(min_replicas=2, max_replicas=8, target_rps=0.5)
    half = tuple(p.name for p in pods[: len(pods) // 2])
    every = tuple(p.name for p in pods)
    demands = []
    for i in range(k):
        rate = total_rps * weights[i] / norm
        replicas = autoscale.plan_scale(autoscale.start(policy), rate, 0.0, policy).replicas
        demands.append(
            Demand(
                name=f"tenant-{i % 7}/adapter-{i}",
                replicas=replicas,
                pinned=i < 20,  # the hottest few are pinned
                candidates=half if i % 10 == 9 else every,
                created=f"2026-01-01T00:00:00.{i:06d}Z",  # one a microsecond, in order
            )
        )
    return demands


def timed(pods: list[PodCapacity], demands: list[Demand]) -> tuple[float, placement.Placement]:
    start = time.perf_counter()
    plan = placement.plan_placement(pods, demands)
    return time.perf_counter() - start, plan


def with_pods(demands: list[Demand], pods: list[PodCapacity], half: int) -> list[Demand]:
    """The same adapters, targeting a new pod list (half of it for the selector tenth)."""
    every = tuple(p.name for p in pods)
    first_half = tuple(p.name for p in pods[:half])
    return [
        Demand(
            d.name,
            d.replicas,
            d.pinned,
            first_half if len(d.candidates) < len(every) - 1 else every,
            d.created,
        )
        for d in demands
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--rps", type=float, default=400.0, help="the fleet's total request rate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rnd = random.Random(args.seed)
    k, n = args.adapters, args.pods
    pods = build_pods(n, rnd)
    demands = build_demands(k, pods, rnd, args.rps)

    first, plan = timed(pods, demands)
    runs = [timed(pods, demands)[0] for _ in range(5)]
    full = statistics.median(runs)

    replicas = statistics.mean(d.replicas or 0 for d in demands)
    held = plan.by_pod()
    fill = statistics.mean(len(held.get(p.name, ())) / p.slots for p in pods)
    short = sum(1 for p in plan.adapters.values() if p.shortfall is not None)

    joined = [*pods, PodCapacity("pod-new", 64, 3)]
    _, after_join = timed(joined, with_pods(demands, joined, n // 2))
    join = placement.moves(plan, after_join)
    left = [p for i, p in enumerate(pods) if i != n - 1]  # outside the selector's half
    _, after_leave = timed(left, with_pods(demands, left, n // 2))
    leave = placement.moves(plan, after_leave)
    # The newest adapter: created after every other one, as a new LoRAAdapter is.
    extra = Demand(
        "tenant-0/newcomer", 2, False, tuple(p.name for p in pods), "2026-02-01T00:00:00Z"
    )
    _, after_add = timed(pods, [*demands, extra])
    add = placement.moves(plan, after_add)
    bound = k * replicas / n

    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(f"# K={k} adapters (mean replicas {replicas:.2f}), N={n} pods, mean fill {fill:.0%}")
    print(f"first placement (hash caches cold): {first:.3f} s")
    print(f"full placement: median {full:.3f} s of {len(runs)} (min {min(runs):.3f} s)")
    print(f"adapters short of replicas: {short}")
    print(f"pod joins: {join} moves; pod leaves: {leave} moves; K x replicas / N = {bound:.0f}")
    print(f"adapter added: {add} moves (its own placements: {len(after_add.pods_of(extra.name))})")
    print(f"placement: K={k} N={n} full={full:.3f}s join={join} leave={leave} bound={bound:.0f}")


if __name__ == "__main__":
    main()
