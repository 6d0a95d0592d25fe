"""The autoscaler (spec.autoscale): every `autoscale_interval_s` it measures each autoscaled
adapter's request rate from the pods' hit counters, chooses its replicas (autoscale.plan_scale)
and has the pods read again, so the next measurement has fresh counters. It owns the record's
`scaling` sub-record; the placer reads the replicas from it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lora_operator.controller.records import AdapterRecord
from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor
from lora_operator.rules import autoscale, events
from lora_operator.rules.model import AutoscaleSpec

log = logging.getLogger("lora_operator")


class Autoscaler(Actor):
    def forget(self, key: Key) -> None:
        self.reset(key)

    def reset(self, key: Key) -> None:
        """The adapter no longer autoscales (or is gone): its measurements start over."""
        rec = self.cache.adapters.get(key)
        if rec is not None:
            rec.scaling.scale, rec.scaling.hits_seen = None, None

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.config.autoscale_interval_s)
            if not self.seams.active.is_set():
                continue
            now = time.time()
            namespaces = set()
            for rec in list(self.cache.adapters.values()):
                if rec.info.autoscale is not None and not rec.info.deleting:
                    self._measure(rec, rec.info.autoscale, now)
                    namespaces.add(rec.info.namespace)
            for namespace in namespaces:
                # Fresh hit counts for the next measurement: each pod read again, and planned
                # only where its answer changed (a full pass of every pod would plan every
                # adapter of the namespace at every interval).
                self.signals.refresh_pods(namespace)

    def _measure(self, rec: AdapterRecord, spec: AutoscaleSpec, now: float) -> None:
        scaling = rec.scaling
        counts = autoscale.hit_counts(
            rec.info.name,
            (
                (p.info.name, p.report)
                for p in self.cache.pods_in(rec.info.namespace)
                if p.report is not None
            ),
        )
        previous, scaling.hits_seen = scaling.hits_seen, (counts, now)
        if previous is None:
            return  # a first reading: counters hold history, not a rate
        rate = autoscale.request_rate(previous[0], counts, now - previous[1])
        policy = autoscale.policy_of(spec)
        current = scaling.scale or autoscale.start(policy)
        scaling.scale = autoscale.plan_scale(current, rate, now, policy)
        if scaling.scale.replicas == current.replicas:
            return
        log.info(
            "action=autoscale adapter=%s/%s rate=%.3f replicas=%d->%d",
            *rec.key,
            rate,
            current.replicas,
            scaling.scale.replicas,
        )
        self.signals.post(
            rec.info,
            events.Note(
                "Normal",
                "Scaled",
                f"{rate:.2f} requests/s: replicas {current.replicas} -> {scaling.scale.replicas}",
            ),
        )
        self.signals.replace(rec.info.namespace)
        self.signals.mark(rec.key)
        self.signals.wake_namespace(rec.info.namespace)
