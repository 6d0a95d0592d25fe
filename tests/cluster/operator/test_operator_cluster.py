"""The operator on the local cluster: a real API server, real inference pods (tiny SD 1.5 in the
project's image, on the real kubelet), the operator as a real process, the adapter volume as a
host directory the pods mount. Nothing here touches a LoRAAdapter except to apply, update or
delete it.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path

import numpy as np
from lora_demo import release
from lora_devcluster.harness import Harness
from lora_inference.tools.random_adapters import write_random_adapter
from lora_inference.tools.tiny_models import write_tiny_model

from tests.support import cluster
from tests.support.cluster import MODEL_NAME, TOKEN, Models, Operator
from tests.support.http import GENERATION, generate, http_json
from tests.support.phases import Phase


def test_adapter_follows_replicas_restarts_updates_and_deletion(
    devcluster: Harness,
    devcluster_namespace: str,
    operator: Operator,
    volume: Path,
    models: Models,
    phase: Phase,
) -> None:
    h, ns = devcluster, devcluster_namespace
    phase("apply -> Ready 2/2, every pod serving the staged file")
    src_a, sha_a = cluster.write_adapter(models, volume / ns / "src" / "a", seed=1)
    src_b, sha_b = cluster.write_adapter(models, volume / ns / "src" / "b", seed=2)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 2, models.root, volume), ns
    )
    h.apply(cluster.adapter("pixel", str(src_a), scale=1.0), ns)

    # apply -> Staged -> Ready 2/2, and every pod serves exactly the staged file.
    obj = cluster.wait_phase(h, ns, "pixel", "Ready", "2/2", timeout=240)
    st = obj["status"]
    assert st["staged"]["sha256"] == sha_a
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "Staged": "True",
        "Ready": "True",
        "Degraded": "False",
    }
    assert sorted(p["state"] for p in st["pods"]) == ["Loaded", "Loaded"]
    assert {p["revision"] for p in st["pods"]} == {sha_a}
    assert st["observedGeneration"] == obj["metadata"]["generation"]
    assert os.readlink(volume / ns / "pixel" / "current") == f"revisions/{sha_a}"
    ips = cluster.pod_ips(h, ns, 2)
    # What the staged file declares is in the status (the CRD's schema keeps it), in the words
    # the pods serving it list on /v1/adapters.
    for ip in ips.values():
        code, listed = http_json(f"http://{ip}:8000/v1/adapters")
        assert code == 200, listed
        (card,) = [c for c in listed["data"] if c["id"] == "pixel"]
        assert st["adapter"] == {
            "format": card["format"],
            "rank": card["rank"],
            "targets": card["targets"],
            "triggerWords": card["trigger_words"],
        }
    assert (st["adapter"]["format"], st["adapter"]["rank"]) == ("lora", 4)
    # The reference: the same file loaded directly by path, on the same pod. (Not one pod's
    # picture for all: each server measures its own merge costs at start, so two pods may merge
    # a layer the other runs as a branch, and the pictures then differ by float rounding.)
    for ip in ips.values():
        status, body = http_json(
            f"http://{ip}:8000/v1/load_lora_adapter",
            {"lora_name": "direct", "lora_path": f"{cluster.POD_VOLUME}/{ns}/src/a"},
            token=TOKEN,
        )
        assert status == 200, body
        reference = generate(f"http://{ip}:8000", "direct")
        assert not np.array_equal(reference, generate(f"http://{ip}:8000", MODEL_NAME))
        assert np.array_equal(generate(f"http://{ip}:8000", "pixel"), reference), ip
    # One Event per transition, summarising the pods; a healthy Degraded=False says why.
    # (The pods may have become Ready one after the other: the Event announces Ready once, with
    # the pods that were Ready then; more pods joining is not a new transition.)
    notes = cluster.event_notes(h, ns, "pixel")
    (ready,) = notes.get("Ready", [])
    assert re.fullmatch(rf"Loaded on ([12])/\1 pods \(revision {sha_a[:12]}\)", ready), ready
    assert sum(len(v) for v in notes.values()) <= 2, notes
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["message"]

    # Scale 2 -> 3: the new pod gets the adapter.
    phase("scale 2 -> 3")
    h.kubectl("scale", "-n", ns, "deployment/inference", "--replicas=3")
    cluster.wait_phase(h, ns, "pixel", "Ready", "3/3", timeout=240)
    ips = cluster.pod_ips(h, ns, 3)
    assert all(cluster.holds(ip, "pixel", sha_a) for ip in ips.values())

    # Kill one server process: the container restarts empty and gets the adapter back.
    phase("a killed server process gets the adapter back")
    victim = release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)[0]
    (pid,) = h.container_pids(victim["metadata"]["uid"], "server")
    os.kill(pid, signal.SIGKILL)
    h.wait_for(
        "the killed container to restart and get the adapter back",
        lambda: any(
            p["metadata"]["uid"] == victim["metadata"]["uid"]
            and p["status"]["containerStatuses"][0]["restartCount"] >= 1
            and cluster.holds(p["status"]["podIP"], "pixel", sha_a)
            for p in release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)
        ),
        timeout=180,
    )

    # Delete a pod: its replacement has the adapter.
    phase("a deleted pod's replacement gets the adapter")
    pods = release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)
    gone = pods[1]["metadata"]["name"]
    h.kubectl("delete", "pod", "-n", ns, gone, "--wait=false")
    h.wait_for(
        "the replacement pod to hold the adapter",
        lambda: (
            all(
                cluster.holds(ip, "pixel", sha_a)
                for name, ip in cluster.pod_ips(h, ns, 3).items()
                if name != gone
            )
            and gone not in cluster.pod_ips(h, ns, 3)
        ),
        timeout=240,
    )
    cluster.wait_phase(h, ns, "pixel", "Ready", "3/3", timeout=120)

    # Update the source: every pod moves to the new revision while requests keep succeeding.
    phase("a source update rolls out under load")
    ips = cluster.pod_ips(h, ns, 3)
    failures: list[str] = []
    served = [0]
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            for ip in ips.values():
                status, body = http_json(
                    f"http://{ip}:8000/v1/images/generations",
                    {**GENERATION, "model": "pixel"},
                )
                if status != 200:
                    failures.append(f"{ip}: {status} {body}")
                served[0] += 1

    thread = threading.Thread(target=hammer, daemon=True)
    thread.start()
    try:
        h.wait_for("requests before the update", lambda: served[0] >= len(ips), timeout=60)
        h.kubectl(
            "patch", "loraadapter", "pixel", "-n", ns, "--type=merge",
            "-p", f'{{"spec": {{"source": {{"uri": "{src_b}"}}}}}}',
        )  # fmt: skip
        h.wait_for(
            "every pod to serve the new revision",
            lambda: all(cluster.holds(ip, "pixel", sha_b) for ip in ips.values()),
            timeout=180,
        )
        # (Status writes are paced: the pods may serve the new revision a moment before the
        # status says so.)
        release.wait_adapter_ready(h, ns, "pixel", "3/3", timeout=60, sha256=sha_b)
        after = served[0]
        h.wait_for("requests after the update", lambda: served[0] >= after + len(ips), 60)
    finally:
        stop.set()
        thread.join(120)
    assert failures == [], failures[:3]
    phase("the old revision collected")
    h.wait_for(
        "the old revision to be collected",
        lambda: cluster.revisions(volume, ns, "pixel") == [sha_b],
        timeout=60,
    )

    # Delete: unloaded everywhere, files gone, finalizer released; a hand-loaded adapter stays.
    phase("deletion")
    some_ip = next(iter(ips.values()))
    status, body = http_json(
        f"http://{some_ip}:8000/v1/load_lora_adapter",
        {"lora_name": "manual", "lora_path": f"{cluster.POD_VOLUME}/{ns}/src/b"},
        token=TOKEN,
    )
    assert status == 200, body
    h.kubectl("delete", "loraadapter", "pixel", "-n", ns, "--wait=false")
    h.wait_for(
        "the adapter object to be gone", lambda: cluster.get_adapter(h, ns, "pixel") is None, 90
    )
    assert not any("pixel" in cluster.models(ip) for ip in ips.values())
    assert "manual" in cluster.models(some_ip)
    h.wait_for(
        "the adapter's files to be collected",
        lambda: (
            not (volume / ns / "pixel").exists()
            and not any((volume / ".objects" / "sha256").glob(f"{sha_a}*"))
        ),
        timeout=30,
    )
    metrics = operator.metrics()
    assert 'lora_operator_pod_loads_total{result="ok"}' in metrics


def test_deletion_unpublishes_first_so_no_pod_resolves_an_adapter_being_deleted(
    devcluster: Harness,
    devcluster_namespace: str,
    operator: Operator,
    volume: Path,
    models: Models,
    phase: Phase,
) -> None:
    h, ns = devcluster, devcluster_namespace
    phase("two adapters Ready, the bystander resolving what is published")
    src, _ = cluster.write_adapter(models, volume / ns / "src" / "a", seed=1)
    other, _ = cluster.write_adapter(models, volume / ns / "src" / "b", seed=2)
    # The target has no readiness probe: stopped, it stays Ready, so its unload hangs and the
    # deletion is stuck. The bystander shares the volume but the operator does not watch it:
    # it can only find adapters through its resolver.
    h.apply(
        cluster.inference_deployment(
            h.image("inference"), "inference", 1, models.root, volume, readiness=False
        ),
        ns,
    )
    h.apply(
        cluster.inference_deployment(
            h.image("inference"), "bystander", 1, models.root, volume, watched=False
        ),
        ns,
    )
    selector = {"matchLabels": {"app": "inference"}}
    h.apply(cluster.adapter("pixel", str(src), selector=selector), ns)
    h.apply(cluster.adapter("other", str(other), selector=selector), ns)
    cluster.wait_phase(h, ns, "pixel", "Ready", "1/1", timeout=240)
    cluster.wait_phase(h, ns, "other", "Ready", "1/1", timeout=60)
    (bystander,) = release.ready_pods(h, ns, "app=bystander", 1, timeout=240, all_ready=False)
    bystander_url = f"http://{bystander['status']['podIP']}:8000"
    generate(bystander_url, "other")  # the resolver serves what is published

    phase("a deletion stuck on a stopped pod has already unpublished")
    (target,) = release.ready_pods(h, ns, "app=inference", 1, timeout=180, all_ready=False)
    (pid,) = h.container_pids(target["metadata"]["uid"], "server")
    os.kill(pid, signal.SIGSTOP)
    try:
        h.kubectl("delete", "loraadapter", "pixel", "-n", ns, "--wait=false")
        h.wait_for(
            "pixel's current pointer to go",
            lambda: not os.path.lexists(volume / ns / "pixel" / "current"),
            timeout=60,
        )
        stuck = cluster.get_adapter(h, ns, "pixel")
        assert stuck is not None and stuck["metadata"].get("deletionTimestamp")
        status, body = http_json(
            f"{bystander_url}/v1/images/generations", {**GENERATION, "model": "pixel"}
        )
        assert status == 404, body
    finally:
        os.kill(pid, signal.SIGCONT)
    phase("the resumed pod unloads it and the deletion finishes")
    h.wait_for(
        "the adapter object to be gone", lambda: cluster.get_adapter(h, ns, "pixel") is None, 180
    )
    assert "pixel" not in cluster.models(target["status"]["podIP"])
    assert "other" in cluster.models(target["status"]["podIP"])


def test_two_base_models_each_adapter_lands_on_the_pods_of_its_model(
    devcluster: Harness, devcluster_namespace: str, operator: Operator, volume: Path, models: Models
) -> None:
    """The documented pattern for a second base model: a second Deployment of the same pod
    contract serving another model; each adapter goes to the pods serving its `baseModel`."""
    h, ns = devcluster, devcluster_namespace
    other = "tiny-sd15-other"
    write_tiny_model(models.root / other, "sd15", seed=1)
    cluster.readable_by_pods(models.root)
    for name, model in (("inference", MODEL_NAME), ("inference-other", other)):
        h.apply(
            cluster.inference_deployment(
                h.image("inference"), name, 1, models.root, volume, model=model
            ),
            ns,
        )
    src, _ = cluster.write_adapter(models, volume / ns / "src" / "mine", seed=1)
    theirs = write_random_adapter(
        volume / ns / "src" / "theirs", models.pipe, base_model=other, seed=2
    )
    cluster.readable_by_pods(theirs)
    h.apply(cluster.adapter("mine", str(src)), ns)
    h.apply(cluster.adapter("theirs", str(theirs), baseModel=other), ns)
    cluster.wait_phase(h, ns, "mine", "Ready", "1/1", timeout=240)
    cluster.wait_phase(h, ns, "theirs", "Ready", "1/1", timeout=240)
    (pod,) = release.ready_pods(h, ns, "app=inference", 1, timeout=180, all_ready=False)
    (other_pod,) = release.ready_pods(h, ns, "app=inference-other", 1, timeout=180, all_ready=False)
    served = cluster.models(pod["status"]["podIP"])
    served_other = cluster.models(other_pod["status"]["podIP"])
    assert "mine" in served and "theirs" not in served, served
    assert "theirs" in served_other and "mine" not in served_other, served_other
    assert MODEL_NAME in served and other in served_other


def test_a_composition_serves_the_sum_follows_its_members_and_degrades_without_one(
    devcluster: Harness,
    devcluster_namespace: str,
    operator: Operator,
    volume: Path,
    models: Models,
    phase: Phase,
) -> None:
    h, ns = devcluster, devcluster_namespace
    phase("the composition and its members Ready on the pod")
    a, _ = cluster.write_adapter(models, volume / ns / "src" / "a", seed=1)
    b, _ = cluster.write_adapter(models, volume / ns / "src" / "b", seed=2)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 1, models.root, volume), ns
    )
    compose = [{"name": "b", "scale": 0.5}, {"name": "a", "scale": 0.7}]
    duo = {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": "duo"},
        "spec": {"baseModel": MODEL_NAME, "compose": compose},
    }
    h.apply(duo, ns)  # before its members: it waits for them
    h.apply(cluster.adapter("a", str(a)), ns)
    h.apply(cluster.adapter("b", str(b)), ns)
    first = cluster.wait_phase(h, ns, "duo", "Ready", "1/1", timeout=240)["status"]["staged"]
    (pod,) = release.ready_pods(h, ns, "app=inference", 1, timeout=180, all_ready=False)
    url = f"http://{pod['status']['podIP']}:8000"
    # Clients name it; it draws what the same stack asked for in a request draws.
    assert np.array_equal(generate(url, "duo"), generate(url, None, lora=compose))

    phase("one member with block weights: a block-weighted variant under its own name")
    weighted = [{"name": "a", "scale": 0.7, "blocks": {"down": 0.5, "up": 0}}]
    variant = {
        **duo,
        "metadata": {"name": "a-blocks"},
        "spec": {"baseModel": MODEL_NAME, "compose": weighted},
    }
    h.apply(variant, ns)
    cluster.wait_phase(h, ns, "a-blocks", "Ready", "1/1", timeout=120)
    drawn = generate(url, "a-blocks")
    assert np.array_equal(drawn, generate(url, None, lora=weighted[0]))
    assert not np.array_equal(drawn, generate(url, None, lora={"name": "a", "scale": 0.7}))
    h.kubectl("delete", "loraadapter", "a-blocks", "-n", ns, "--timeout=90s")

    phase("a member's new revision makes a new composition, loaded in place")
    a2, _ = cluster.write_adapter(models, volume / ns / "src" / "a2", seed=3)
    h.apply(cluster.adapter("a", str(a2)), ns)

    def recomposed() -> bool:
        st = (cluster.get_adapter(h, ns, "duo") or {}).get("status") or {}
        return st.get("phase") == "Ready" and st["staged"]["sha256"] != first["sha256"]

    h.wait_for("duo staged again and Ready", recomposed, timeout=180)
    cluster.wait_phase(h, ns, "a", "Ready", "1/1", timeout=60)
    assert np.array_equal(generate(url, "duo"), generate(url, None, lora=compose))

    phase("a member deleted: Degraded with the reason, still served")
    h.kubectl("delete", "loraadapter", "b", "-n", ns, "--timeout=90s")
    st = cluster.wait_phase(h, ns, "duo", "Degraded", timeout=60)["status"]
    degraded = next(c for c in st["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "MemberMissing" and "'b'" in degraded["message"], degraded
    assert "MemberMissing" in cluster.event_notes(h, ns, "duo", "Warning")
    generate(url, "duo")
