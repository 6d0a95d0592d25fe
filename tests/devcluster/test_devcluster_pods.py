"""The process kubelet on a real control plane: whatever it gets wrong, the operator's tests
would believe, so these check it against what a real node does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from lora_devcluster import kubelet
from lora_devcluster.harness import Harness

ECHO = "lora-devcluster/echo:test"
Obj = dict[str, Any]


def http_get(url: str, timeout: float = 5) -> tuple[int, bytes]:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return resp.status, resp.read()


def echo_deployment(name: str, replicas: int, **pod_extra: Any) -> Obj:
    container: Obj = {
        "name": "web",
        "image": ECHO,
        "ports": [{"name": "http", "containerPort": 8080}],
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 1},
    }
    container.update(pod_extra.pop("container", {}))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": {"app": name}},
                "spec": {
                    "terminationGracePeriodSeconds": 5,
                    "containers": [container],
                    **pod_extra,
                },
            },
        },
    }


def ready_pods(h: Harness, ns: str, selector: str, count: int) -> list[Obj]:
    def check() -> list[Obj] | None:
        pods = [p for p in h.pods(ns, selector) if not p["metadata"].get("deletionTimestamp")]
        ready = [
            p
            for p in pods
            if any(
                c["type"] == "Ready" and c["status"] == "True"
                for c in p.get("status", {}).get("conditions", [])
            )
        ]
        return ready if len(ready) == count and len(pods) == count else None

    return h.wait_for(f"{count} ready pods {selector} in {ns}", check, timeout=60)


def container_status(pod: Obj) -> Obj:
    status: Obj = pod["status"]["containerStatuses"][0]
    return status


def test_deployment_pods_are_ready_with_distinct_ips_in_endpointslice(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("web", 2), ns)
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "http"}]},
        },
        ns,
    )
    pods = ready_pods(h, ns, "app=web", 2)
    ips = {p["status"]["podIP"] for p in pods}
    assert len(ips) == 2
    for p in pods:
        assert p["spec"]["nodeName"] == "lora-devcluster"
        assert p["status"]["phase"] == "Running"
        assert p["status"]["podIP"].startswith("10.244.0.")
        assert container_status(p)["ready"] is True
        assert container_status(p)["restartCount"] == 0

    def slice_ips() -> set[str] | None:
        slices = h.get(
            f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
            "?labelSelector=kubernetes.io/service-name%3Dweb"
        )["items"]
        got = {
            addr
            for s in slices
            for ep in s.get("endpoints") or []
            if ep.get("conditions", {}).get("ready")
            for addr in ep["addresses"]
        }
        return got if got == ips else None

    h.wait_for("the EndpointSlice to list both pod IPs", slice_ips, timeout=30)
    # Both pods listen on 0.0.0.0:8080: each pod has its own network namespace.
    for ip in ips:
        status, body = http_get(f"http://{ip}:8080/")
        assert status == 200
        # The pod's hostname (its own UTS namespace) and HOSTNAME are the pod's name.
        hostname, env_hostname = body.decode().split()
        assert hostname == env_hostname
        assert hostname in {p["metadata"]["name"] for p in pods}


def test_killed_container_restarts_in_the_same_pod(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("crash", 1), ns)
    (pod,) = ready_pods(h, ns, "app=crash", 1)
    uid, ip = pod["metadata"]["uid"], pod["status"]["podIP"]
    started = container_status(pod)["state"]["running"]["startedAt"]
    (pid,) = h.container_pids(uid, "web")
    os.kill(pid, signal.SIGKILL)

    def restarted() -> Obj | None:
        (p,) = h.pods(ns, "app=crash")
        cs = container_status(p)
        return p if cs["restartCount"] == 1 and cs["ready"] else None

    p = h.wait_for("the container to restart and be ready", restarted, timeout=30)
    cs = container_status(p)
    assert p["metadata"]["uid"] == uid
    assert p["status"]["podIP"] == ip
    assert cs["state"]["running"]["startedAt"] != started
    assert cs["lastState"]["terminated"]["exitCode"] == 128 + signal.SIGKILL
    assert h.container_pids(uid, "web") != [pid]
    assert http_get(f"http://{ip}:8080/healthz")[0] == 200


def test_deleted_pod_is_replaced_with_a_new_ip_and_its_process_ends(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("del", 1), ns)
    (old,) = ready_pods(h, ns, "app=del", 1)
    old_uid, old_ip = old["metadata"]["uid"], old["status"]["podIP"]
    assert h.container_pids(old_uid)
    h.kubectl("delete", "pod", "-n", ns, old["metadata"]["name"], "--wait=true")
    (new,) = ready_pods(h, ns, "app=del", 1)
    assert new["metadata"]["uid"] != old_uid
    assert new["status"]["podIP"] != old_ip
    assert h.container_pids(old_uid) == []
    assert http_get(f"http://{new['status']['podIP']}:8080/healthz")[0] == 200


def test_liveness_probe_failure_restarts_the_container(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    live = {
        "httpGet": {"path": "/file?path=/nonexistent", "port": 8080},
        "periodSeconds": 1,
        "failureThreshold": 2,
    }
    h.apply(echo_deployment("live", 1, container={"livenessProbe": live}), ns)

    def restarted() -> bool:
        return any(
            container_status(p)["restartCount"] >= 1
            for p in h.pods(ns, "app=live")
            if p.get("status", {}).get("containerStatuses")
        )

    h.wait_for("a liveness restart", restarted, timeout=30)
    assert "liveness probe failed" in h.container_logs(ns)


def test_pvc_on_hostpath_pv_is_shared_between_pods(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    pv_name = f"pv-{ns}"
    (tmp_path / "pv").mkdir()
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": str(tmp_path / "pv"), "type": "Directory"},
                "claimRef": {"namespace": ns, "name": "shared"},
            },
        }
    )
    try:
        h.apply(
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "shared"},
                "spec": {
                    "accessModes": ["ReadWriteMany"],
                    "storageClassName": "",
                    "volumeName": pv_name,
                    "resources": {"requests": {"storage": "1Gi"}},
                },
            },
            ns,
        )
        h.wait_for(
            "the PVC to be bound",
            lambda: (
                h.get(f"/api/v1/namespaces/{ns}/persistentvolumeclaims/shared")["status"].get(
                    "phase"
                )
                == "Bound"
            ),
            timeout=30,
        )
        volume = {"name": "data", "persistentVolumeClaim": {"claimName": "shared"}}
        mount = {"name": "data", "mountPath": "/lora-devcluster-test/data"}
        writer = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "writer"},
            "spec": {
                "restartPolicy": "Never",
                "volumes": [volume],
                "containers": [
                    {
                        "name": "w",
                        "image": "shell",
                        "command": [
                            "sh",
                            "-c",
                            "echo written-by-$(POD) > /lora-devcluster-test/data/x",
                        ],
                        "env": [
                            {
                                "name": "POD",
                                "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                            }
                        ],
                        "volumeMounts": [mount],
                    }
                ],
            },
        }
        h.apply(writer, ns)
        h.wait_for(
            "the writer pod to succeed",
            lambda: (
                h.get(f"/api/v1/namespaces/{ns}/pods/writer")["status"].get("phase") == "Succeeded"
            ),
            timeout=30,
        )
        h.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "reader", "labels": {"app": "reader"}},
                "spec": {
                    "volumes": [volume],
                    "containers": [
                        {
                            "name": "r",
                            "image": ECHO,
                            "volumeMounts": [mount],
                            "readinessProbe": {
                                "httpGet": {"path": "/healthz", "port": 8080},
                                "periodSeconds": 1,
                            },
                        }
                    ],
                },
            },
            ns,
        )
        (reader,) = ready_pods(h, ns, "app=reader", 1)
        url = f"http://{reader['status']['podIP']}:8080/file?path=/lora-devcluster-test/data/x"
        assert http_get(url)[1] == b"written-by-writer\n"
        assert (tmp_path / "pv" / "x").read_text() == "written-by-writer\n"
        # The mount lives only in the container's mount namespace, never on the host.
        assert not Path("/lora-devcluster-test/data/x").exists()
    finally:
        h.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=60s")
        h.kubectl("delete", "pv", pv_name, "--wait=false")


def test_secret_and_configmap_as_env_and_files(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "cfg"},
                "data": {"mode": "fast", "conf.yaml": "a: 1\n"},
            },
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": "creds"},
                "stringData": {"token": "s3cr3t"},
            },
        ],
        ns,
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "cfgpod", "labels": {"app": "cfgpod"}},
        "spec": {
            "volumes": [
                {"name": "cfg", "configMap": {"name": "cfg"}},
                {
                    "name": "creds",
                    "secret": {
                        "secretName": "creds",
                        "items": [{"key": "token", "path": "t/token"}],
                    },
                },
                {"name": "scratch", "emptyDir": {}},
            ],
            "containers": [
                {
                    "name": "c",
                    "image": ECHO,
                    "envFrom": [{"configMapRef": {"name": "cfg"}, "prefix": "CFG_"}],
                    "env": [
                        {
                            "name": "TOKEN",
                            "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}},
                        },
                        {
                            "name": "MODE",
                            "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}},
                        },
                        {"name": "MY_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {
                            "name": "MY_NS",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                        },
                        {"name": "COMBINED", "value": "$(MODE)-$(MY_NS)"},
                    ],
                    "volumeMounts": [
                        {"name": "cfg", "mountPath": "/lora-devcluster-test/cfg"},
                        {"name": "creds", "mountPath": "/lora-devcluster-test/creds"},
                        {"name": "scratch", "mountPath": "/lora-devcluster-test/scratch"},
                    ],
                    "readinessProbe": {
                        "httpGet": {"path": "/healthz", "port": 8080},
                        "periodSeconds": 1,
                    },
                }
            ],
        },
    }
    h.apply(pod, ns)
    (p,) = ready_pods(h, ns, "app=cfgpod", 1)
    ip = p["status"]["podIP"]
    env = json.loads(http_get(f"http://{ip}:8080/env")[1])
    assert env["TOKEN"] == "s3cr3t"
    assert env["MODE"] == "fast"
    assert env["CFG_mode"] == "fast"
    assert env["MY_IP"] == ip
    assert env["MY_NS"] == ns
    assert env["COMBINED"] == f"fast-{ns}"
    assert env["KUBERNETES_SERVICE_HOST"] == "10.244.0.1"

    def file(path: str) -> bytes:
        return http_get(f"http://{ip}:8080/file?path={path}")[1]

    assert file("/lora-devcluster-test/cfg/conf.yaml") == b"a: 1\n"
    assert file("/lora-devcluster-test/creds/t/token") == b"s3cr3t"

    def ls(path: str) -> list[str]:
        entries: list[str] = json.loads(http_get(f"http://{ip}:8080/ls?path={path}")[1])
        return entries

    assert ls("/lora-devcluster-test/cfg") == ["conf.yaml", "mode"]
    assert ls("/lora-devcluster-test/scratch") == []  # a fresh emptyDir


def test_deleting_a_namespace_ends_its_pods_and_processes(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("gone", 2), ns)
    pods = ready_pods(h, ns, "app=gone", 2)
    uids = [p["metadata"]["uid"] for p in pods]
    assert all(h.container_pids(u) for u in uids)
    h.kubectl("delete", "namespace", ns, "--wait=true", "--timeout=90s")
    assert h.get_or_none(f"/api/v1/namespaces/{ns}") is None
    assert [u for u in uids if h.container_pids(u)] == []


def test_kubectl_server_dry_run_and_helm_template_apply(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    h, ns = devcluster, devcluster_namespace
    out = h.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        ns,
        "-f",
        "-",
        input=json.dumps(echo_deployment("dry", 1)),
    )
    assert "deployment.apps/dry created (server dry run)" in out
    assert h.get_or_none(f"/apis/apps/v1/namespaces/{ns}/deployments/dry") is None
    # The API server validates on a dry run too: an invalid object is refused.
    bad = echo_deployment("bad", 1)
    bad["spec"]["selector"]["matchLabels"] = {"app": "other"}
    refused = subprocess.run(
        ["kubectl", "apply", "--dry-run=server", "-n", ns, "-f", "-"],
        input=json.dumps(bad),
        capture_output=True,
        text=True,
        env=h.cluster.env(),
        check=False,
    )
    assert refused.returncode != 0
    assert "selector" in refused.stderr

    chart = tmp_path / "chart"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("greeting: hello\n")
    (chart / "templates" / "cm.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-cm\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    rendered = h.run(["helm", "template", "rel", str(chart), "--set", "greeting=hi"])
    h.kubectl("apply", "-n", ns, "-f", "-", input=rendered)
    cm = h.get(f"/api/v1/namespaces/{ns}/configmaps/rel-cm")
    assert cm["data"] == {"greeting": "hi"}


def test_unmapped_image_without_command_reports_why(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "nope"},
            "spec": {"containers": [{"name": "c", "image": "nginx:1.27"}]},
        },
        ns,
    )

    def waiting() -> Obj | None:
        p = h.get(f"/api/v1/namespaces/{ns}/pods/nope")
        statuses = p.get("status", {}).get("containerStatuses") or []
        state = statuses[0]["state"].get("waiting", {}) if statuses else {}
        return state if state.get("reason") == "ErrImageNeverPull" else None

    state = h.wait_for("the pod to report the unmapped image", waiting, timeout=30)
    assert "image map" in state["message"]


def test_python_in_pods_is_this_interpreter() -> None:
    # The echo image maps to the interpreter running the tests, so pods see this venv.
    from lora_devcluster import cluster

    assert cluster.default_image_map()["lora-devcluster/echo:*"][0] == sys.executable


def test_graceful_deletion_sends_sigterm_then_sigkill_after_the_grace_period(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    trap = "trap 'echo got-sigterm; exit 0' TERM; echo up; while true; do sleep 0.1; done"
    deaf = "trap '' TERM; echo up; while true; do sleep 0.1; done"
    for name, script in (("polite", trap), ("deaf", deaf)):
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": name, "labels": {"app": name}},
            "spec": {
                "terminationGracePeriodSeconds": 4,
                "containers": [{"name": "c", "image": "shell", "command": ["sh", "-c", script]}],
            },
        }
        h.apply(pod, ns)
    polite, deaf_pod = ready_pods(h, ns, "app=polite", 1)[0], ready_pods(h, ns, "app=deaf", 1)[0]
    timings = {}
    for p in (polite, deaf_pod):
        start = time.monotonic()
        h.kubectl("delete", "pod", "-n", ns, p["metadata"]["name"], "--wait=true")
        timings[p["metadata"]["name"]] = time.monotonic() - start
        assert h.container_pids(p["metadata"]["uid"]) == []
    assert "got-sigterm" in h.container_logs(ns)
    assert timings["polite"] < 4  # exited on SIGTERM, no need to wait out the grace period
    assert 4 <= timings["deaf"] < 10  # ignored SIGTERM: killed when the grace period ended


def test_threads_and_event_loops_started_by_a_test_reach_pods_and_the_api(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    # kopf.testing.KopfRunner runs the operator in a thread with its own event loop: both must
    # see the cluster's network namespace, which this process joined before starting them.
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("reach", 1), ns)
    (pod,) = ready_pods(h, ns, "app=reach", 1)
    ip = pod["status"]["podIP"]
    results: dict[str, object] = {}

    async def fetch() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(f"http://{ip}:8080/healthz") as r:
            results["pod"] = r.status
        results["api"] = http_get_api(h)

    thread = threading.Thread(target=lambda: asyncio.run(fetch()))
    thread.start()
    thread.join(30)
    assert results == {"pod": 200, "api": "ok"}


def http_get_api(h: Harness) -> str:
    req = urllib.request.Request(h.server + "/readyz")
    with urllib.request.urlopen(req, context=h.ssl_context, timeout=5) as resp:
        return str(resp.read().decode())


def test_pods_get_a_service_account_token_that_the_api_server_accepts(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("sa", 1), ns)
    (pod,) = ready_pods(h, ns, "app=sa", 1)
    base = f"http://{pod['status']['podIP']}:8080/file?path={kubelet.SERVICE_ACCOUNT_PATH}"
    token = http_get(f"{base}/token")[1].decode()
    assert http_get(f"{base}/namespace")[1].decode() == ns
    assert http_get(f"{base}/ca.crt")[1].startswith(b"-----BEGIN CERTIFICATE-----")
    # Authenticated as the pod's service account, authorized by RBAC (which grants it nothing).
    review = {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}
    req = urllib.request.Request(
        h.server + "/apis/authentication.k8s.io/v1/selfsubjectreviews",
        data=json.dumps(review).encode(),
        headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
        method="POST",
    )
    ctx = ssl.create_default_context(cadata=http_get(f"{base}/ca.crt")[1].decode())
    with urllib.request.urlopen(req, context=ctx, timeout=5) as resp:
        user = json.loads(resp.read())["status"]["userInfo"]["username"]
    assert user == f"system:serviceaccount:{ns}:default"
    forbidden = urllib.request.Request(
        h.server + f"/api/v1/namespaces/{ns}/secrets", headers={"Authorization": f"Bearer {token}"}
    )
    try:
        urllib.request.urlopen(forbidden, context=ctx, timeout=5)
        raise AssertionError("the default service account must not list secrets")
    except urllib.error.HTTPError as e:
        assert e.code == 403


def test_exec_and_tcp_probes(devcluster: Harness, devcluster_namespace: str) -> None:
    h, ns = devcluster, devcluster_namespace
    # Ready only once the container has written a file on its emptyDir: the exec probe runs in
    # the container's network and mounts.
    script = "sleep 2; touch /lora-devcluster-test/state/ready; exec python3 -m http.server 9000"
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "probed", "labels": {"app": "probed"}},
        "spec": {
            "volumes": [{"name": "state", "emptyDir": {}}],
            "containers": [
                {
                    "name": "c",
                    "image": "shell",
                    "command": ["sh", "-c", script],
                    "volumeMounts": [{"name": "state", "mountPath": "/lora-devcluster-test/state"}],
                    "readinessProbe": {
                        "exec": {"command": ["test", "-f", "/lora-devcluster-test/state/ready"]},
                        "periodSeconds": 1,
                    },
                    "livenessProbe": {
                        "tcpSocket": {"port": 9000},
                        "initialDelaySeconds": 4,
                        "periodSeconds": 1,
                    },
                }
            ],
        },
    }
    h.apply(pod, ns)
    time.sleep(1)
    (p,) = h.pods(ns, "app=probed")
    assert container_status(p)["ready"] is False
    (p,) = ready_pods(h, ns, "app=probed", 1)
    time.sleep(4)  # the TCP liveness probe has run a few times by now, and succeeded
    (p,) = h.pods(ns, "app=probed")
    assert container_status(p)["restartCount"] == 0
    assert container_status(p)["ready"] is True


KOPF_OPERATOR = """
import urllib.request
import kopf

@kopf.on.create("pods", labels={"app": "kopfed"})
def seen(name, status, patch, **_):
    ip = status.get("podIP")
    if not ip:
        raise kopf.TemporaryError("no pod IP yet", delay=0.5)
    try:
        with urllib.request.urlopen(f"http://{ip}:8080/healthz", timeout=5) as resp:
            patch.metadata.annotations["devcluster-test/reached"] = resp.read().decode()
    except OSError as e:  # the server may not listen yet: the pod is not Ready before it does
        raise kopf.TemporaryError(f"not reachable yet: {e}", delay=0.5) from e
"""


def test_kopf_runner_in_the_test_process_reaches_the_api_and_pods(
    devcluster: Harness, devcluster_namespace: str, tmp_path: Path
) -> None:
    kopf_testing = pytest.importorskip("kopf.testing")
    h, ns = devcluster, devcluster_namespace
    operator = tmp_path / "operator.py"
    operator.write_text(KOPF_OPERATOR)
    args = ["run", "--standalone", "--namespace", ns, str(operator)]
    with kopf_testing.KopfRunner(args, timeout=60):
        h.apply(echo_deployment("kopfed", 1), ns)
        ready_pods(h, ns, "app=kopfed", 1)

        def annotated() -> str | None:
            (p,) = h.pods(ns, "app=kopfed")
            value: str | None = p["metadata"].get("annotations", {}).get("devcluster-test/reached")
            return value

        assert h.wait_for("kopf to annotate the pod", annotated, timeout=30) == "ok"


POD_CLIENT = """
import os, ssl, urllib.request
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
api = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
token = open(f"{sa}/token").read()
req = urllib.request.Request(f"{api}/version", headers={"Authorization": f"Bearer {token}"})
print("api", urllib.request.urlopen(req, context=ctx, timeout=5).status)
peer = f"http://{os.environ['PEER']}:8080/healthz"
print("peer", urllib.request.urlopen(peer, timeout=5).read().decode())
"""


def test_pods_reach_the_api_server_and_other_pods(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("peer", 1), ns)
    (peer,) = ready_pods(h, ns, "app=peer", 1)
    client = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "client"},
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "c",
                    "image": "python",
                    "command": [sys.executable, "-c", POD_CLIENT],
                    "env": [{"name": "PEER", "value": peer["status"]["podIP"]}],
                }
            ],
        },
    }
    h.apply(client, ns)

    def finished() -> str | None:
        phase: str | None = h.get(f"/api/v1/namespaces/{ns}/pods/client")["status"].get("phase")
        return phase if phase in ("Succeeded", "Failed") else None

    assert h.wait_for("the client pod to finish", finished, timeout=30) == "Succeeded"
    logs = h.container_logs(ns)
    assert "api 200" in logs
    assert "peer ok" in logs


def test_pod_waiting_for_a_missing_configmap_says_so_starts_when_it_appears_and_deletes(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "waiter", "labels": {"app": "waiter"}},
        "spec": {
            "volumes": [{"name": "cfg", "configMap": {"name": "later"}}],
            "containers": [
                {
                    "name": "c",
                    "image": ECHO,
                    "volumeMounts": [{"name": "cfg", "mountPath": "/lora-devcluster-test/later"}],
                }
            ],
        },
    }
    h.apply(pod, ns)

    def waiting_message() -> str | None:
        statuses = h.get(f"/api/v1/namespaces/{ns}/pods/waiter")["status"].get("containerStatuses")
        message: str | None = (
            (statuses or [{}])[0].get("state", {}).get("waiting", {}).get("message")
        )
        return message if message and "later" in message else None

    assert "not found" in h.wait_for("a waiting reason naming the ConfigMap", waiting_message)
    h.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "later"},
             "data": {"k": "v"}}, ns)  # fmt: skip
    (p,) = ready_pods(h, ns, "app=waiter", 1)
    h.kubectl("delete", "pod", "-n", ns, "waiter", "--wait=true", "--timeout=30s")
    assert h.container_pids(p["metadata"]["uid"]) == []


def test_kubectl_logs_current_previous_tail_and_follow(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    script = 'echo "run $(cat /proc/sys/kernel/random/uuid)"; echo last-line; sleep 600'
    h.apply(
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "talk", "labels": {"app": "talk"}},
            "spec": {
                "containers": [{"name": "c", "image": "shell", "command": ["sh", "-c", script]}]
            },
        },
        ns,
    )
    (pod,) = ready_pods(h, ns, "app=talk", 1)
    first = h.wait_for("the first run's output", lambda: h.kubectl("logs", "-n", ns, "talk"))
    assert first.splitlines()[1:] == ["last-line"]
    for pid in h.container_pids(pod["metadata"]["uid"]):  # sh and its sleep
        os.kill(pid, signal.SIGKILL)
    h.wait_for(
        "a restart",
        lambda: (
            container_status(h.pods(ns, "app=talk")[0])["restartCount"] == 1
            and h.kubectl("logs", "-n", ns, "talk").count("last-line") == 1
            and h.kubectl("logs", "-n", ns, "talk") != first
        ),
    )
    assert h.kubectl("logs", "-n", ns, "talk", "--previous") == first
    assert h.kubectl("logs", "-n", ns, "talk", "--tail=1") == "last-line\n"
    # --follow streams the current run; stop it after the output arrived.
    follow = subprocess.Popen(
        ["kubectl", "logs", "-f", "-n", ns, "talk"],
        stdout=subprocess.PIPE,
        text=True,
        env=h.cluster.env(),
    )
    try:
        assert follow.stdout is not None
        assert follow.stdout.readline().startswith("run ")
        assert follow.stdout.readline() == "last-line\n"
    finally:
        follow.kill()
        follow.wait()


def test_init_containers_run_to_completion_first(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    mount = {"name": "work", "mountPath": "/lora-devcluster-test/work"}
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "staged", "labels": {"app": "staged"}},
        "spec": {
            "volumes": [{"name": "work", "emptyDir": {}}],
            "initContainers": [
                {"name": "first", "image": "shell", "volumeMounts": [mount],
                 "command": ["sh", "-c", "sleep 1; echo 1 > /lora-devcluster-test/work/a"]},
                {"name": "second", "image": "shell", "volumeMounts": [mount],
                 "command": ["sh", "-c", "test -f /lora-devcluster-test/work/a && echo 2 > "
                             "/lora-devcluster-test/work/b"]},
            ],
            "containers": [{"name": "app", "image": ECHO, "volumeMounts": [mount]}],
        },
    }  # fmt: skip
    h.apply(pod, ns)
    time.sleep(0.5)
    early = h.get(f"/api/v1/namespaces/{ns}/pods/staged")
    assert early["status"].get("phase") == "Pending"
    (p,) = ready_pods(h, ns, "app=staged", 1)
    inits = p["status"]["initContainerStatuses"]
    assert [s["state"]["terminated"]["exitCode"] for s in inits] == [0, 0]
    ip = p["status"]["podIP"]

    def listing() -> list[str] | None:
        try:
            names: list[str] = json.loads(
                http_get(f"http://{ip}:8080/ls?path=/lora-devcluster-test/work")[1]
            )
        except OSError:
            return None
        return names

    assert h.wait_for("the app to serve", listing) == ["a", "b"]


def test_failing_init_container_with_restart_never_fails_the_pod(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "broken"},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": [{"name": "i", "image": "shell", "command": ["sh", "-c", "exit 4"]}],
            "containers": [{"name": "app", "image": ECHO}],
        },
    }
    h.apply(pod, ns)

    def failed() -> Obj | None:
        p = h.get(f"/api/v1/namespaces/{ns}/pods/broken")
        return p if p["status"].get("phase") == "Failed" else None

    p = h.wait_for("the pod to fail", failed, timeout=30)
    assert p["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"] == 4
    assert p["status"]["containerStatuses"][0]["state"]["waiting"]["reason"] == "PodInitializing"


def test_an_api_server_restart_keeps_pods_and_the_kubelet_working(
    devcluster: Harness, devcluster_namespace: str
) -> None:
    h, ns = devcluster, devcluster_namespace
    h.apply(echo_deployment("before", 1), ns)
    (pod,) = ready_pods(h, ns, "app=before", 1)
    h.restart_apiserver()
    assert (
        h.kubectl("get", "pods", "-n", ns, "-o", "name").strip() == f"pod/{pod['metadata']['name']}"
    )
    # The kubelet reconnected: it starts a pod created after the restart.
    h.apply(echo_deployment("after", 1), ns)
    (new,) = ready_pods(h, ns, "app=after", 1)
    assert http_get(f"http://{new['status']['podIP']}:8080/healthz")[0] == 200
