"""How the actors reach each other: one small interface of notices, each handled by the one actor
that owns what it concerns. An actor never writes another's state; it says what changed.

`Hub` is the one implementation: the controller builds the actors, then binds them here. Every
actor is an `Actor`: it reads the configuration, the metrics, the seams and the cache, and has
the signals to reach the others (`Shared`). Each actor registers itself in `Shared.actors` as it
is made, so what concerns every actor (an adapter gone, standby, stop) reaches each one, a new
one included.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lora_operator.controller.records import Cache
from lora_operator.controller.seams import Key, Seams
from lora_operator.edges.config import OperatorConfig
from lora_operator.edges.metrics import Metrics
from lora_operator.rules import events
from lora_operator.rules.model import AdapterInfo, PodInfo

if TYPE_CHECKING:
    from lora_operator.controller.collector import Collector
    from lora_operator.controller.finalizer import Finalizer
    from lora_operator.controller.placer import Placer
    from lora_operator.controller.recorder import Recorder
    from lora_operator.controller.rollouts import Rollouts
    from lora_operator.controller.stager import Stager
    from lora_operator.controller.workers import Workers
    from lora_operator.controller.writer import StatusWriter


class Signals(Protocol):
    def mark(self, key: Key) -> None:
        """The adapter may have changed: its status (the status writer) and what moves its
        rollout on (rollouts)."""

    def mark_namespace(self, namespace: str) -> None:
        """Every adapter of the namespace may have changed (the status writer, rollouts)."""

    def wake_namespace(self, namespace: str) -> None:
        """What the namespace's pods should hold may have changed (the pod workers)."""

    def wake_adapter(self, key: Key) -> None:
        """What the namespace's pods should hold of this one adapter may have changed (the pod
        workers: their next pass plans it, not the whole namespace)."""

    def refresh_pods(self, namespace: str) -> None:
        """The namespace's pods' hit counts are wanted fresh (the pod workers read each pod
        again, and plan only what its answer changed)."""

    def replace(self, namespace: str) -> None:
        """An input of the namespace's placement changed (the placer)."""

    def collect(self) -> None:
        """A revision may no longer be in use (the collector)."""

    def member_changed(self, member: AdapterInfo) -> None:
        """An adapter's spec or revision changed, or it is gone (the stager: compositions)."""

    def staged(self, key: Key, serving: str | None, staged: str) -> None:
        """The adapter staged a new newest revision (rollouts)."""

    def canary_changed(self, key: Key) -> None:
        """The adapter's rollout has another canary, or none: its entries under the canary's
        alias start afresh (the pod workers)."""

    async def stop_staging(self, key: Key) -> None:
        """Stop staging the adapter, and return once its task has ended (the stager)."""

    def holdings_changed(self, namespace: str) -> None:
        """What the namespace's pods hold changed (the finalizer)."""

    def post(self, info: AdapterInfo, note: events.Note) -> None:
        """An Event about the adapter (the event recorder)."""

    def pod_refused(self, info: PodInfo, reason: str) -> None:
        """A labelled pod is not one of the release's inference pods (the event recorder)."""

    def pod_proven(self, info: PodInfo) -> None:
        """A pod's identity was decided: take its event again (the controller)."""

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        """Run in the background, cancelled at stop."""


@dataclass(frozen=True)
class Shared:
    """What every actor reads, and the signals it reaches the others by."""

    config: OperatorConfig
    metrics: Metrics
    seams: Seams
    cache: Cache
    signals: Signals
    actors: list[Actor] = field(default_factory=list)  # every actor made, in that order


class Actor:
    """One owner of one part of the controller's state."""

    def __init__(self, shared: Shared) -> None:
        self.config, self.metrics, self.seams = shared.config, shared.metrics, shared.seams
        self.cache, self.signals = shared.cache, shared.signals
        shared.actors.append(self)

    def forget(self, key: Key) -> None:
        """The adapter is gone: let go of what this actor holds of it."""

    def standby(self) -> None:
        """Another replica acts now: stop the work this actor started (it starts again when
        this replica acts)."""

    def halt(self) -> list[asyncio.Task[None]]:
        """The controller stops: cancel this actor's own tasks, and return them to be awaited."""
        return []


class Hub:
    """Signals, delivered by plain calls on the one event loop."""

    writer: StatusWriter
    workers: Workers
    placer: Placer
    collector: Collector
    stager: Stager
    rollouts: Rollouts
    finalizer: Finalizer
    recorder: Recorder
    on_pod: Callable[[PodInfo], None]  # the controller's pod_changed

    def __init__(self) -> None:
        self.background: set[asyncio.Task[None]] = set()

    def mark(self, key: Key) -> None:
        self.writer.mark(key)
        self.rollouts.mark(key)

    def mark_namespace(self, namespace: str) -> None:
        self.writer.mark_namespace(namespace)
        self.rollouts.mark_namespace(namespace)

    def wake_namespace(self, namespace: str) -> None:
        self.workers.wake_namespace(namespace)

    def wake_adapter(self, key: Key) -> None:
        self.workers.wake_adapter(key)

    def refresh_pods(self, namespace: str) -> None:
        self.workers.refresh(namespace)

    def replace(self, namespace: str) -> None:
        self.placer.stale(namespace)

    def collect(self) -> None:
        self.collector.collect()

    def member_changed(self, member: AdapterInfo) -> None:
        self.stager.restage_compositions_of(member)

    def staged(self, key: Key, serving: str | None, staged: str) -> None:
        self.rollouts.begin(key, serving, staged)

    def canary_changed(self, key: Key) -> None:
        self.workers.canary_changed(key)

    async def stop_staging(self, key: Key) -> None:
        await self.stager.stop(key)

    def holdings_changed(self, namespace: str) -> None:
        self.finalizer.check_unloaded(namespace)

    def post(self, info: AdapterInfo, note: events.Note) -> None:
        self.recorder.post(info, note)

    def pod_refused(self, info: PodInfo, reason: str) -> None:
        self.recorder.untrusted(info, reason)

    def pod_proven(self, info: PodInfo) -> None:
        self.on_pod(info)

    def spawn(self, coro: Coroutine[Any, Any, None], name: str | None = None) -> None:
        task = asyncio.create_task(coro, name=name)
        self.background.add(task)
        task.add_done_callback(self.background.discard)
