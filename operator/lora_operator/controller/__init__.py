"""The controller: stages adapters, keeps every inference pod's adapters equal to what it should
hold, and writes each LoRAAdapter's status and Events. kopf's handlers (edges/handlers.py) feed it
events; the decisions are pure functions (the rules: planning, podstate, placement, autoscale,
rollout, canary, status, events, resume, gc; and `peering.decide`); the actors of this package do
the I/O and the waiting, through the store and the edges' clients, each over its own part of the
state:

| actor | module | owns |
|---|---|---|
| cache | records | the adapter and pod records (added, dropped), their `info`; kopf's pod index |
| stager | stager | each record's `staging` and its task; the compositions |
| pod workers | workers | the pod records (but `info`); each adapter's `entries` (on each pod) |
| placer | placer | the placements, which are stale, when each is recomputed |
| autoscaler | autoscaler | each record's `scaling` |
| status writer | writer | each record's `status`; which adapters are due; the phase gauge |
| rollouts | rollouts | each record's `rolling`; which rollouts are due (a mark, a pause's end) |
| event recorder | recorder | the Event series; the untrusted pods reported |
| identity prover | identity | which labelled pods are the release's (their owner chains, read) |
| collector | collector | when to collect the volume |
| finalizer | finalizer | each record's `deletion`; the adapters waiting to be unloaded |

Each record field names its owner's module (records.py), and a test that parses this package
holds every write of it there. Actors reach each other only through `signals.Signals` (plain
calls on the one event loop); the status writer, rollouts, the collector, the autoscaler and the
finalizer run loops of their own (`start`), the placer recomputes when told, the pod workers and
the stager run a task per pod and per staging. Every actor registers itself as it is made
(`signals.Shared.actors`), and what concerns them all goes to each: `forget(key)` for an adapter
that is gone, `standby()` when another replica acts, `halt()` at stop. This module wires them,
and is the surface kopf's handlers call: `adapter_changed`, `pod_changed`, `start`,
`stop`, `set_active`, `use_credentials`, `on_stop`. A pod is worked on only once the identity
prover trusts it.

With several replicas (`--peering`), everything here waits while `peering.Mirror` says another
replica acts; the first thing a replica does when it starts acting is to clean `.tmp/`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import kopf

from lora_operator.controller.autoscaler import Autoscaler
from lora_operator.controller.collector import Collector
from lora_operator.controller.finalizer import Finalizer
from lora_operator.controller.identity import Identity
from lora_operator.controller.placer import Placer
from lora_operator.controller.recorder import Recorder
from lora_operator.controller.records import AdapterRecord, Cache, PodRecord
from lora_operator.controller.rollouts import Rollouts
from lora_operator.controller.seams import Api, Body, Key, Pods, Seams, Volume
from lora_operator.controller.signals import Actor, Hub, Shared
from lora_operator.controller.stager import Stager
from lora_operator.controller.workers import Workers
from lora_operator.controller.writer import StatusWriter
from lora_operator.edges import kube, peering, podtokens
from lora_operator.edges.config import OperatorConfig
from lora_operator.edges.metrics import Metrics
from lora_operator.edges.podclient import PodClient
from lora_operator.rules.model import PodInfo, adapter_info
from lora_operator.rules.resume import needs_staging
from lora_operator.store import egress, fetchers, staging

__all__ = ["AdapterRecord", "Api", "Controller", "PodRecord", "Pods", "Volume", "needs_staging"]

log = logging.getLogger("lora_operator")
# Acting waits until the records hold every listed adapter: listed again after this long
# without one more of them seen (some may have been deleted since the list).
LIST_AGAIN_S = 2.0


class Controller:
    def __init__(
        self,
        config: OperatorConfig,
        metrics: Metrics | None = None,
        *,
        pods: Pods | None = None,
        volume: Volume | None = None,
        api: Api | None = None,
        identity: str | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.seams = Seams(
            pods=pods or PodClient(self._pod_credentials(), timeout_s=config.load_timeout_s),
            volume=volume
            or staging.Store(
                config.volume_root,
                max_bytes=config.max_adapter_bytes,
                max_concurrent=config.max_concurrent_stagings,
                hf_endpoint=config.hf_endpoint,
                # Every remote fetch checked where it connects (egress), against the rules.
                fetch=fetchers.Fetcher(
                    config.volume_root,
                    egress.Guard(config.source_rules, lambda: self.seams.api_endpoint),
                    hf_endpoint=config.hf_endpoint,
                ),
                namespace_quota=config.namespace_quota,
                on_usage=self.metrics.set_namespace_usage,
            ),
            api=api,
        )
        self.metrics.set_namespace_quota(config.namespace_quota)
        if api is not None:
            self.seams.logged_in.set()
        self.identity = identity or peering.own_identity()
        self.priority = (
            config.peering_priority
            if config.peering_priority is not None
            else peering.start_priority()
        )
        self.cache = Cache()
        self.hub = hub = Hub()
        shared = Shared(config, self.metrics, self.seams, self.cache, hub)
        self.actors: list[Actor] = shared.actors  # each actor made registers there
        self.placer = hub.placer = Placer(shared)
        self.rollouts = hub.rollouts = Rollouts(shared, self.placer)
        self.writer = hub.writer = StatusWriter(shared, self.placer)
        self.workers = hub.workers = Workers(shared, self.placer)
        self.stager = hub.stager = Stager(shared)
        self.collector = hub.collector = Collector(shared)
        self.finalizer = hub.finalizer = Finalizer(shared, self._forget)
        self.recorder = hub.recorder = Recorder(shared)
        self.prover = Identity(shared)
        self.cache.trusted, self.cache.decided = self.prover.trusted, self.prover.decided
        hub.on_pod = self.pod_changed
        self.autoscaler = Autoscaler(shared)
        self._on_stop: list[Callable[[], Coroutine[Any, Any, None]]] = []
        self._activating: asyncio.Task[None] | None = None  # waits for every adapter (set_active)

    def _pod_credentials(self) -> podtokens.Credentials:
        """What the pods are sent: tokens of the operator's ServiceAccount bound to each pod's
        namespace (the chart's way), or the admin token."""
        account = self.config.pod_token_service_account
        if account is None:
            return podtokens.AdminToken(self.config.admin_token, self.config.admin_token_file)
        return podtokens.BoundTokens(
            self._api_for_tokens, *account, lifetime_s=self.config.pod_token_lifetime_s
        )

    async def _api_for_tokens(self) -> podtokens.TokenSource:
        return await self.seams.api_after_login()

    # -- the seams and the records, as tests and handlers see them ------------------------------

    @property
    def active(self) -> asyncio.Event:
        return self.seams.active

    @property
    def volume(self) -> Volume:
        return self.seams.volume

    @volume.setter
    def volume(self, volume: Volume) -> None:
        self.seams.volume = volume

    @property
    def pod_client(self) -> Pods:
        return self.seams.pods

    @pod_client.setter
    def pod_client(self, pods: Pods) -> None:
        self.seams.pods = pods

    @property
    def adapters(self) -> dict[Key, AdapterRecord]:
        return self.cache.adapters

    @property
    def pods(self) -> dict[Key, PodRecord]:
        return self.cache.pods

    # -- lifecycle ----------------------------------------------------------------------------

    def use_credentials(self, info: kopf.ConnectionInfo) -> None:
        server = urlsplit(info.server)
        if server.hostname:
            self.seams.api_endpoint = (server.hostname, server.port or 443)
        old, self.seams.api = self.seams.api, kube.KubeApi(info, instance=self.identity)
        if old is not None:
            self.hub.spawn(old.close())
        self.seams.logged_in.set()

    def start(self, pods_index: kopf.Index[str, PodInfo] | None = None) -> None:
        """Begin: at once when standalone, else when the peering says this replica acts.

        kopf's index of pods is complete before its first event handler runs: the controller
        reads it where a missing pod would do harm (placement, collection)."""
        self.cache.pods_index = pods_index
        self.hub.spawn(self.writer.run(), name="status-writer")
        self.hub.spawn(self.rollouts.run(), name="rollouts")
        self.hub.spawn(self.collector.run(), name="collector")
        self.hub.spawn(self.autoscaler.run(), name="autoscaler")
        self.hub.spawn(self.finalizer.run(), name="finalizer")
        if self.prover.policy.needs_chain:
            self.hub.spawn(self.prover.run(), name="identity")
        if self.config.standalone:
            self.set_active(True)
            return
        if self.config.peering is None:
            raise ValueError("a controller that is not standalone needs a peering object")
        mirror = peering.Mirror(
            self.seams.api_now,
            peering.peering_paths(self.config.peering, self.config.namespaces),
            self.identity,
            self.priority,
            self.set_active,
        )
        self.hub.spawn(self._after_login(mirror.run()), name="peering")

    def on_stop(self, callback: Callable[[], Coroutine[Any, Any, None]]) -> None:
        self._on_stop.append(callback)

    async def stop(self) -> None:
        for callback in self._on_stop:
            await callback()
        tasks = [t for actor in self.actors for t in actor.halt()]
        background = list(self.hub.background)
        for t in background:
            t.cancel()
        await asyncio.gather(*tasks, *background, return_exceptions=True)
        await self.seams.pods.close()
        if self.seams.api is not None:
            await self.seams.api.close()

    def set_active(self, active: bool) -> None:
        """Start acting (this replica leads, or stands alone), once the records hold every
        adapter there is; or stop (another one leads)."""
        if not active:
            if self._activating is not None:
                self._activating.cancel()
                self._activating = None
            if self.active.is_set():
                self.active.clear()
                log.info("action=standby identity=%s", self.identity)
                for actor in self.actors:
                    actor.standby()
            return
        if self.active.is_set() or self._activating is not None:
            return
        self._activating = asyncio.create_task(self._activate(), name="activate")
        self.hub.background.add(self._activating)
        self._activating.add_done_callback(self.hub.background.discard)

    async def _activate(self) -> None:
        await self._take_in_every_adapter()
        self._activating = None
        # Only the replica that acts may clean: another one's downloads live there too.
        removed = self.seams.volume.clean_tmp()
        log.info(
            "action=activate identity=%s priority=%d clean-tmp removed=%d",
            self.identity,
            self.priority,
            removed,
        )
        self.active.set()
        self.workers.activate()
        self.recorder.activate()
        self.finalizer.activate()
        for rec in self.adapters.values():
            self.stager.consider(rec)
            self.hub.mark(rec.key)

    async def _take_in_every_adapter(self) -> None:
        """Return once the records hold every LoRAAdapter the API lists. kopf delivers each
        adapter's first event in its own time; a pod planned before would unload the adapters
        not seen yet, and a placement made without them would move the others. A listed
        adapter not seen while none arrives for LIST_AGAIN_S may have been deleted since the
        list: the API is listed again."""
        api = await self.seams.api_after_login()
        listed: list[Key] | None = None
        while True:
            if listed is None:
                try:
                    listed = [
                        key
                        for namespace in self.config.namespaces or [None]
                        for key in await api.list_adapters(namespace)
                    ]
                except (kube.ApiError, aiohttp.ClientError, TimeoutError) as e:
                    log.warning("action=list-adapters result=error message=%r", str(e))
                    await asyncio.sleep(LIST_AGAIN_S)
                    continue
            missing = sum(1 for key in listed if key not in self.adapters)
            if not missing:
                log.info("action=listed-adapters adapters=%d", len(listed))
                return
            await asyncio.sleep(LIST_AGAIN_S)
            if sum(1 for key in listed if key not in self.adapters) == missing:
                listed = None

    async def _after_login(self, coro: Coroutine[Any, Any, None]) -> None:
        await self.seams.logged_in.wait()
        await coro

    # -- what kopf tells us -------------------------------------------------------------------

    def adapter_changed(self, body: Body, deleted: bool = False) -> None:
        info = adapter_info(body)
        key = info.key
        if deleted:
            self._forget(key)
            return
        rec, generation_changed = self.cache.adapter_seen(info, body)
        self.finalizer.seen(rec, body.get("metadata") or {})
        self.stager.changed(rec, generation_changed)
        self.stager.restage_compositions_of(info)
        if info.autoscale is None:
            self.autoscaler.reset(key)
        if info.command is not None:
            self.hub.mark(key)  # rollouts take the command from the annotation
        first_seen = not rec.fingerprint
        if self.cache.respecified(rec):
            if first_seen:
                self.placer.arrived(key)
            else:
                self.placer.stale(info.namespace)
            if not info.deleting:  # a deletion wakes the pods once it has unpublished
                self.workers.wake_adapter(key)
            self.hub.mark(key)

    def pod_changed(self, info: PodInfo, deleted: bool = False) -> None:
        if deleted:
            self.recorder.forget_pod(info.key)
            self.prover.forget_pod(info)
        elif not self.prover.judge(info):
            deleted = True  # not (yet) proven one of the release's: no worker, no call
        self.placer.stale(info.namespace)
        if deleted:
            self.workers.forget_pod(info.key)
        else:
            self.workers.changed(info)

    def _forget(self, key: Key) -> None:
        """The adapter is gone: every actor lets go of it, then the cache drops its record."""
        for actor in self.actors:
            actor.forget(key)
        rec = self.cache.forget(key)
        if rec is not None:
            self.stager.restage_compositions_of(rec.info)

    def targeted(self, rec: AdapterRecord) -> list[tuple[PodInfo, Any]]:
        """The Ready pods this adapter belongs on, with its entry on each (placer.targeted)."""
        return self.placer.targeted(rec)
