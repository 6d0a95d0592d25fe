"""The placer: where each namespace's adapters with spec.replicas or spec.autoscale go
(placement.plan_placement decides), and which pods each adapter targets. It owns the
placements, which namespaces' placements are stale, and the coalescing of recomputes.

Reads (`placed`, `targeted`) change nothing. `refresh` recomputes a stale
placement, at most every PLACEMENT_COALESCE_S (a burst of a thousand adapters is placed
together; the placement reads every adapter and pod of the namespace), and not before every
Ready pod has reported since this replica began to act (a placement made from some pods' reports
would move adapters for nothing). A recompute that moves adapters marks them and wakes the
namespace's pods.
"""

from __future__ import annotations

import asyncio
import time

from lora_operator import autoscale, placement
from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.model import AdapterInfo, PodInfo
from lora_operator.podstate import PodEntry

PLACEMENT_COALESCE_S = 0.5


class Placer(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self._placements: dict[str, placement.Placement] = {}
        self._stale: set[str] = set()
        self._placed_at: dict[str, float] = {}  # when each namespace's placement was computed
        self._due: set[str] = set()  # a recompute is scheduled

    def stale(self, namespace: str) -> None:
        self._stale.add(namespace)

    def forget(self, key: Key) -> None:
        self._stale.add(key[0])

    # -- reads --------------------------------------------------------------------------------

    def placed(self, rec: AdapterRecord) -> placement.Placed | None:
        """The adapter's placement; None when it goes on every matching pod."""
        if not rec.info.placed:
            return None
        chosen = self._placements.get(rec.info.namespace)
        found = chosen.adapters.get(rec.info.name) if chosen is not None else None
        return found or placement.Placed(pods=(), wanted=self.replicas(rec.info, rec))

    def targeted(self, rec: AdapterRecord) -> list[tuple[PodInfo, PodEntry]]:
        """The Ready pods that reported their base model and that this adapter belongs on
        (with spec.replicas or spec.autoscale: the ones it is placed on)."""
        placed = self.placed(rec)
        return [
            (p.info, rec.entries.own.get(p.info.name, PodEntry()))
            for p in self.cache.pods_in(rec.info.namespace)
            if p.report is not None
            and p.info.reachable
            and rec.info.targets(p.info, p.report.base_model)
            and (placed is None or p.info.name in placed.pods)
        ]

    @staticmethod
    def replicas(info: AdapterInfo, rec: AdapterRecord | None) -> int:
        return autoscale.replicas(info, rec.scaling.scale if rec is not None else None)

    # -- recomputing --------------------------------------------------------------------------

    def refresh(self, namespace: str) -> placement.Placement | None:
        """The namespace's placement, recomputed first if an input changed and it may be."""
        current = self._placements.get(namespace)
        if namespace not in self._stale and current is not None:
            return current
        if not self.cache.heard(namespace):
            return current
        wait = self._placed_at.get(namespace, -PLACEMENT_COALESCE_S) + PLACEMENT_COALESCE_S
        wait -= time.monotonic()
        if current is not None and wait > 0:
            if namespace not in self._due:
                self._due.add(namespace)
                asyncio.get_running_loop().call_later(wait, self._place_later, namespace)
            return current
        self._stale.discard(namespace)
        self._placed_at[namespace] = time.monotonic()
        reports = {
            p.info.name: (p.info, p.report)
            for p in self.cache.pods_in(namespace)
            if p.report is not None and p.info.reachable
        }
        infos = [self.cache.current(i)[0] for i in self.cache.indexed(namespace)]
        capacities, demands = placement.plan_demands(
            infos, reports, lambda info: self.replicas(info, self.cache.adapters.get(info.key))
        )
        new = placement.plan_placement(capacities, demands)
        self._placements[namespace] = new
        moved = [
            name
            for name, placed in new.adapters.items()
            if current is None or current.adapters.get(name) != placed
        ]
        if moved:
            for name in moved:
                if (namespace, name) in self.cache.adapters:
                    self.signals.mark((namespace, name))
            self.signals.wake_namespace(namespace)
        return new

    def _place_later(self, namespace: str) -> None:
        """The end of a coalescing wait: place now if something changed meanwhile."""
        self._due.discard(namespace)
        if namespace in self._stale:
            self.refresh(namespace)
