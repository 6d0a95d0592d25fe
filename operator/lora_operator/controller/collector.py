"""The collector: deletes from the volume what no pod uses and no adapter points to (gc decides
what is in use, the store what to delete), a second after any notice that a revision may no
longer be in use (`collect`: the `collect` signal, and an adapter forgotten). It owns that notice
(`wake`) and never collects while a Ready pod has not reported: such a pod may use any revision.
"""

from __future__ import annotations

import asyncio
import logging

from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.rules import gc

log = logging.getLogger("lora_operator")


class Collector(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self.wake = asyncio.Event()

    def collect(self) -> None:
        """A revision may no longer be in use: collect a second from now."""
        self.wake.set()

    def forget(self, key: Key) -> None:
        self.collect()

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            await asyncio.sleep(1.0)
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
            plan, freed = await self.seams.volume.collect(in_use)
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
