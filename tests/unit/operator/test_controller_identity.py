"""The identity prover in the controller: a labelled pod is worked on only once its owner chain,
read from the (fake) API server by UID, ends at one of the release's workloads. The decisions
themselves are test_trust.py's; here: what reaches the pods, the Events, the retries."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from lora_operator.controller import identity
from lora_operator.edges import kube
from lora_operator.rules.model import PodInfo, pod_info

from tests.support.controller import NS, Rig, adapter
from tests.support.polling import until

POLICY = dict(
    inference_namespaces=(NS,),
    inference_service_account="rel-inference",
    inference_workloads=("rel-inference",),
)
RS: dict[str, Any] = {
    "kind": "ReplicaSet",
    "name": "rel-inference-5f7c9",
    "uid": "rs1",
    "controller": True,
}
DEPLOY: dict[str, Any] = {
    "kind": "Deployment",
    "name": "rel-inference",
    "uid": "d1",
    "controller": True,
}


CONTAINERS = [{"name": "inference", "image": "registry/inference:1", "args": ["serve"]}]


LABELS = {"lora.dev/inference": "true", "app": "inference"}


def apps_object(ref: dict[str, Any], owner: dict[str, Any] | None) -> dict[str, Any]:
    template = {"serviceAccountName": "rel-inference", "containers": CONTAINERS}
    return {
        "metadata": {
            "name": ref["name"],
            "uid": ref["uid"],
            "labels": LABELS,
            "ownerReferences": [owner] * bool(owner),
        },
        "spec": {"selector": {"matchLabels": {"app": "inference"}}, "template": {"spec": template}},
    }


def labelled_pod(name: str, owner: dict[str, Any] | None) -> PodInfo:
    meta: dict[str, Any] = {
        "namespace": NS,
        "name": name,
        "uid": f"uid-{name}",
        "labels": LABELS,
        "ownerReferences": [owner] if owner else [],
    }
    return pod_info(
        {
            "metadata": meta,
            "spec": {"serviceAccountName": "rel-inference", "containers": CONTAINERS},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        }
    )


def release_objects(rig: Rig) -> None:
    rig.api.owners[("ReplicaSet", RS["name"])] = apps_object(RS, DEPLOY)
    rig.api.owners[("Deployment", DEPLOY["name"])] = apps_object(DEPLOY, None)


async def test_only_the_pod_whose_chain_is_proven_gets_calls(tmp_path: Path) -> None:
    async with Rig(tmp_path, **POLICY) as rig:
        release_objects(rig)
        # A tenant's own ReplicaSet, named like the release's and claiming the real
        # Deployment by name and UID; the Deployment does not claim it back, its RS is rs1.
        mine = {**RS, "name": "rel-inference-x", "uid": "rs9"}
        rig.api.owners[("ReplicaSet", "rel-inference-x")] = apps_object(
            mine, {**DEPLOY, "uid": "guess"}
        )
        c = rig.controller
        c.start()
        c.adapter_changed(adapter(rig.volume, "a"))
        genuine = labelled_pod("genuine", RS)
        forged_uid = labelled_pod("forged-uid", {**RS, "uid": "rs-guessed"})
        own_rs = labelled_pod("own-rs", mine)
        direct = labelled_pod("direct", DEPLOY)
        for p in (genuine, forged_uid, own_rs, direct):
            c.pod_changed(p)
        await until("the genuine pod loaded", lambda: ("load", "genuine", "a") in rig.log)
        await until(
            "an Event for each look-alike",
            lambda: len([e for e in rig.api.events if e[2] == "UntrustedInferencePod"]) == 3,
        )
        await asyncio.sleep(0.5)  # resyncs: still nothing for the look-alikes
        assert {entry[1] for entry in rig.log} == {"genuine"}
        notes = " ".join(e[3] for e in rig.api.events if e[2] == "UntrustedInferencePod")
        assert "forged or stale" in notes and "Deployments own ReplicaSets" in notes
        # Placement counts the genuine pod only: the adapter is Ready on 1/1.
        await until("Ready", lambda: rig.ready("a"))
        assert rig.api.status["a"][-1]["ready"] == "1/1"
        # Siblings of a proven ReplicaSet reuse what was read.
        reads = len(rig.api.owner_reads)
        c.pod_changed(labelled_pod("sibling", RS))
        await until("the sibling loaded", lambda: ("load", "sibling", "a") in rig.log)
        assert len(rig.api.owner_reads) == reads


async def test_a_chain_that_cannot_be_read_yet_is_read_again(tmp_path: Path) -> None:
    async with Rig(tmp_path, **POLICY) as rig:
        release_objects(rig)
        rig.api.owner_errors = [kube.ApiError(503, "unavailable")]
        c = rig.controller
        c.start()
        c.adapter_changed(adapter(rig.volume, "a"))
        c.pod_changed(labelled_pod("p", RS))
        await until("loaded after the retry", lambda: ("load", "p", "a") in rig.log, timeout=10)
        assert not [e for e in rig.api.events if e[2] == "UntrustedInferencePod"]


async def test_an_owner_reference_that_is_no_name_is_refused_without_a_read(tmp_path: Path) -> None:
    async with Rig(tmp_path, **POLICY) as rig:
        c = rig.controller
        c.start()
        c.pod_changed(labelled_pod("p", {**RS, "name": "../../secrets/x"}))
        await until("refused", lambda: any(e[2] == "UntrustedInferencePod" for e in rig.api.events))
        (note,) = [e[3] for e in rig.api.events if e[2] == "UntrustedInferencePod"]
        assert "not a Kubernetes name" in note


async def test_a_trusted_pod_whose_chain_no_longer_holds_loses_its_worker(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """A copy of the genuine ReplicaSet that the Deployment controller releases: trusted while
    its chain held, refused once it is read again, and called no more."""
    monkeypatch.setattr(identity, "OWNER_TTL_S", 0.3)
    async with Rig(tmp_path, **POLICY) as rig:
        release_objects(rig)
        c = rig.controller
        c.start()
        c.adapter_changed(adapter(rig.volume, "a"))
        c.pod_changed(labelled_pod("p", RS))
        await until("loaded", lambda: ("load", "p", "a") in rig.log)
        # The ReplicaSet is released: its controller reference is gone.
        rig.api.owners[("ReplicaSet", RS["name"])] = apps_object(RS, None)
        await until(
            "refused on the next reading",
            lambda: any(e[2] == "UntrustedInferencePod" for e in rig.api.events),
            timeout=10,
        )
        (note,) = [e[3] for e in rig.api.events if e[2] == "UntrustedInferencePod"]
        assert "not controlled by a Deployment" in note
        await until("its worker gone", lambda: ("ns", "p") not in c.pods)
        calls = len(rig.log)
        await asyncio.sleep(1)  # resyncs every 0.3 s: nothing more for it
        assert len(rig.log) == calls


async def test_no_status_counts_the_pods_before_each_is_judged(tmp_path: Path) -> None:
    """A pod whose chain is not read yet (a restarted operator proves every pod again, and the
    API server may be slow to answer) is neither trusted nor refused: no status says there is
    no pod for the adapter meanwhile."""
    async with Rig(tmp_path, **POLICY) as rig:
        release_objects(rig)
        rig.api.owner_errors = [kube.ApiError(503, "unavailable")] * 3  # about 7 s of retries
        c = rig.controller
        p = labelled_pod("p", RS)
        c.start({NS: [p]})  # type: ignore[arg-type]  # kopf's index of pods, as it lists them
        c.adapter_changed(adapter(rig.volume, "a"))
        c.pod_changed(p)
        await until("loaded after the retries", lambda: ("load", "p", "a") in rig.log, timeout=30)
        await until("Ready", lambda: rig.ready("a"))
        said = [c["reason"] for s in rig.api.status["a"] for c in s.get("conditions") or () if c]
        assert "Loaded" in said and "NoPods" not in said, said
