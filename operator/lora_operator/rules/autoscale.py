"""How many pods a hot adapter should be on: its request rate, with hysteresis (pure).

`spec.autoscale: {minReplicas, maxReplicas}` lets the operator choose `replicas` between the two
from the adapter's request rate, which it reads from the pods' own per-adapter request counters
(`hits` in `GET /v1/adapters`). One replica is meant to carry `target_rps` requests per second:

- **widen** at once when the rate is above what the current replicas carry
  (`rate > target_rps x replicas`), to `ceil(rate / target_rps)` (at most `maxReplicas`);
- **narrow** only when even one replica fewer would be less than half busy
  (`rate < narrow_below x target_rps x (replicas - 1)`) and has been for `narrow_after_s`
  without a break, to `ceil(rate / target_rps)` (at least `minReplicas`).

Between the two thresholds nothing changes, and a narrowed set is never wide enough to trigger a
widening at the same rate, so a steady rate settles and an oscillating one inside the band never
flaps. The state (replicas, since when the rate has been low) is small and lives in the adapter's
status, so an operator restart continues where it was.

Purely computational: no clock (the caller passes `now`), no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from lora_operator.rules.model import AdapterInfo, AutoscaleSpec
from lora_operator.rules.planning import PodReport


@dataclass(frozen=True)
class Policy:
    min_replicas: int
    max_replicas: int
    target_rps: float = 0.5  # requests per second one replica should carry
    narrow_below: float = 0.5  # narrow when one replica fewer would be less busy than this
    narrow_after_s: float = 120.0  # ... for this long without a break


@dataclass(frozen=True)
class Scale:
    replicas: int
    low_since: float | None = None  # when the rate first fell below the narrowing threshold


def start(policy: Policy) -> Scale:
    """A new adapter starts on its minimum."""
    return Scale(replicas=clamp(policy.min_replicas, policy))


def clamp(replicas: int, policy: Policy) -> int:
    low = max(1, policy.min_replicas)
    return max(low, min(max(low, policy.max_replicas), replicas))


def plan_scale(current: Scale, rate: float, now: float, policy: Policy) -> Scale:
    """The next state for a measured `rate` (requests per second across all pods)."""
    replicas = clamp(current.replicas, policy)
    needed = math.ceil(rate / policy.target_rps) if policy.target_rps > 0 else replicas
    if rate > policy.target_rps * replicas:
        return Scale(replicas=clamp(needed, policy))
    low = rate < policy.narrow_below * policy.target_rps * (replicas - 1)
    if not low or replicas <= max(1, policy.min_replicas):
        return Scale(replicas=replicas)
    if current.low_since is None:
        return Scale(replicas=replicas, low_since=now)
    if now - current.low_since < policy.narrow_after_s:
        return replace(current, replicas=replicas)
    return Scale(replicas=clamp(min(needed, replicas - 1), policy))


def request_rate(before: Mapping[str, int], after: Mapping[str, int], seconds: float) -> float:
    """Requests per second from two readings of per-pod counters. A counter that went down was
    reset (the pod restarted, or reloaded the adapter): its whole new value counts. A pod without
    an earlier reading counts nothing yet: its counter may hold hours of history (the first
    reading after an operator restart), which is no rate."""
    if seconds <= 0:
        return 0.0
    total = 0
    for pod, count in after.items():
        previous = before.get(pod)
        if previous is not None:
            total += count - previous if count >= previous else count
    return total / seconds


def policy_of(spec: AutoscaleSpec) -> Policy:
    """The policy an adapter's spec.autoscale asks for."""
    return Policy(
        min_replicas=spec.min_replicas,
        max_replicas=spec.max_replicas,
        target_rps=spec.target_rps,
        narrow_after_s=spec.scale_down_delay_s,
    )


def replicas(info: AdapterInfo, scale: Scale | None) -> int:
    """How many pods an adapter with spec.replicas or spec.autoscale should be on: its
    spec.replicas, else the replicas chosen now (`scale`), else its minimum."""
    if info.replicas is not None:
        return info.replicas
    if info.autoscale is None:
        raise ValueError(f"adapter {info.name} has neither spec.replicas nor spec.autoscale")
    if scale is not None:
        return scale.replicas
    return start(policy_of(info.autoscale)).replicas


def hit_counts(adapter: str, reports: Iterable[tuple[str, PodReport]]) -> dict[str, int]:
    """The pods' request counters for `adapter` (pod name, report), one per pod and served
    name (`pod/served`): a rollout's canary alias counts with the adapter's name."""
    return {
        f"{pod}/{card.name}": card.hits
        for pod, report in reports
        for card in report.cards.values()
        if card.adapter == adapter and card.hits is not None
    }


def restore(spec: AutoscaleSpec | None, recorded: object) -> Scale | None:
    """An earlier process's choice (status.replicas) continues, clamped to the range."""
    if spec is None or not isinstance(recorded, int):
        return None
    return Scale(clamp(recorded, policy_of(spec)))
