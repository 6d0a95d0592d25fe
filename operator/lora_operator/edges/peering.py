"""Which operator replica acts: kopf's peering, mirrored so the controller knows it too.

With `--peering NAME`, kopf keeps each replica's priority and liveness in a peering object
(ClusterKopfPeering NAME, or KopfPeering NAME in each watched namespace) and pauses its watches
in every replica but the one with the highest priority among the live ones. kopf does not tell
its handlers when it pauses, while the controller has work of its own (pod workers, staging
retries, status writes, cleaning `.tmp/`): so the controller watches the same object and applies
the same rule (`decide`, pure, as kopf 1.45's `process_peering_event`), and acts only while it
says active.

Priorities: the older replica wins (`start_priority`), so a replica that starts next to a
running one waits as its standby instead of taking over, and a takeover happens only when the
active one stops renewing its entry (after kopf's peering lifetime).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import os
import random
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from lora_runtime import backoff

log = logging.getLogger("lora_operator")

GROUP_VERSION = "/apis/kopf.dev/v1"


@dataclass(frozen=True)
class Peer:
    identity: str
    priority: int
    deadline: datetime.datetime


def parse_peers(status: Mapping[str, Any] | None) -> list[Peer]:
    """The peers a peering object's status lists (kopf's format: id -> priority, lifetime,
    lastseen)."""
    peers = []
    for identity, raw in (status or {}).items():
        if not isinstance(raw, Mapping):
            continue
        try:
            seen = datetime.datetime.fromisoformat(str(raw["lastseen"]))
            lifetime = datetime.timedelta(seconds=int(raw.get("lifetime", 60)))
            priority = int(raw.get("priority", 0))
        except (KeyError, TypeError, ValueError):
            continue
        if seen.tzinfo is None:
            seen = seen.replace(tzinfo=datetime.UTC)
        peers.append(Peer(str(identity), priority, seen + lifetime))
    return peers


def decide(
    peers: list[Peer], identity: str, priority: int, now: datetime.datetime
) -> tuple[bool, datetime.datetime | None]:
    """(whether this replica acts, when to decide again): it acts unless another live peer has
    a priority as high or higher (kopf pauses both replicas of a tie). The time is the first
    deadline of such a peer, when it may have died."""
    blocking = [
        p for p in peers if p.identity != identity and p.deadline > now and p.priority >= priority
    ]
    if not blocking:
        return True, None
    return False, min(p.deadline for p in blocking)


def start_priority() -> int:
    """The older replica wins: minus the start time in milliseconds, with a random tie-break."""
    now_ms = int(datetime.datetime.now(datetime.UTC).timestamp() * 1000)
    return -(now_ms * 1000 + random.randrange(1000))


def own_identity() -> str:
    """kopf's POD_ID when set (the chart sets it), else host, pid and a random suffix."""
    return os.environ.get("POD_ID") or (
        f"{socket.gethostname()}/{os.getpid()}/{random.randrange(16**6):06x}"
    )


def peering_paths(name: str, namespaces: tuple[str, ...]) -> list[tuple[str, str]]:
    """(collection, name) of each peering object kopf uses for these namespaces."""
    if not namespaces:
        return [(f"{GROUP_VERSION}/clusterkopfpeerings", name)]
    return [(f"{GROUP_VERSION}/namespaces/{ns}/kopfpeerings", name) for ns in namespaces]


class Watcher(Protocol):
    async def request(self, method: str, path: str) -> Any: ...

    def watch(self, collection: str, params: Mapping[str, str]) -> Any: ...


class Mirror:
    """Follows the peering objects and calls `on_change(active)` whenever the verdict changes;
    inactive until the first object says otherwise (kopf starts paused as well)."""

    def __init__(
        self,
        kube: Callable[[], Watcher],
        objects: list[tuple[str, str]],
        identity: str,
        priority: int,
        on_change: Callable[[bool], None],
    ) -> None:
        self._kube = kube
        self._objects = objects
        self.identity, self.priority = identity, priority
        self._on_change = on_change
        self._verdicts = dict.fromkeys(objects, False)
        self._peers: dict[tuple[str, str], list[Peer]] = {o: [] for o in objects}
        self.active = False
        self._said = False

    async def run(self) -> None:
        await asyncio.gather(*(self._follow(o) for o in self._objects))

    def _judge(self, target: tuple[str, str], status: Mapping[str, Any] | None) -> float | None:
        """Record what one object says; seconds until it should be judged again."""
        if status is not None:
            self._peers[target] = parse_peers(status)
        now = datetime.datetime.now(datetime.UTC)
        verdict, again = decide(self._peers[target], self.identity, self.priority, now)
        self._verdicts[target] = verdict if status is not None or self._peers[target] else False
        active = all(self._verdicts.values())
        if active != self.active or not self._said:
            self._said = True  # the first verdict is logged too: a standby says so
            log.info("action=peering active=%s identity=%s", active, self.identity)
        if active != self.active:
            self.active = active
            self._on_change(active)
        return None if again is None else max(0.1, (again - now).total_seconds())

    async def _follow(self, target: tuple[str, str]) -> None:
        collection, name = target
        version: str | None = None
        recheck: asyncio.TimerHandle | None = None
        loop = asyncio.get_running_loop()
        failures = 0
        while True:
            try:
                kube = self._kube()
                if version is None:
                    listing = await kube.request(
                        "GET", f"{collection}?fieldSelector=metadata.name%3D{name}"
                    )
                    items = listing.get("items") or []
                    self._peers[target] = []
                    delay = self._judge(target, (items[0].get("status") or {}) if items else None)
                    version = str(listing["metadata"]["resourceVersion"])
                    recheck = _reschedule(loop, recheck, delay, lambda: self._judge(target, None))
                params = {
                    "fieldSelector": f"metadata.name={name}",
                    "resourceVersion": version,
                    "timeoutSeconds": "60",
                }
                async for kind, obj in kube.watch(collection, params):
                    if kind == "ERROR":  # 410 Gone: list again
                        version = None
                        break
                    version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                    if kind == "BOOKMARK":
                        continue
                    status = (obj.get("status") or {}) if kind != "DELETED" else None
                    if status is None:
                        self._peers[target] = []
                    delay = self._judge(target, status)
                    recheck = _reschedule(loop, recheck, delay, lambda: self._judge(target, None))
                failures = 0
            except asyncio.CancelledError:
                if recheck is not None:
                    recheck.cancel()
                raise
            except Exception as e:  # the API server restarting, a dropped connection
                failures += 1
                version = None
                log.info("action=peering-watch result=error message=%r", str(e)[:200])
                await asyncio.sleep(backoff.delay(failures, cap=10.0))


def _reschedule(
    loop: asyncio.AbstractEventLoop,
    handle: asyncio.TimerHandle | None,
    delay: float | None,
    callback: Callable[[], object],
) -> asyncio.TimerHandle | None:
    if handle is not None:
        handle.cancel()
    return None if delay is None else loop.call_later(delay, callback)
