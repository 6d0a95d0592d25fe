"""The collector: deletes from the volume what no pod uses and no adapter points to (gc decides
what is in use, the store what to delete), a second after any notice that a revision may no
longer be in use (`collect`: the `collect` signal, and an adapter forgotten). It owns that notice
(`wake`) and never collects while a Ready pod has not reported: such a pod may use any revision.
"""

from __future__ import annotations

import asyncio
import logging
import time

from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.rules import gc

log = logging.getLogger("lora_operator")


# A collection scans the whole volume (10,000 adapters: a good part of a second on a small
# machine, while no staging may publish): after one that took t seconds the next waits at
# least PACE x t, so collecting takes at most about 1/PACE of the time however many adapters
# there are, while a burst of changes keeps asking for one every second.
PACE = 10.0


class Collector(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self.wake = asyncio.Event()
        self._took = 0.0  # how long the last collection took

    def collect(self) -> None:
        """A revision may no longer be in use: collect a second from now."""
        self.wake.set()

    def forget(self, key: Key) -> None:
        self.collect()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            await asyncio.sleep(max(1.0, PACE * self._took))
            self.wake.clear()
            if not self.seams.active.is_set():
                continue
            if not self.cache.all_reported():
                self.signals.spawn(self._retry())  # a pod not heard from may use any revision
                continue
            in_use = gc.revisions_in_use(
                (
                    (p.info.namespace, p.report.revisions())
                    for p in self.cache.pods.values()
                    if p.report is not None
                ),
                (
                    (*rec.key, rec.rolling.rollout.stable)
                    for rec in self.cache.adapters.values()
                    if rec.rolling.rollout is not None
                ),
            )
            started = time.monotonic()
            plan, freed = await self.seams.volume.collect(in_use)
            self._took = time.monotonic() - started
            if plan:
                self.metrics.collected_bytes.inc(freed)
                log.info(
                    "action=collect revisions=%s objects=%d freed_bytes=%d",
                    ",".join(f"{r.namespace}/{r.name}@{r.sha256[:12]}" for r in plan.revisions),
                    len(plan.objects),
                    freed,
                )

    async def _retry(self) -> None:
        await asyncio.sleep(2.0)
        self.wake.set()
