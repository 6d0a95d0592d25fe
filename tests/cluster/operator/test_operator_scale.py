"""The operator on the local cluster with hundreds of adapters when its own side fails: the
active replica killed mid-apply (a standby takes over through kopf's peering), and the API
server restarted mid-apply. Real API server, real inference pods, the operator as real
processes; every adapter must end Ready, no status may ever go backwards, and no pod may load
an adapter twice. And an operator restarted with everything Ready resumes from the pods and the
statuses: no call to a pod, no write to an object, no Event.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import time
from pathlib import Path

from lora_demo import release
from lora_devcluster.harness import Harness

from tests.support import cluster
from tests.support.cluster import Models, Operator, StatusRecorder
from tests.support.phases import Phase

K = 200
PEERING = "lora-operator-test"


def loaded_once_on_every_pod(h: Harness, ns: str, names: list[str]) -> None:
    """Each pod's server registered each adapter exactly once: never twice, so never twice at
    the same time either."""
    for pod in cluster.pod_ips(h, ns, 2):
        counts = cluster.registrations(h, ns, pod)
        twice = {n: c for n, c in counts.items() if n in names and c != 1}
        assert twice == {}, f"{pod} registered these more than once: {twice}"
        assert set(names) <= set(counts), f"{pod} never registered {set(names) - set(counts)}"


def peers(h: Harness, ns: str) -> dict[str, object]:
    """The replicas the peering object lists (kopf writes each one's priority and liveness)."""
    obj = json.loads(h.kubectl("get", "-n", ns, "kopfpeering", PEERING, "-o", "json"))
    return dict(obj.get("status") or {})


def test_a_standby_takes_over_when_the_active_replica_dies_mid_apply(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    tmp_path: Path,
    phase: Phase,
) -> None:
    h, ns = crd, devcluster_namespace
    phase("peering, adapters and pods")
    cluster.peering_crds(h)
    h.apply({"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": PEERING}}, ns)
    names = cluster.adapter_names("a", K)
    manifests = cluster.many_adapters(models, volume, ns, names)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 2, models.root, volume), ns
    )
    release.ready_pods(h, ns, "app=inference", 2, timeout=300, all_ready=False)

    def replica(name: str) -> Operator:
        return Operator(
            volume=volume, namespaces=[ns], log_path=tmp_path / f"{name}.log", peering=PEERING
        )

    first, second = replica("first"), replica("second")
    # The replicas start one after the other, as a rollout or a restart starts them: the older
    # one acts. (Started at the same instant, either may be the older.)
    with first.running(), contextlib.ExitStack() as later:
        phase("the first replica acts, the second stands by")
        h.wait_for("the first replica to act", lambda: "action=activate" in first.log(), 120)
        h.wait_for("the first replica's entry in the peering object", lambda: peers(h, ns), 60)
        later.enter_context(second.running())
        # Started second, it is the standby: it neither acts nor cleans the shared .tmp/.
        h.wait_for(
            "the second replica to stand by",
            lambda: "action=peering active=False" in second.log(),
            timeout=120,
        )
        in_progress = volume / ".tmp" / "download-of-the-active-replica.part"
        in_progress.parent.mkdir(exist_ok=True)
        in_progress.write_bytes(b"a download in progress")
        with StatusRecorder(h, ns) as recorder:
            phase(f"the active replica killed mid-apply of {K} adapters, the standby takes over")
            h.apply(manifests, ns)
            h.wait_for(
                "the first replica to be mid-apply",
                lambda: first.log().count("action=load ") >= K // 2,
                timeout=300,
            )
            assert in_progress.exists()
            assert "action=load " not in second.log() and "action=activate" not in second.log()
            first.kill()
            killed = datetime.datetime.now()
            # The first may have written most statuses already: wait for the takeover itself.
            h.wait_for(
                "the standby to take over",
                lambda: "action=activate" in second.log(),
                timeout=120,
            )
            h.wait_for(
                f"all {K} adapters Ready 2/2 after the takeover",
                lambda: cluster.adapters_ready(h, ns, names, "2/2"),
                timeout=600,
            )
        phase("after the takeover: nothing backwards, each adapter loaded once per pod")
        (activated,) = cluster.log_times(second.log(), "action=activate")
        print(f"takeover: {(activated - killed).total_seconds():.1f} s from the kill to acting")
        assert not in_progress.exists()  # cleaned by the replica that acts now
        assert recorder.backwards() == {}
        assert len(recorder.seen) == K
        loaded_once_on_every_pod(h, ns, names)
        assert 'lora_operator_pod_loads_total{result="permanent"}' not in second.metrics()


def test_an_api_server_restart_mid_apply_loses_nothing(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    tmp_path: Path,
    phase: Phase,
) -> None:
    h, ns = crd, devcluster_namespace
    phase("adapters and pods")
    names = cluster.adapter_names("a", K)
    later = cluster.adapter_names("late", 20)
    manifests = cluster.many_adapters(models, volume, ns, names + later)
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 2, models.root, volume), ns
    )
    release.ready_pods(h, ns, "app=inference", 2, timeout=300, all_ready=False)
    op = Operator(volume=volume, namespaces=[ns], log_path=tmp_path / "op.log")
    with op.running(), StatusRecorder(h, ns) as recorder:
        phase(f"the API server restarted mid-apply of {K} adapters")
        h.apply(manifests[:K], ns)
        h.wait_for(
            "the operator to be mid-apply",
            lambda: op.log().count("action=load ") >= K // 2,
            timeout=300,
        )
        h.restart_apiserver()
        # Only re-established watches see these.
        h.apply(manifests[K:], ns)
        h.wait_for(
            f"all {K + 20} adapters Ready 2/2",
            lambda: cluster.adapters_ready(h, ns, names + later, "2/2"),
            timeout=600,
        )
        assert op.proc is not None and op.proc.poll() is None
    phase("after the restart: nothing backwards, each adapter loaded once per pod")
    assert recorder.backwards() == {}
    loaded_once_on_every_pod(h, ns, names + later)


def test_a_restarted_operator_resumes_from_the_pods_without_a_call_a_write_or_an_event(
    crd: Harness,
    devcluster_namespace: str,
    volume: Path,
    models: Models,
    tmp_path: Path,
    phase: Phase,
) -> None:
    h, ns = crd, devcluster_namespace
    k = 40
    phase(f"{k} adapters Ready on 2 pods, half of them placed")
    names = cluster.adapter_names("r", k)
    manifests = cluster.many_adapters(models, volume, ns, names)
    for doc in manifests[::2]:
        doc["spec"]["replicas"] = 1
    h.apply(
        cluster.inference_deployment(h.image("inference"), "inference", 2, models.root, volume), ns
    )
    pods = [p["metadata"]["name"] for p in release.ready_pods(h, ns, "app=inference", 2, 300)]
    op = Operator(volume=volume, namespaces=[ns], log_path=tmp_path / "op.log")
    with op.running():
        h.apply(manifests, ns)
        h.wait_for(
            "every adapter Ready",
            lambda: all(
                cluster.adapters_ready(h, ns, names[i::2], ready)
                for i, ready in ((0, "1/1"), (1, "2/2"))
            ),
            timeout=300,
        )

        def objects() -> dict[str, str]:
            items = h.get(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters")["items"]
            return {i["metadata"]["name"]: i["metadata"]["resourceVersion"] for i in items}

        def events() -> int:
            return len(h.get(f"/apis/events.k8s.io/v1/namespaces/{ns}/events")["items"])

        last: dict[str, str] = {}

        def unchanged() -> bool:
            """No object changed since the last look (progress writes come at most every 10 s
            after a phase's)."""
            nonlocal last
            now = objects()
            same, last = now == last, now
            return same

        h.wait_for("no object written for 12 s", unchanged, timeout=120, interval=12)
        seen, posted = objects(), events()
        registered = {p: cluster.registrations(h, ns, p) for p in pods}

        phase("the operator restarted: it reads the pods and the statuses, and changes nothing")
        op.stop()
        offset = len(op.log())
        op.start()

        def all_ready_counted() -> bool:
            try:
                text = op.metrics()
            except OSError:
                return False
            return f'lora_operator_adapters{{phase="Ready"}} {float(k)}' in text

        h.wait_for("the new process to count every adapter Ready", all_ready_counted, 120)
        time.sleep(12)  # two resyncs of every pod (--resync-seconds 5)
        after = op.log()[offset:]
        assert "action=load" not in after and "action=unload" not in after
        assert objects() == seen  # no status written, no finalizer patched
        assert events() == posted
        assert {p: cluster.registrations(h, ns, p) for p in pods} == registered
