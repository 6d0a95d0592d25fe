"""The event recorder: posts Kubernetes Events in the background (a pod's loads never wait for
the API server), a repeat of a recent Event counted into its series (events.Series). It owns
the series, the Event writes in flight, and which untrusted pods were reported (once per pod).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from lora_operator.controller.seams import Key
from lora_operator.controller.signals import Actor, Shared
from lora_operator.rules import events
from lora_operator.rules.model import INFERENCE_LABEL, AdapterInfo, PodInfo, object_ref

log = logging.getLogger("lora_operator")


class Recorder(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self._series = events.Series()
        self._slots = asyncio.Semaphore(8)
        # Labelled pods that are not the release's (identity decided), by key: the uid an Event
        # was posted for, so that each such pod is reported once.
        self._distrusted: dict[Key, str] = {}
        # Refused while this replica did not act yet: reported when it does (`activate`).
        self._refused_before: dict[Key, tuple[PodInfo, str]] = {}

    def activate(self) -> None:
        waiting, self._refused_before = self._refused_before, {}
        for info, reason in waiting.values():
            self.untrusted(info, reason)

    def forget(self, key: Key) -> None:
        rec = self.cache.adapters.get(key)
        if rec is not None:
            self._series.forget(rec.info.uid)

    def forget_pod(self, key: Key) -> None:
        self._distrusted.pop(key, None)
        self._refused_before.pop(key, None)

    def post(self, info: AdapterInfo, note: events.Note) -> None:
        name, count = self._series.record(
            (info.uid, note.type, note.reason, note.note),
            time.monotonic(),
            f"{info.name}.{uuid.uuid4().hex[:16]}",
        )
        self.signals.spawn(self._send(object_ref(info), name, count, note))

    def untrusted(self, info: PodInfo, reason: str) -> None:
        """`info` is not one of the release's inference pods (identity decided why): an Event
        says so, once per pod."""
        if not self.seams.active.is_set():
            self._refused_before[info.key] = (info, reason)
            return
        if self._distrusted.get(info.key) == info.uid:
            return
        self._distrusted[info.key] = info.uid
        log.warning("action=distrust pod=%s/%s reason=%r", *info.key, reason)
        regarding = {"apiVersion": "v1", "kind": "Pod", "name": info.name, "uid": info.uid}
        if info.owner is not None and info.owner[0] in ("ReplicaSet", "Deployment", "StatefulSet"):
            kind, name, uid = info.owner
            regarding = {"apiVersion": "apps/v1", "kind": kind, "name": name, "uid": uid}
        note = events.Note(
            "Warning",
            "UntrustedInferencePod",
            f"pod {info.name} has the label {INFERENCE_LABEL} but is not one of the release's "
            f"inference pods: {reason}. The operator sends it no token and loads nothing on it.",
        )
        event = f"{info.name}.{uuid.uuid4().hex[:16]}"
        self.signals.spawn(self._send({**regarding, "namespace": info.namespace}, event, 1, note))

    async def _send(
        self, regarding: dict[str, str], name: str, count: int, note: events.Note
    ) -> None:
        async with self._slots:
            api = await self.seams.api_after_login()
            try:
                if count == 1:
                    await api.create_event(regarding, name, note.type, note.reason, note.note)
                else:
                    await api.count_event(regarding["namespace"], name, count)
            except Exception as e:  # an Event is never worth a retry storm
                log.warning("could not post event %s on %s: %s", note.reason, regarding["name"], e)
