"""One route's figures over its measured rounds (pure): its answers, its steady rate
(`steady_window`), the pods' counters and the machine's CPU."""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass, field
from typing import Any

from lora_demo.manifests import Obj

from lora_bench.fleet import counters


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

    def add(
        self, stream: list[str], result: Obj, before: counters.Snapshot, after: counters.Snapshot
    ) -> None:
        self.add_answers(result)
        self.gpu_hits += counters.counted(before, after, "lora_adapter_lookups_total{result=hit}")
        self.lookups += sum(
            counters.counted(before, after, f"lora_adapter_lookups_total{{result={r}}}")
            for r in ("hit", "miss")
        )
        self.fresh_loads += counters.counted(
            before, after, "lora_adapter_loads_total{result=ok,tier=cpu}"
        )
        self.fresh_load_s += counters.counted(
            before, after, "lora_adapter_load_seconds_sum{tier=cpu}"
        )
        self.slot_copies += counters.counted(
            before, after, "lora_adapter_load_seconds_count{tier=gpu}"
        )
        self.slot_copy_s += counters.counted(
            before, after, "lora_adapter_load_seconds_sum{tier=gpu}"
        )
        self.generations += counters.counted(before, after, "lora_generation_seconds_count{}")
        self.generation_s += counters.counted(before, after, "lora_generation_seconds_sum{}")
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
