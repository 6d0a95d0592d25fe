"""The finalizer (a LoRAAdapter being deleted): unpublish first (no pod resolves the name from
then on), then wait until no pod holds it (the pod workers unload it: it is no longer wanted),
at most `unload_grace_s`, and let go. It owns the record's `deletion` sub-record and the set of
adapters waiting to be unloaded; the stager stops the adapter's staging when asked
(`stop_staging`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.rules import events
from lora_operator.rules import status as status_mod
from lora_operator.rules.model import AdapterInfo

log = logging.getLogger("lora_operator")


class Finalizer(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        # Unpublished, waiting for no pod to hold them, by namespace (a pod's report checks its
        # own namespace's, not every deletion under way).
        self._unloading: dict[str, set[Key]] = {}

    def forget(self, key: Key) -> None:
        waiting = self._unloading.get(key[0])
        if waiting is not None:
            waiting.discard(key)
            if not waiting:
                del self._unloading[key[0]]
        rec = self.cache.adapters.get(key)
        if rec is not None:
            rec.deletion.unloaded.set()

    async def finalize(self, info: AdapterInfo, forget: Callable[[Key], None]) -> None:
        """Unpublish, wait for the pods to unload, then `forget` the adapter everywhere."""
        rec = self.cache.adapters[info.key]
        await self.signals.stop_staging(info.key)  # a publish in progress ends first
        await self.seams.volume.unpublish(info.namespace, info.name)
        rec.deletion.unpublished = True
        self._unloading.setdefault(info.namespace, set()).add(info.key)
        log.info("action=unpublish adapter=%s/%s", *info.key)
        self.signals.wake_adapter(info.key)
        self._check_one(rec.key)
        try:
            await asyncio.wait_for(rec.deletion.unloaded.wait(), self.config.unload_grace_s)
        except TimeoutError:
            holders = sorted(
                p.info.name
                for p in self.cache.pods_in(info.namespace)
                if p.report is not None and p.report.holds(info.name)
            )
            self.signals.post(
                info,
                events.Note(
                    "Warning",
                    "UnloadIncomplete",
                    f"pods still report the adapter after {self.config.unload_grace_s:.0f}s: "
                    f"{status_mod.name_list(holders)}; releasing it anyway",
                ),
            )
        log.info("action=delete adapter=%s/%s", *info.key)
        forget(info.key)
        self.signals.collect()

    def _check_one(self, key: Key) -> None:
        """Release this deletion now if no pod holds the adapter (one adapter's check, not the
        namespace's: ten thousand deletions at once each check their own)."""
        if not any(
            p.report is not None and p.report.holds(key[1]) for p in self.cache.pods_in(key[0])
        ):
            self.cache.adapters[key].deletion.unloaded.set()

    def check_unloaded(self, namespace: str) -> None:
        """Release the deletions of the namespace's adapters that no pod holds any more."""
        waiting = [self.cache.adapters[k] for k in self._unloading.get(namespace, ())]
        if not waiting:
            return
        held = self.cache.held(namespace)
        for rec in waiting:
            if rec.info.name not in held:
                rec.deletion.unloaded.set()
