"""Placement on the local cluster: adapters with spec.replicas and spec.autoscale on real
inference pods (tiny SD 1.5 in the project's image), the operator as a real process. The pods'
own request counters drive autoscaling: the test sends real generations to the placed pods.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from lora_demo import release
from lora_devcluster.harness import Harness

from tests.support import cluster
from tests.support.cluster import Models, Operator
from tests.support.http import GENERATION, http_json


def holders(h: Harness, ns: str, name: str, n: int) -> set[str]:
    """The inference pods whose /v1/models lists the adapter."""
    return {pod for pod, ip in cluster.pod_ips(h, ns, n).items() if name in cluster.models(ip)}


def status(h: Harness, ns: str, name: str) -> dict[str, Any]:
    return dict(((cluster.get_adapter(h, ns, name) or {}).get("status")) or {})


def test_replicas_place_on_a_subset_and_a_deleted_pod_is_replaced(
    devcluster: Harness, devcluster_namespace: str, operator: Operator, volume: Path, models: Models
) -> None:
    h, ns = devcluster, devcluster_namespace
    src, sha = cluster.write_adapter(models, volume / ns / "src" / "a", seed=1)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 3, models.root, volume), ns
    )
    # All three pods first: a pod becoming Ready later takes placements (as it should), which
    # would move the adapter after the status below was read.
    release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)
    h.apply(cluster.adapter("pixel", str(src), replicas=2), ns)
    st = cluster.wait_phase(h, ns, "pixel", "Ready", "2/2", timeout=240)["status"]
    placed = set(st["placedPods"])
    assert len(placed) == 2 and st["replicas"] == 2
    h.wait_for("exactly the placed pods to hold it", lambda: holders(h, ns, "pixel", 3) == placed)
    printed = h.kubectl("get", "lora", "-n", ns, "pixel", "--no-headers")
    assert " 2/2 " in f" {printed} ", printed

    # A placed pod deleted: the adapter goes to the pod left over, before its replacement is up.
    gone = sorted(placed)[0]
    h.kubectl("delete", "pod", "-n", ns, gone, "--wait=false")
    st = h.wait_for(
        "the adapter re-placed",
        lambda: (
            (s := status(h, ns, "pixel")).get("ready") == "2/2"
            and gone not in s.get("placedPods", [gone])
            and s
        ),
        timeout=180,
    )
    assert len(st["placedPods"]) == 2
    # The Deployment's replacement pod then joins and may take the placement (a joining pod
    # takes its share): once it is Ready, the placed pods and the holders agree again.
    release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)

    def settled() -> bool:
        now = status(h, ns, "pixel")
        placed_now = set(now.get("placedPods") or ())
        return (
            now.get("ready") == "2/2"
            and len(placed_now) == 2
            and gone not in placed_now
            and holders(h, ns, "pixel", 3) == placed_now
        )

    h.wait_for("the placed pods, and only they, to hold it", settled, timeout=120)
    ips = cluster.pod_ips(h, ns, 3)
    assert all(cluster.holds(ips[p], "pixel", sha) for p in status(h, ns, "pixel")["placedPods"])


def test_autoscale_widens_a_hot_adapter_and_narrows_it_when_it_cools(
    devcluster: Harness, devcluster_namespace: str, volume: Path, models: Models, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    op = Operator(
        volume=volume,
        namespaces=[ns],
        log_path=tmp_path / "op.log",
        extra=["--autoscale-interval-seconds", "1"],
    )
    src, _ = cluster.write_adapter(models, volume / ns / "src" / "a", seed=1)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 3, models.root, volume), ns
    )
    autoscale = {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetRequestsPerSecond": 0.5,
        "scaleDownDelaySeconds": 5,
    }
    release.ready_pods(h, ns, "app=inference", 3, timeout=180, all_ready=False)
    with op.running():
        h.apply(cluster.adapter("hot", str(src), autoscale=autoscale), ns)
        st = cluster.wait_phase(h, ns, "hot", "Ready", "1/1", timeout=240)["status"]
        assert st["replicas"] == 1 and len(st["placedPods"]) == 1

        # Hot: clients keep sending to the pods it is placed on (as a router would), far above
        # 0.5 requests/s for one pod.
        stop = threading.Event()
        errors: list[str] = []

        def client() -> None:
            while not stop.is_set():
                placed = status(h, ns, "hot").get("placedPods") or []
                ips = cluster.pod_ips(h, ns, 3)
                for pod in placed:
                    code, body = http_json(
                        f"http://{ips[pod]}:8000/v1/images/generations",
                        {**GENERATION, "model": "hot"},
                    )
                    if code != 200:
                        errors.append(f"{pod}: {code} {body}")

        threads = [threading.Thread(target=client) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            cluster.wait_phase(h, ns, "hot", "Ready", "3/3", timeout=240)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert status(h, ns, "hot")["replicas"] == 3
        assert len(holders(h, ns, "hot", 3)) == 3
        # A pod that has just been given the adapter can answer 404 before its load lands; any
        # other failure is a bug.
        assert all(" 404 " in e for e in errors), errors[:3]

        # Cool: no requests; after scaleDownDelaySeconds of a low rate it narrows to the minimum.
        cluster.wait_phase(h, ns, "hot", "Ready", "1/1", timeout=120)
        assert status(h, ns, "hot")["replicas"] == 1
        h.wait_for("two pods to unload it", lambda: len(holders(h, ns, "hot", 3)) == 1)
        scaled = cluster.event_notes(h, ns, "hot").get("Scaled", [])
        assert any(n.endswith("-> 3") for n in scaled) and scaled[-1].endswith("-> 1"), scaled
