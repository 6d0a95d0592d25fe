"""The identity prover: decides which labelled pods are the release's inference pods, reading
each pod's owner chain from the API server by UID (trust decides; this actor reads). It owns the
verdicts, by pod UID, and the owners read, by their UID.

A pod with no verdict yet is neither trusted nor refused: it gets no worker and no placement
until its chain is read. A verdict is about the pod's UID and controlling owner (a pod's
ownerReferences may change: that is a new question), and a trusted pod's chain is read again
every `OWNER_TTL_S` (an owner's own reference may change: a controller releasing a copy), so
trust is never older than that. A chain that cannot be read (the API server away) is read again
with backoff; the pod waits meanwhile, and a trusted pod stays trusted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from lora_runtime import backoff

from lora_operator.controller.signals import Actor, Shared
from lora_operator.edges import kube
from lora_operator.rules import trust
from lora_operator.rules.model import PodInfo

log = logging.getLogger("lora_operator")

# Owners read once are kept this long for the next pods of the same ReplicaSet or StatefulSet
# (a rollout starts several at once); a proof is never older than this.
OWNER_TTL_S = 60.0
RETRY_CAP_S = 30.0

# (namespace, kind, name, uid): an owner as a pod's reference names it.
OwnerKey = tuple[str, str, str, str]


@dataclass(frozen=True)
class Verdict:
    owner: tuple[str, str, str] | None  # the controlling owner the verdict is about
    refusal: str | None  # None: trusted


class Identity(Actor):
    def __init__(self, shared: Shared) -> None:
        super().__init__(shared)
        self.policy = self.config.trust_policy
        self._verdicts: dict[str, Verdict] = {}  # by pod UID
        self._proving: dict[str, asyncio.Task[None]] = {}  # by pod UID
        self._owners: dict[OwnerKey, tuple[float, trust.Owner | None]] = {}
        self._latest: dict[str, PodInfo] = {}  # by pod UID: the newest event's

    def trusted(self, info: PodInfo) -> bool:
        """Whether `info` is proven to be one of the release's inference pods."""
        if not self.policy.needs_chain:
            return trust.static_refusal(info, self.policy) is None
        v = self._verdicts.get(info.uid)
        return v is not None and v.owner == info.owner and v.refusal is None

    def decided(self, info: PodInfo) -> bool:
        """Whether `info` is known to be trusted or refused (a verdict about its present
        owner exists): until then, what a status says of its namespace's pods may be wrong."""
        if not self.policy.needs_chain:
            return True
        v = self._verdicts.get(info.uid)
        return v is not None and v.owner == info.owner

    def judge(self, info: PodInfo) -> bool:
        """Whether `info` may be worked on now; starts reading its chain when no verdict about
        its present owner exists (the proof signals `pod_proven` when done)."""
        reason = trust.static_refusal(info, self.policy)
        if reason is not None:
            self.signals.pod_refused(info, reason)
            return False
        if not self.policy.needs_chain:
            return True
        self._latest[info.uid] = info
        v = self._verdicts.get(info.uid)
        if v is not None and v.owner == info.owner:
            return v.refusal is None
        if info.uid not in self._proving:
            self._proving[info.uid] = asyncio.create_task(self._prove(info))
        return False

    def forget_pod(self, info: PodInfo) -> None:
        self._verdicts.pop(info.uid, None)
        self._latest.pop(info.uid, None)
        task = self._proving.pop(info.uid, None)
        if task is not None:
            task.cancel()

    async def _prove(self, info: PodInfo) -> None:
        try:
            attempt = 0
            while True:
                try:
                    chain = await self._chain(info)
                    break
                except (kube.ApiError, OSError, TimeoutError) as e:
                    attempt += 1
                    wait = backoff.delay(attempt, cap=RETRY_CAP_S)
                    log.warning(
                        "action=prove pod=%s/%s result=retry in=%.0fs error=%s",
                        *info.key,
                        wait,
                        e,
                    )
                    await asyncio.sleep(wait)
            reason = trust.refusal(info, self.policy, chain)
        except kube.InvalidName as e:  # an ownerReference naming no possible object
            reason = f"its owner reference is not a Kubernetes name: {e}"
        except Exception as e:  # fail closed, and say so
            log.exception("action=prove pod=%s/%s result=error", *info.key)
            reason = f"its owner chain could not be checked: {e!r}"
        finally:
            self._proving.pop(info.uid, None)
        self._verdicts[info.uid] = Verdict(info.owner, reason)
        log.info(
            "action=prove pod=%s/%s result=%s%s",
            *info.key,
            "trusted" if reason is None else "refused",
            "" if reason is None else f" reason={reason!r}",
        )
        if reason is not None:
            self.signals.pod_refused(info, reason)
        latest = self._latest.get(info.uid, info)
        if latest.owner == info.owner:
            self.signals.pod_proven(latest)

    async def run(self) -> None:
        """Read every trusted pod's chain again, once per `OWNER_TTL_S`: a pod whose chain no
        longer holds loses its worker (`pod_proven` after the new verdict)."""
        while True:
            await asyncio.sleep(OWNER_TTL_S)
            for uid, v in list(self._verdicts.items()):
                info = self._latest.get(uid)
                if v.refusal is not None or info is None or uid in self._proving:
                    continue
                try:
                    reason = trust.refusal(info, self.policy, await self._chain(info))
                except (kube.ApiError, OSError, TimeoutError):
                    continue  # the API server away: keep what was proven, read again later
                except kube.InvalidName as e:
                    reason = f"its owner reference is not a Kubernetes name: {e}"
                except Exception as e:  # fail closed, and keep reading the others
                    log.exception("action=prove pod=%s/%s result=error", *info.key)
                    reason = f"its owner chain could not be checked: {e!r}"
                if reason is not None and self._verdicts.get(uid) == v:
                    self._verdicts[uid] = Verdict(info.owner, reason)
                    log.info("action=prove pod=%s/%s result=refused reason=%r", *info.key, reason)
                    self.signals.pod_refused(info, reason)
                    self.signals.pod_proven(self._latest.get(uid, info))

    async def _chain(self, info: PodInfo) -> list[trust.Owner]:
        chain: list[trust.Owner] = []
        while (ref := trust.next_owner(info, chain)) is not None:
            kube.check_name(ref.name, what=f"{ref.kind} name")  # it comes from the pod's spec
            owner = await self._owner((info.namespace, ref.kind, ref.name, ref.uid))
            if owner is None:
                break
            chain.append(owner)
        return chain

    async def _owner(self, key: OwnerKey) -> trust.Owner | None:
        now = time.monotonic()
        kept = self._owners.get(key)
        if kept is not None and now - kept[0] < OWNER_TTL_S:
            return kept[1]
        namespace, kind, name, _ = key
        api = await self.seams.api_after_login()
        body = await api.read_owner(namespace, kind, name)
        owner = trust.owner_from(kind, body) if body is not None else None
        self._owners = {k: v for k, v in self._owners.items() if now - v[0] < OWNER_TTL_S}
        self._owners[key] = (now, owner)
        return owner
