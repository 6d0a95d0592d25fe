"""What the router knows about the fleet, read from API objects and pod reports (pure parsing),
and the one mutable record that holds it (`Fleet`).

- Pods come from the EndpointSlices of the inference pods' Services: an endpoint whose
  `conditions.ready` is true, with a `targetRef` to a Pod, is a pod requests may go to. Nothing
  else makes a pod routable, so a pod that is not Ready never gets a request. Where a release
  serves several base models, each model's pods are behind a Service of their own, and a pod
  serves the models its Service is listed with: a request for an adapter (or a base model) goes
  only to pods of its model.
- Placement comes from the LoRAAdapters of the namespace: `status.placedPods` lists the pods an
  adapter with `spec.replicas` (or `spec.autoscale`) is placed on; an adapter without either is on
  every pod (of its base model, `spec.baseModel`).
- Residency comes from each pod's `GET /v1/adapters` (`lora_podapi.adapters`, either form, any
  version): every adapter's tier (`gpu`, `cpu`, `disk`), and, where the server says so, its GPU
  slots (`max_loras`) and queue (`num_requests_waiting`, `num_requests_running`). The queue is
  also counted on every generation answer (`x-lora-queue`, `lora_podapi.headers`), so it is
  fresher than the polls.

The router keeps nothing on disk: after a restart it lists the objects again and polls the pods.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lora_podapi import adapters

from lora_router.routing import Backend, Residency


@dataclass(frozen=True)
class Endpoint:
    pod: str
    address: str  # host:port
    ready: bool
    models: frozenset[str] = frozenset()  # the base models it serves (empty: not said, any)

    def serves(self, model: str | None) -> bool:
        return model is None or not self.models or model in self.models


def parse_endpoint_slice(
    obj: Mapping[str, Any], port_name: str, models: frozenset[str] = frozenset()
) -> list[Endpoint]:
    """The pod endpoints of one EndpointSlice, at the port named `port_name` (or its only port);
    its pods serve `models` (its Service's)."""
    ports = [p for p in obj.get("ports") or () if isinstance(p, Mapping)]
    port = next((p.get("port") for p in ports if p.get("name") == port_name), None)
    if port is None and len(ports) == 1:
        port = ports[0].get("port")
    if not isinstance(port, int):
        return []
    out = []
    for ep in obj.get("endpoints") or ():
        ref = ep.get("targetRef") or {}
        addresses = ep.get("addresses") or ()
        if ref.get("kind") != "Pod" or not ref.get("name") or not addresses:
            continue
        conditions = ep.get("conditions") or {}
        # `ready` unset means ready (the API's own rule); terminating pods are never ready.
        ready = conditions.get("ready") is not False and conditions.get("terminating") is not True
        host = str(addresses[0])
        host = f"[{host}]" if ":" in host else host
        out.append(
            Endpoint(pod=str(ref["name"]), address=f"{host}:{port}", ready=ready, models=models)
        )
    return out


@dataclass(frozen=True)
class Split:
    """A weighted rollout under way (`status.rollout`): `weight` percent of the adapter's
    requests go to the canary, served under `alias`."""

    alias: str
    weight: int
    canary: str  # the revisions' sha256, for the per-revision counts
    stable: str


@dataclass(frozen=True)
class AdapterPlacement:
    name: str
    pods: frozenset[str] | None  # None: on every pod
    split: Split | None = None
    base_model: str | None = None  # spec.baseModel


def parse_adapter(obj: Mapping[str, Any]) -> AdapterPlacement:
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    limited = spec.get("replicas") is not None or spec.get("autoscale") is not None
    placed = status.get("placedPods")
    pods: frozenset[str] | None = None
    if limited:
        pods = frozenset(str(p) for p in placed) if isinstance(placed, list) else frozenset()
    base_model = spec.get("baseModel")
    return AdapterPlacement(
        name=str(meta.get("name", "")),
        pods=pods,
        split=parse_split(status.get("rollout")),
        base_model=base_model if isinstance(base_model, str) and base_model else None,
    )


def parse_split(raw: Any) -> Split | None:
    """`status.rollout`, as far as routing goes; None when no rollout is under way."""
    if not isinstance(raw, Mapping):
        return None
    canary, stable = raw.get("canary"), raw.get("stable")
    if not isinstance(canary, Mapping) or not isinstance(stable, Mapping):
        return None
    alias, weight = canary.get("servedAs"), canary.get("weight")
    if not isinstance(alias, str) or not isinstance(weight, int):
        return None
    return Split(
        alias=alias,
        weight=weight,
        canary=str(canary.get("revision") or ""),
        stable=str(stable.get("revision") or ""),
    )


@dataclass(frozen=True)
class Report:
    residency: Residency
    # Waiting + running, when the pod reports it: as last counted, by this poll or by one of the
    # pod's answers since (`Fleet.take_queue`), which come more often than polls.
    queue: int | None
    base_model: str | None
    at: float  # when it was read (the router's monotonic clock)
    slots: int | None = None  # its GPU slots (max_loras), when it says
    etag: str | None = None  # the answer's version: the next poll asks for a 304 on it
    mine: int = 0  # this router's requests in flight there when `queue` was counted
    polled: int | None = None  # the queue this poll read: what a 304 on `etag` says it still is

    def unchanged(self, at: float) -> Report:
        """This report confirmed at `at` by a 304: residency and queue as this poll read them."""
        return dataclasses.replace(self, at=at, queue=self.polled)


def estimated_load(own: int, queue: int | None, mine_then: int) -> int:
    """A pod's requests as far as this router can tell (pure): its own in flight now, plus what
    the pod's last report counted beyond this router's own at that moment (the other router
    replicas' requests and direct clients', taken as unchanged since: a report is at most a
    poll old). Without a report the router knows only its own."""
    if queue is None:
        return own
    return own + max(0, queue - mine_then)


def parse_report(payload: Any, at: float, etag: str | None = None) -> Report:
    """A `GET /v1/adapters` answer, its residency view or the full listing, as read `at` (the
    answer's version `etag`); raise ValueError when it is neither."""
    read = adapters.parse_residency(payload)
    slots, queue = read.capacity.max_loras, read.capacity.queue
    return Report(
        residency=Residency(
            gpu=frozenset(read.gpu),
            cpu=frozenset(read.cpu),
            free_slot=slots is not None and len(set(read.gpu)) < slots,
            disk=frozenset(read.disk),
        ),
        queue=queue,
        base_model=read.capacity.model,
        at=at,
        slots=slots,
        etag=etag,
        polled=queue,
    )


@dataclass
class Fleet:
    """The router's whole view: written by the watchers and the poller, read per request."""

    stale_after_s: float = 5.0
    slices: dict[str, list[Endpoint]] = field(default_factory=dict)  # slice name -> endpoints
    adapters: dict[str, AdapterPlacement] = field(default_factory=dict)
    reports: dict[str, Report] = field(default_factory=dict)  # pod -> its last report
    inflight: dict[str, int] = field(default_factory=dict)  # pod -> requests sent, unanswered
    # adapter under a rollout -> its requests routed so far (routing.to_canary counts them)
    split_counts: dict[str, int] = field(default_factory=dict)
    # What has been read at least once: "endpoints", "adapters" (listed), "residency" (every
    # pod listed was polled once).
    synced: set[str] = field(default_factory=set)
    # The adapters of the last `window` requests routed, and how many times each appears there:
    # the working set, which says whether affinity can help (routing.affinity_pays).
    window: int = 256
    recent: collections.deque[str] = field(default_factory=collections.deque)
    recent_counts: collections.Counter[str] = field(default_factory=collections.Counter)

    def note_request(self, adapter: str) -> None:
        """Count `adapter` into the recent requests (O(1))."""
        self.recent.append(adapter)
        self.recent_counts[adapter] += 1
        if len(self.recent) > self.window:
            old = self.recent.popleft()
            self.recent_counts[old] -= 1
            if not self.recent_counts[old]:
                del self.recent_counts[old]

    def working_set(self) -> int | None:
        """Distinct adapters among the last `window` requests; None until there were that many."""
        return len(self.recent_counts) if len(self.recent) >= self.window else None

    def fewest_slots(self, now: float) -> int | None:
        """The fewest GPU slots a pod with a fresh report has (None: no such pod)."""
        slots = [
            r.slots
            for r in self.reports.values()
            if r.slots is not None and now - r.at <= self.stale_after_s
        ]
        return min(slots) if slots else None

    def endpoints(self) -> dict[str, Endpoint]:
        """Pod -> its endpoint (a pod in two slices at once, during a move, counts once)."""
        out: dict[str, Endpoint] = {}
        for eps in self.slices.values():
            for ep in eps:
                if ep.ready or ep.pod not in out:
                    out[ep.pod] = ep
        return out

    def ready(self) -> dict[str, Endpoint]:
        return {pod: ep for pod, ep in self.endpoints().items() if ep.ready}

    def take(self, pod: str, report: Report) -> None:
        """Keep `report` as the pod's, with this router's requests in flight there now."""
        self.reports[pod] = dataclasses.replace(report, mine=self.inflight.get(pod, 0))

    def take_queue(self, pod: str, queue: int) -> None:
        """The pod's queue as one of its answers counted it, when the answer's head arrived:
        fresher than its last poll (a poll a second, an answer every generation). This router's
        requests there then are those in flight less the one answered, which the pod no longer
        counts. Residency still comes from the polls."""
        report = self.reports.get(pod)
        if report is not None:
            mine = max(0, self.inflight.get(pod, 0) - 1)
            self.reports[pod] = dataclasses.replace(report, queue=queue, mine=mine)

    def backends(self, now: float, model: str | None = None) -> list[Backend]:
        """The Ready pods as routing sees them; only those that serve `model`, when given."""
        out = []
        ready = self.ready()
        for pod in sorted(ready):
            if not ready[pod].serves(model):
                continue
            report = self.reports.get(pod)
            own = self.inflight.get(pod, 0)
            if report is None or now - report.at > self.stale_after_s:
                out.append(Backend(name=pod, load=own, residency=None, heard=report is not None))
                continue
            load = estimated_load(own, report.queue, report.mine)
            out.append(Backend(name=pod, load=load, residency=report.residency))
        return out

    def canary_holders(
        self, placement: AdapterPlacement, split: Split, now: float
    ) -> frozenset[str]:
        """The Ready pods with a fresh report that hold a rollout's canary, among the adapter's
        placed pods."""
        holders = frozenset(
            b.name
            for b in self.backends(now)
            if b.residency is not None and b.residency.holds(split.alias)
        )
        return holders & placement.pods if placement.pods is not None else holders

    def rolling_out_as(self, alias: str) -> AdapterPlacement | None:
        """The adapter whose rollout serves its canary as `alias`, if any."""
        return next(
            (a for a in self.adapters.values() if a.split is not None and a.split.alias == alias),
            None,
        )

    def base_models(self) -> set[str]:
        """The base models the pods serve: as their Services say, and as the pods report."""
        listed = {m for eps in self.slices.values() for ep in eps for m in ep.models}
        return listed | {r.base_model for r in self.reports.values() if r.base_model}

    def forget_reports(self, keep: Iterable[str]) -> None:
        keep = set(keep)
        for pod in [p for p in self.reports if p not in keep]:
            del self.reports[pod]
