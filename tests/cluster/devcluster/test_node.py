"""The local cluster's node against what a user's cluster does: real containers from this
project's images, restarts, probes, logs, exec, port-forward, Services and DNS, volumes from the
default StorageClass, limits in the cgroup, a read-only root filesystem, service-account tokens.
Everything the operator's and the chart's tests believe rests on these."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from lora_demo import release
from lora_devcluster.harness import Harness

from tests.support.http import free_port, http_json

Obj = dict[str, Any]
PORT = 8080


def web(h: Harness, name: str, replicas: int = 1, **container: Any) -> Obj:
    """A Deployment of a static web server in the operator image, as the chart runs its pods:
    non-root, read-only root filesystem, no privileges."""
    spec: Obj = {
        "name": "web",
        "image": h.image("operator"),
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "http.server", str(PORT), "--directory", "/etc"],
        "ports": [{"name": "http", "containerPort": PORT}],
        "readinessProbe": {"httpGet": {"path": "/", "port": "http"}, "periodSeconds": 1},
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    spec.update(container)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {"terminationGracePeriodSeconds": 2, "containers": [spec]},
            },
        },
    }


def service(name: str) -> Obj:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"selector": {"app": name}, "ports": [{"port": 80, "targetPort": PORT}]},
    }


def container_status(h: Harness, ns: str, pod: str) -> Obj:
    statuses = h.get(f"/api/v1/namespaces/{ns}/pods/{pod}")["status"].get("containerStatuses")
    return dict(statuses[0]) if statuses else {}


def exec_python(h: Harness, ns: str, pod: str, code: str) -> str:
    return h.kubectl("exec", "-n", ns, pod, "--", "python", "-c", code)


def test_deployment_behind_a_service_reached_by_clusterip_and_dns(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply([web(h, "web", replicas=2), service("web")], ns)
    pods = release.ready_pods(h, ns, "app=web", 2, timeout=90)
    ips = sorted(p["status"]["podIP"] for p in pods)
    assert len(set(ips)) == 2 and all(ip.startswith("10.244.0.") for ip in ips)
    assert {p["spec"]["nodeName"] for p in pods} == {"lora-devcluster"}  # the scheduler bound them

    def slice_ips() -> list[str] | None:
        path = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
        found = sorted(
            a
            for s in h.get(f"{path}?labelSelector=kubernetes.io/service-name%3Dweb")["items"]
            for e in s.get("endpoints") or ()
            if (e.get("conditions") or {}).get("ready")
            for a in e["addresses"]
        )
        return found if found == ips else None

    h.wait_for("both pods in the Service's EndpointSlice", slice_ips)
    cluster_ip = h.get(f"/api/v1/namespaces/{ns}/services/web")["spec"]["clusterIP"]
    # From the test process (in the node's network): kube-proxy's rules route the ClusterIP.
    h.wait_for(
        "the ClusterIP to route",
        lambda: http_json(f"http://{cluster_ip}/hostname", timeout=5)[0] == 200,
    )
    # From a pod: CoreDNS resolves the Service's name to its ClusterIP, which routes.
    name = f"web.{ns}.svc.cluster.local"
    code = (
        "import socket, urllib.request;"
        f"print(socket.gethostbyname('{name}'));"
        f"print(urllib.request.urlopen('http://{name}/hostname', timeout=5).status);"
        "print(urllib.request.urlopen('http://web/hostname', timeout=5).status)"  # search path
    )
    out = exec_python(h, ns, pods[0]["metadata"]["name"], code).split()
    assert out == [cluster_ip, "200", "200"]


def test_killed_container_restarts_in_the_same_pod_and_logs_keep_the_previous_run(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    script = 'echo "run $(date +%s%N)"; exec python -m http.server 8080 --directory /etc'
    h.apply(web(h, "kill", command=["sh", "-c", script]), ns)
    (pod,) = release.ready_pods(h, ns, "app=kill", 1, timeout=90)
    name, uid, ip = pod["metadata"]["name"], pod["metadata"]["uid"], pod["status"]["podIP"]

    def first_line() -> str:
        return h.kubectl("logs", "-n", ns, name).partition("\n")[0]

    first = h.wait_for("the first run's line", first_line)
    (pid,) = h.container_pids(uid, "web")
    os.kill(pid, signal.SIGKILL)

    def restarted() -> Obj | None:
        p = h.get(f"/api/v1/namespaces/{ns}/pods/{name}")
        cs = p["status"]["containerStatuses"][0]
        return p if cs["restartCount"] == 1 and release.is_ready(p) else None

    after = h.wait_for("the container to restart", restarted, timeout=60)
    cs = after["status"]["containerStatuses"][0]
    assert cs["lastState"]["terminated"]["exitCode"] == 137
    assert after["status"]["podIP"] == ip and after["metadata"]["uid"] == uid
    assert h.container_pids(uid, "web") not in ([], [pid])
    assert h.kubectl("logs", "-n", ns, name, "--previous").partition("\n")[0] == first
    current = h.wait_for("the new run's line", first_line)
    assert current.startswith("run ") and current != first
    assert "run " in h.container_logs(ns)  # what failure reports show

    # Deleting the namespace's pods ends their processes.
    h.kubectl("delete", "pod", "-n", ns, name, "--wait=true", "--timeout=60s")
    h.wait_for("the old pod's processes to end", lambda: h.container_pids(uid) == [])


def test_liveness_and_readiness_probes(devcluster: Harness, devcluster_namespace: str) -> None:
    h, ns = devcluster, devcluster_namespace
    # Ready only once a file exists on its emptyDir (an exec probe, in the container's mounts);
    # alive only while another exists (liveness: the kubelet restarts it when it goes).
    script = "touch /state/alive; exec python -m http.server 8080 --directory /etc"
    deployment = web(
        h,
        "probed",
        command=["sh", "-c", script],
        volumeMounts=[{"name": "state", "mountPath": "/state"}],
        readinessProbe={"exec": {"command": ["test", "-e", "/state/ready"]}, "periodSeconds": 1},
        livenessProbe={
            "exec": {"command": ["test", "-e", "/state/alive"]},
            "periodSeconds": 1,
            "failureThreshold": 2,
        },
    )
    deployment["spec"]["template"]["spec"]["volumes"] = [{"name": "state", "emptyDir": {}}]
    h.apply(deployment, ns)
    pod = h.wait_for("the pod to run", lambda: next(iter(h.pods(ns, "app=probed")), None))
    name = pod["metadata"]["name"]
    h.wait_for("the container to start", lambda: container_status(h, ns, name).get("started"))
    time.sleep(3)
    assert not release.is_ready(h.get(f"/api/v1/namespaces/{ns}/pods/{name}"))  # readiness holds it
    h.kubectl("exec", "-n", ns, name, "--", "touch", "/state/ready")
    release.ready_pods(h, ns, "app=probed", 1, timeout=90)
    h.kubectl("exec", "-n", ns, name, "--", "rm", "/state/alive")
    h.wait_for(
        "the liveness probe to restart the container",
        lambda: container_status(h, ns, name)["restartCount"] >= 1,
        timeout=60,
    )
    # The emptyDir outlived the restart (same pod), and the new run is alive again.
    release.ready_pods(h, ns, "app=probed", 1, timeout=90)


def test_exec_and_port_forward(devcluster: Harness, devcluster_namespace: str) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(web(h, "pf"), ns)
    (pod,) = release.ready_pods(h, ns, "app=pf", 1, timeout=90)
    name = pod["metadata"]["name"]
    assert h.kubectl("exec", "-n", ns, name, "--", "id", "-u").strip() == "65532"
    # stdin goes through too (`kubectl exec -i`).
    assert h.kubectl("exec", "-i", "-n", ns, name, "--", "cat", input="piped\n") == "piped\n"
    local = free_port()
    forward = subprocess.Popen(
        ["kubectl", "port-forward", "-n", ns, f"pod/{name}", f"{local}:{PORT}"],
        env=h.cluster.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        answered = h.wait_for(
            "the port-forward to answer 200",
            lambda: http_json(f"http://127.0.0.1:{local}/hostname", timeout=5)[0] == 200,
            timeout=30,
        )
        assert answered
    finally:
        forward.terminate()
        forward.wait(10)


def test_claims_from_the_default_storage_class_are_shared_and_writable_by_non_root(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    claim = {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "shared"},
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
    }
    deployment = web(h, "vol", replicas=2, volumeMounts=[{"name": "v", "mountPath": "/data"}])
    deployment["spec"]["template"]["spec"]["volumes"] = [
        {"name": "v", "persistentVolumeClaim": {"claimName": "shared"}}
    ]
    h.apply([claim, deployment], ns)
    first, second = release.ready_pods(h, ns, "app=vol", 2, timeout=90)
    pvc = h.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/shared")
    assert pvc["status"]["phase"] == "Bound"
    assert pvc["spec"]["storageClassName"] == "standard"  # the default class, unasked
    h.kubectl("exec", "-n", ns, first["metadata"]["name"], "--", "sh", "-c", "echo hi > /data/f")
    out = h.kubectl("exec", "-n", ns, second["metadata"]["name"], "--", "cat", "/data/f")
    assert out == "hi\n"
    # The volume lives in the cluster's directory, where the host can reach it too.
    pv = h.get(f"/api/v1/persistentvolumes/{pvc['spec']['volumeName']}")
    host_dir = Path(pv["spec"]["hostPath"]["path"])
    assert h.cluster.dir in host_dir.parents
    assert (host_dir / "f").read_text() == "hi\n"


def test_limits_are_enforced_in_the_pod_cgroup(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    limits = {"memory": "64Mi", "cpu": "250m"}
    h.apply(web(h, "limited", resources={"limits": limits, "requests": limits}), ns)
    (pod,) = release.ready_pods(h, ns, "app=limited", 1, timeout=90)
    uid = pod["metadata"]["uid"]
    assert pod["status"]["qosClass"] == "Guaranteed"
    (pid,) = h.container_pids(uid, "web")
    memory = next(
        line.split(":", 2)[2]
        for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines()
        if line.split(":")[1] == "memory"
    )
    root = Path("/sys/fs/cgroup/memory") / memory.lstrip("/")
    assert int((root / "memory.limit_in_bytes").read_text()) == 64 * 2**20
    assert h.cluster.layout.cgroup_root in memory  # under the cluster's own cgroup root
    cpu_quota = Path(str(root).replace("/memory/", "/cpu/")) / "cpu.cfs_quota_us"
    assert int(cpu_quota.read_text()) == 25000  # 250m of a 100 ms period
    # Past the limit the kernel kills the container, and the kubelet says why.
    hog = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "hog"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "hog",
                    "image": h.image("operator"),
                    "imagePullPolicy": "Never",
                    "command": [
                        "python",
                        "-c",
                        "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096])",
                    ],
                    "resources": {"limits": {"memory": "64Mi"}},
                }
            ],
        },
    }
    h.apply(hog, ns)
    h.wait_for(
        "the OOM kill to be reported",
        lambda: (
            (container_status(h, ns, "hog").get("state") or {}).get("terminated", {}).get("reason")
            == "OOMKilled"
        ),
        timeout=60,
    )


def test_read_only_root_filesystem_and_non_root_user(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(web(h, "ro"), ns)
    (pod,) = release.ready_pods(h, ns, "app=ro", 1, timeout=90)
    out = exec_python(
        h,
        ns,
        pod["metadata"]["name"],
        "import os\n"
        "try:\n    open('/opt/x', 'w')\nexcept OSError as e:\n    print(e.strerror)\n"
        "print(os.getuid())",
    )
    assert out.split("\n")[:2] == ["Read-only file system", "65532"]


def test_pods_reach_the_api_server_with_their_service_account(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(web(h, "sa"), ns)
    (pod,) = release.ready_pods(h, ns, "app=sa", 1, timeout=90)
    code = """
import json, os, ssl, urllib.error, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
api = "https://kubernetes.default.svc"
token = open(f"{sa}/token").read()
def call(path, body=None):
    req = urllib.request.Request(api + path, data=body and json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code
review = call("/apis/authentication.k8s.io/v1/selfsubjectreviews",
    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
print(review["status"]["userInfo"]["username"])
print(call(f"/api/v1/namespaces/{open(sa + '/namespace').read()}/secrets"))
"""
    out = exec_python(h, ns, pod["metadata"]["name"], code).split()
    # Authenticated as the pod's service account through the `kubernetes` Service; RBAC grants
    # it nothing.
    assert out == [f"system:serviceaccount:{ns}:default", "403"]


def test_threads_and_event_loops_started_by_a_test_reach_pods_and_the_api(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    # kopf.testing.KopfRunner runs the operator in a thread with its own event loop: both must
    # see the cluster's network namespace, which this process joined before starting them.
    h, ns = devcluster, devcluster_namespace
    h.apply(web(h, "reach"), ns)
    (pod,) = release.ready_pods(h, ns, "app=reach", 1, timeout=90)
    ip = pod["status"]["podIP"]
    results: dict[str, object] = {}

    async def fetch() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:{PORT}/hostname") as r:
            results["pod"] = r.status
        req = urllib.request.Request(h.server + "/readyz")
        with urllib.request.urlopen(req, context=h.ssl_context, timeout=5) as resp:
            results["api"] = resp.read().decode()

    thread = threading.Thread(target=lambda: asyncio.run(fetch()))
    thread.start()
    thread.join(30)
    assert results == {"pod": 200, "api": "ok"}


def test_kubectl_server_dry_run_and_helm_template_apply(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}\n"
        "data:\n  k: {{ .Values.k | quote }}\n"
    )
    rendered = h.run(["helm", "template", "rel", str(chart), "--set", "k=v"])
    assert "created (server dry run)" in h.kubectl(
        "apply", "-n", ns, "--dry-run=server", "-f", "-", input=rendered
    )
    h.kubectl("apply", "-n", ns, "-f", "-", input=rendered)
    assert h.get(f"/api/v1/namespaces/{ns}/configmaps/rel")["data"] == {"k": "v"}


def test_an_api_server_restart_keeps_pods_and_the_node_working(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(web(h, "before"), ns)
    (pod,) = release.ready_pods(h, ns, "app=before", 1, timeout=90)
    h.restart_apiserver()
    assert h.kubectl("get", "pods", "-n", ns, "-o", "name").strip() == (
        f"pod/{pod['metadata']['name']}"
    )
    # The kubelet and the scheduler reconnected: a pod created after the restart starts.
    h.apply(web(h, "after"), ns)
    (new,) = release.ready_pods(h, ns, "app=after", 1, timeout=90)
    assert http_json(f"http://{new['status']['podIP']}:{PORT}/hostname", timeout=5)[0] == 200


def test_node_reports_itself_as_a_user_would_see_it(devcluster: Harness) -> None:
    (node,) = devcluster.get("/api/v1/nodes")["items"]
    info = node["status"]["nodeInfo"]
    assert info["kubeletVersion"] == "v1.37.2"
    assert info["containerRuntimeVersion"].startswith("containerd://")
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == "10.244.0.1"
    names = [n for i in node["status"].get("images", []) for n in i["names"]]
    assert any(n.endswith("/" + devcluster.image("operator")) for n in names), names
    dns = json.loads(
        devcluster.kubectl("get", "svc", "-n", "kube-system", "kube-dns", "-o", "json")
    )
    assert dns["spec"]["clusterIP"] == "10.0.0.10"
