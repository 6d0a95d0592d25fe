"""The shared cache: one `AdapterRecord` per LoRAAdapter and one `PodRecord` per inference pod,
and the reads every actor shares (the namespace's adapters and pods, kopf's index of pods, the
record behind a served name).

An adapter's record is made of sub-records, each written by one actor only and read by the
others: `info` and `fingerprint` (the cache, from kopf's events), `staging` (the stager),
`entries` (the pod workers: the adapter's entry on each pod), `status` (the status writer),
`scaling` (the autoscaler), `rolling` (rollouts) and `deletion` (the finalizer). A pod's record
is its worker's, except `info` (the cache). Each field names its owner's module in its metadata
(`owner`), and a test that parses the package holds every write of it to that module
(tests/unit/operator/test_controller_ownership.py). The cache adds and drops records and takes
in what kopf says of them; it makes no decision.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import kopf

from lora_operator.controller.seams import Body, Key
from lora_operator.rules import autoscale, planning, rollout, status
from lora_operator.rules.model import AdapterInfo, Command, PodInfo
from lora_operator.rules.podstate import PodEntry
from lora_operator.rules.resume import RecordedLoad, plan_resume


@dataclass
class Staging:
    """The stager's: its state (what status renders), the task and the generation it stages."""

    state: status.StagingState
    task: asyncio.Task[None] | None = None
    generation: int | None = None


@dataclass
class Entries:
    """The pod workers': the adapter's entry on each pod under its own name (`own`) and under
    its rollout's canary alias (`canary`), and the loads recorded before an entry was made
    (by an earlier process in the status, or on a pod before it went away)."""

    own: dict[str, PodEntry] = field(default_factory=dict)  # pod name -> entry
    canary: dict[str, PodEntry] = field(default_factory=dict)
    recorded_loads: dict[str, RecordedLoad] = field(default_factory=dict)


@dataclass
class Written:
    """The status writer's: the status the object has, and what summarise says now."""

    body: dict[str, Any] | None = None
    headline: status.Headline | None = None
    at: float = field(default_factory=time.monotonic)  # or when first seen
    now: tuple[str, str] | None = None  # the headline summarise gives now
    now_since: float = field(default_factory=time.monotonic)
    # Since when what summarise says differs from `body` (None: it does not); a loss of pods is
    # written once it has lasted the grace (statuswrite.pods_lost_only).
    differs_since: float | None = None
    phase: str | None = None  # for the phase gauge


@dataclass
class Scaling:
    """The autoscaler's: the replicas chosen now, and the pods' hit counters at the last
    measurement (pod/served name -> count, and when)."""

    scale: autoscale.Scale | None = None
    hits_seen: tuple[dict[str, int], float] | None = None


@dataclass
class Rolling:
    """Rollouts': the rollout under way (None: none) and the command taken last."""

    rollout: rollout.Rollout | None = None
    taking: bool = False  # removing the rollout annotation, to act on it
    taken: Command | None = None  # acted on (or gone): not taken again


@dataclass
class Deletion:
    """The finalizer's: the object's finalizers as last seen, and how far its deletion got."""

    finalizers: tuple[str, ...] = ()  # metadata.finalizers at `resource_version`
    resource_version: str = ""
    unpublished: bool = False  # `current` is gone
    unloaded: bool = False  # and no pod holds the adapter any more
    give_up_at: float | None = None  # monotonic: released then, though pods still hold it


def owner(module: str) -> dict[str, str]:
    """A record field's metadata: the module of the one actor that writes it."""
    return {"owner": module}


@dataclass
class AdapterRecord:
    """Everything the controller knows about one LoRAAdapter."""

    info: AdapterInfo = field(metadata=owner("records"))
    staging: Staging = field(metadata=owner("stager"))
    entries: Entries = field(default_factory=Entries, metadata=owner("workers"))
    status: Written = field(default_factory=Written, metadata=owner("writer"))
    scaling: Scaling = field(default_factory=Scaling, metadata=owner("autoscaler"))
    rolling: Rolling = field(default_factory=Rolling, metadata=owner("rollouts"))
    deletion: Deletion = field(default_factory=Deletion, metadata=owner("finalizer"))
    # The fields that move pods and placement, as last seen (`Cache.respecified`).
    fingerprint: tuple[Any, ...] = field(default=(), metadata=owner("records"))

    @property
    def key(self) -> Key:
        return self.info.key

    @property
    def rollout(self) -> rollout.Rollout | None:
        return self.rolling.rollout


def seed(info: AdapterInfo, body: Body) -> AdapterRecord:
    """A record for an adapter first seen, resumed from its status (resume.plan_resume)."""
    resumed = plan_resume(info, body.get("status"))
    return AdapterRecord(
        info=info,
        staging=Staging(resumed.staging),
        entries=Entries(recorded_loads=resumed.recorded_loads),
        status=Written(body=resumed.written, headline=resumed.written_headline),
        scaling=Scaling(scale=resumed.scale),
        rolling=Rolling(rollout=resumed.rollout),
    )


class Recorded(NamedTuple):
    """A served name's want and card last recorded for a pod, and the entry they gave."""

    want: planning.Want
    card: planning.Card | None
    entry: PodEntry


_WORKERS = owner("workers")


@dataclass
class PodRecord:
    """One inference pod: its worker and what it last reported."""

    info: PodInfo = field(metadata=owner("records"))
    wake: asyncio.Event = field(default_factory=asyncio.Event, metadata=_WORKERS)
    task: asyncio.Task[None] | None = field(default=None, metadata=_WORKERS)
    report: planning.PodReport | None = field(default=None, metadata=_WORKERS)
    # A backoff after a failure, instead of the resync interval.
    retry_in: float | None = field(default=None, metadata=_WORKERS)
    failures: int = field(default=0, metadata=_WORKERS)  # failed reads of /v1/models in a row
    # Reported (or kept failing) since this replica began to act.
    heard: bool = field(default=False, metadata=_WORKERS)
    # The served names with an entry for this pod (`_record` skips what has not changed).
    entries: dict[str, Recorded] = field(default_factory=dict, metadata=_WORKERS)
    # The served names among `entries` that are not their adapter's own (a canary's alias).
    aliases: set[str] = field(default_factory=set, metadata=_WORKERS)
    # The served names whose entry on this pod may be tried again (not Loaded, not refused for
    # good), so that a pass's retry delay is found among these, not among every entry: every
    # such entry is here; one that settled since leaves when a pass looks.
    unsettled: set[str] = field(default_factory=set, metadata=_WORKERS)
    # The adapters the next pass plans, each woken alone (`wake_adapter`); None: every adapter
    # of the namespace (the pod changed, a placement moved, a resync, a retry).
    due: set[str] | None = field(default=None, metadata=_WORKERS)
    # When `report` was read (monotonic), while it still holds every call's outcome: a pod's
    # adapters change by the operator's calls or a restart, so a pass woken for some adapters
    # plans from it without reading the pod again (`Workers._held`). None after a call whose
    # outcome the report lacks (one that failed, a load answered without a card).
    read_at: float | None = field(default=None, metadata=_WORKERS)
    # The next pass reads the pod whatever it was woken for (`Workers.refresh`: the autoscaler
    # wants fresh hit counts), and plans only the adapters it was woken for or whose cards
    # changed.
    read_due: bool = field(default=False, metadata=_WORKERS)


# An adapter's entries on the pods under one served name: its own, or its canary alias's.
Found = tuple[AdapterRecord, dict[str, PodEntry]]


class Cache:
    """The records, and kopf's index of pods (complete from the first event on)."""

    def __init__(self) -> None:
        self.adapters: dict[Key, AdapterRecord] = {}
        self.pods: dict[Key, PodRecord] = {}
        # The same records by namespace: a namespace's pass reads its own, not a scan of all
        # (10,000 adapters in 100 namespaces).
        self._adapters_by_ns: dict[str, dict[Key, AdapterRecord]] = {}
        self._pods_by_ns: dict[str, dict[Key, PodRecord]] = {}
        self.pods_index: kopf.Index[str, PodInfo] | None = None
        # Whether a pod is proven one of the release's (the identity prover's verdicts): the
        # index holds every labelled pod that may be, placement counts only those that are;
        # and whether it is decided either way yet.
        self.trusted: Callable[[PodInfo], bool] = lambda _: True
        self.decided: Callable[[PodInfo], bool] = lambda _: True

    # -- what kopf says (the cache's own writes) ------------------------------------------------

    def adapter_seen(self, info: AdapterInfo, body: Body) -> tuple[AdapterRecord, bool]:
        """The adapter's record with `info` as kopf has it now, made when first seen (resumed
        from its status); and whether its generation changed (a new record's did)."""
        rec = self.adapters.get(info.key)
        if rec is None:
            rec = self.adapters[info.key] = seed(info, body)
            self._adapters_by_ns.setdefault(info.namespace, {})[info.key] = rec
            return rec, True
        generation_changed = rec.info.generation != info.generation
        rec.info = info
        return rec, generation_changed

    def respecified(self, rec: AdapterRecord) -> bool:
        """Whether a field that moves pods or placement changed since the last call."""
        info = rec.info
        fingerprint = (
            info.deleting,
            info.scale,
            info.pinned,
            info.selector,
            info.base_model,
            info.replicas,
            info.autoscale,
        )
        if rec.fingerprint == fingerprint:
            return False
        rec.fingerprint = fingerprint
        return True

    def forget(self, key: Key) -> AdapterRecord | None:
        _drop(self._adapters_by_ns, key)
        return self.adapters.pop(key, None)

    def pod_seen(self, info: PodInfo) -> tuple[PodRecord, PodInfo | None]:
        """The pod's record with `info` as kopf has it now, made when first seen; and the info
        it had before (None: new)."""
        prec = self.pods.get(info.key)
        if prec is None:
            prec = self.pods[info.key] = PodRecord(info=info)
            self._pods_by_ns.setdefault(info.namespace, {})[info.key] = prec
            return prec, None
        before, prec.info = prec.info, info
        return prec, before

    def forget_pod(self, key: Key) -> PodRecord | None:
        _drop(self._pods_by_ns, key)
        return self.pods.pop(key, None)

    # -- the shared reads ---------------------------------------------------------------------

    def adapters_in(self, namespace: str) -> list[AdapterRecord]:
        return list(self._adapters_by_ns.get(namespace, {}).values())

    def pods_in(self, namespace: str) -> list[PodRecord]:
        return list(self._pods_by_ns.get(namespace, {}).values())

    def indexed(self, namespace: str) -> Iterable[AdapterInfo]:
        """The namespace's adapters: complete once the controller acts (it waits until the
        records hold every adapter the API lists)."""
        return [r.info for r in self.adapters_in(namespace)]

    def indexed_pods(self, namespace: str) -> Iterable[PodInfo]:
        if self.pods_index is None:
            return [p.info for p in self.pods_in(namespace)]
        return [p for p in self.pods_index.get(namespace, ()) if self.trusted(p)]

    def current(self, info: AdapterInfo) -> tuple[AdapterInfo, AdapterRecord | None]:
        """The cache's record of an adapter, and its info there (`info` when it has none)."""
        rec = self.adapters.get(info.key)
        return (rec.info, rec) if rec is not None else (info, None)

    def served(self, namespace: str, served: str) -> Found | None:
        """The record and entries behind a name a pod serves: an adapter's own name, or the
        alias of its rollout's canary."""
        rec = self.adapters.get((namespace, served))
        if rec is not None:
            return rec, rec.entries.own
        name = served.rpartition(rollout.ALIAS_SEPARATOR)[0]
        rec = self.adapters.get((namespace, name))
        r = rec.rollout if rec is not None else None
        if rec is None or r is None or rollout.alias(name, r.canary) != served:
            return None
        return rec, rec.entries.canary

    def heard(self, namespace: str) -> bool:
        """Whether every Ready pod of the namespace has been judged, and every one of the
        release's has reported since this replica began to act: until then a status could
        claim fewer pods than an earlier process had seen (a restarted operator proves the
        pods' owner chains again)."""
        labelled = (
            self.pods_index.get(namespace, ())
            if self.pods_index is not None
            else [p.info for p in self.pods_in(namespace)]
        )
        for pod in labelled:
            if not pod.reachable:
                continue
            if not self.decided(pod):
                return False
            if self.trusted(pod) and not (
                (prec := self.pods.get(pod.key)) is not None and prec.heard
            ):
                return False
        return True

    def all_reported(self) -> bool:
        """Whether every Ready pod has a report (kopf's index lists every pod there is)."""
        namespaces = set(self.pods_index or ()) | {k[0] for k in self.pods}
        return all(
            (prec := self.pods.get(pod.key)) is not None and prec.report is not None
            for ns in namespaces
            for pod in self.indexed_pods(ns)
            if pod.reachable
        )

    def held(self, namespace: str) -> set[str]:
        """The adapters some pod of the namespace reports holding (a revision of)."""
        return {
            adapter
            for p in self.pods_in(namespace)
            if p.report is not None
            for adapter, _ in p.report.revisions()
        }


def _drop(by_namespace: dict[str, dict[Key, Any]], key: Key) -> None:
    records = by_namespace.get(key[0])
    if records is not None:
        records.pop(key, None)
        if not records:
            del by_namespace[key[0]]
