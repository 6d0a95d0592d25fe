"""The placer: where each namespace's adapters with spec.replicas or spec.autoscale go
(placement.plan_placement decides), and which pods each adapter targets. It owns the
placements, which namespaces' placements are stale, and the coalescing of recomputes.

Reads (`current`, `placed`, `targeted`) change nothing. The placer recomputes a placement on
its own, when told an input of it changed (`stale`: the `replace` signal, from the pod workers
on a pod's report, the autoscaler, the controller on a pod's or an adapter's change) or that an
adapter came (`arrived`: placed alone on the room the others left, placement.place_more, when
nothing else changed): at most every `placement.recompute_interval` (a recompute reads every
adapter and pod of the namespace, so a larger namespace is placed less often, and a burst of
adapters together),
while this replica acts, and not before every Ready pod has reported since it began to (a
placement made from some pods' reports would move adapters for nothing; each report says
`replace` again). A recompute that moves adapters marks them and wakes the namespace's pods
for them (for every adapter when the pods it counts changed), who plan with it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.rules import autoscale, placement
from lora_operator.rules.model import AdapterInfo, PodInfo
from lora_operator.rules.planning import PodReport
from lora_operator.rules.podstate import PodEntry


class Placer(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self._placements: dict[str, placement.Placement] = {}
        self._stale: set[str] = set()
        # When each namespace's placement may be computed again (monotonic).
        self._next_at: dict[str, float] = {}
        self._due: set[str] = set()  # a recompute is scheduled
        # The adapters that came since the namespace was last placed, while nothing else
        # changed (not `_stale`): the next recompute places those alone (placement.place_more).
        self._arrived: dict[str, set[str]] = {}

    def stale(self, namespace: str) -> None:
        """An input of the namespace's placement changed: recompute it once the coalescing
        allows (at once after a quiet while), after what is being handled now."""
        self._stale.add(namespace)
        self._schedule(namespace)

    def arrived(self, key: Key) -> None:
        """A new adapter: placed with the next recompute, alone if nothing else changed."""
        self._arrived.setdefault(key[0], set()).add(key[1])
        self._schedule(key[0])

    def _schedule(self, namespace: str) -> None:
        if namespace in self._due:
            return
        self._due.add(namespace)
        wait = self._next_at.get(namespace, 0.0) - time.monotonic()
        asyncio.get_running_loop().call_later(max(0.0, wait), self._place_due, namespace)

    def forget(self, key: Key) -> None:
        self.stale(key[0])

    # -- reads --------------------------------------------------------------------------------

    def current(self, namespace: str) -> placement.Placement | None:
        """The namespace's placement; None until one is computed (an adapter asks for one,
        and every Ready pod has reported)."""
        return self._placements.get(namespace)

    def awaits(self, rec: AdapterRecord) -> bool:
        """Whether the adapter (with spec.replicas or spec.autoscale) waits to be placed: its
        namespace's placement was computed before the adapter came, or never (a restarted
        operator places it again). Until then it is on no pod, which says nothing yet."""
        chosen = self._placements.get(rec.info.namespace)
        return rec.info.placed and (chosen is None or rec.info.name not in chosen.adapters)

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

    def _place_due(self, namespace: str) -> None:
        self._due.discard(namespace)
        if namespace in self._stale or namespace in self._arrived:
            self._place(namespace)

    def _place(self, namespace: str) -> None:
        """Recompute the namespace's placement, unless it may not be yet (it stays stale until
        the next `stale`)."""
        if not self.seams.active.is_set() or not self.cache.heard(namespace):
            return
        current = self._placements.get(namespace)
        reports = {
            p.info.name: (p.info, p.report)
            for p in self.cache.pods_in(namespace)
            if p.report is not None and p.info.reachable
        }
        arrived = self._arrived.pop(namespace, set())
        new = None
        if namespace not in self._stale and current is not None:
            new = self._place_arrived(namespace, current, reports, arrived)
        if new is None:
            infos = [self.cache.current(i)[0] for i in self.cache.indexed(namespace)]
            if not any(info.placed for info in infos):
                return  # placed only where an adapter asks for it (it reads the whole namespace)
            interval = placement.recompute_interval(len(infos))
            self._next_at[namespace] = time.monotonic() + interval
            capacities, demands = placement.plan_demands(infos, reports, self._replicas)
            new = dataclasses.replace(
                placement.plan_placement(capacities, demands), over=frozenset(reports)
            )
            moved = [
                name
                for name, placed in new.adapters.items()
                if current is None or current.adapters.get(name) != placed
            ]
        else:
            interval = placement.recompute_interval(len(arrived))
            self._next_at[namespace] = time.monotonic() + interval
            moved = [name for name in arrived if name in new.adapters]
        self._stale.discard(namespace)
        self._placements[namespace] = new
        if current is None or current.over != new.over:
            # The first placement, or a pod it now counts (or no longer does): every adapter of
            # the namespace is planned again.
            self.signals.wake_namespace(namespace)
        for name in moved:
            if (namespace, name) in self.cache.adapters:
                self.signals.mark((namespace, name))
                # Its pods plan it: the ones it moved to load it, the ones it left unload it.
                self.signals.wake_adapter((namespace, name))

    def _place_arrived(
        self,
        namespace: str,
        current: placement.Placement,
        reports: dict[str, tuple[PodInfo, PodReport]],
        arrived: set[str],
    ) -> placement.Placement | None:
        """The namespace's placement with the adapters `arrived` placed on what room the others
        left (placement.place_more), when nothing else changed since `current`; None when it
        must be computed afresh."""
        if current.over != frozenset(reports):
            return None
        infos = [
            rec.info for a in sorted(arrived) if (rec := self.cache.adapters.get((namespace, a)))
        ]
        capacities, demands = placement.plan_demands(infos, reports, self._replicas)
        return placement.place_more(current, capacities, demands)

    def _replicas(self, info: AdapterInfo) -> int:
        return self.replicas(info, self.cache.adapters.get(info.key))
