"""Synchronous helpers for tests on a running cluster: API calls, kubectl, waiting, logs.

Owns: what a test (or the demo) needs once the cluster is up and this process has joined its
network namespace. Must not: start or stop clusters (that is `cluster`).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from lora_devcluster import cluster as cluster_mod
from lora_devcluster import processes

Obj = dict[str, Any]
T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"API server answered {status}: {message}")
        self.status = status


class Harness:
    """A cluster as tests and the demo use it: the local cluster (`Harness(cluster)`), or any
    cluster reached with a kubeconfig (`Harness.external(...)`: kind, for the same end-to-end
    suite). What only the local cluster can do (its logs on disk, host PIDs, restarting its API
    server) says so when asked of another."""

    def __init__(
        self,
        cluster: cluster_mod.Cluster | None = None,
        *,
        kubeconfig: Path | None = None,
        images: Mapping[str, str] | None = None,
        node_shell: Sequence[str] = (),
    ) -> None:
        self._local = cluster
        if cluster is not None:
            kubeconfig, images = cluster.kubeconfig, cluster.images
            self.env = cluster.env()
        elif kubeconfig is not None:
            self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
        else:
            raise ValueError("a Harness needs a local cluster or a kubeconfig")
        self.images = dict(images or {})
        # How to run a command on the node of an external cluster (`docker exec NODE` on kind).
        self.node_shell = list(node_shell)
        config = yaml.safe_load(kubeconfig.read_text())
        self.server: str = config["clusters"][0]["cluster"]["server"]
        user = config["users"][0]["user"]
        self._tmp = tempfile.TemporaryDirectory(prefix="lora-devcluster-client-")
        cert, key = Path(self._tmp.name) / "c.crt", Path(self._tmp.name) / "c.key"
        cert.write_bytes(base64.b64decode(user["client-certificate-data"]))
        key.write_bytes(base64.b64decode(user["client-key-data"]))
        ca = base64.b64decode(config["clusters"][0]["cluster"]["certificate-authority-data"])
        self.ssl_context = ssl.create_default_context(cadata=ca.decode())
        self.ssl_context.load_cert_chain(str(cert), str(key))
        self._tmp.cleanup()

    @classmethod
    def external(
        cls, kubeconfig: Path, images: Mapping[str, str], node_shell: Sequence[str] = ()
    ) -> Harness:
        return cls(kubeconfig=kubeconfig, images=images, node_shell=node_shell)

    @property
    def is_local(self) -> bool:
        return self._local is not None

    @property
    def cluster(self) -> cluster_mod.Cluster:
        """The local cluster (its directory, logs, processes)."""
        if self._local is None:
            raise AssertionError("this needs the local cluster (lora-devcluster), not a kubeconfig")
        return self._local

    def image(self, role: str) -> str:
        """The ref of one of this project's images on the node (`operator`, `inference`,
        `base`, `pause`), as `up` imported it: manifests use it with imagePullPolicy Never."""
        try:
            return self.images[role]
        except KeyError:
            raise AssertionError(
                f"the node has no {role!r} image; it has {sorted(self.images)}"
            ) from None

    # ---- API

    def request(
        self,
        method: str,
        path: str,
        body: Obj | None = None,
        content_type: str = "application/json",
    ) -> Obj:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.server + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        try:
            with urllib.request.urlopen(req, context=self.ssl_context, timeout=30) as resp:
                text = resp.read()
        except urllib.error.HTTPError as e:
            raw = e.read().decode(errors="replace")
            try:
                message = json.loads(raw).get("message", raw)
            except ValueError:
                message = raw
            raise ApiError(e.code, message) from e
        result: Obj = json.loads(text) if text else {}
        return result

    def get(self, path: str) -> Obj:
        return self.request("GET", path)

    def get_or_none(self, path: str) -> Obj | None:
        try:
            return self.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def create(self, path: str, body: Obj) -> Obj:
        return self.request("POST", path, body)

    def delete(self, path: str, body: Obj | None = None) -> Obj:
        return self.request("DELETE", path, body)

    def merge_patch(self, path: str, body: Obj) -> Obj:
        return self.request("PATCH", path, body, "application/merge-patch+json")

    def proxy(
        self,
        namespace: str,
        target: str,
        path: str,
        body: Obj | None = None,
        timeout: float = 300,
    ) -> tuple[int, bytes]:
        """An HTTP call to a pod or a Service through the API server's proxy (`target` is
        `pods/NAME:PORT` or `services/NAME:PORT`): works from anywhere the API server is
        reachable, on any cluster. Returns the status and the body, errors included."""
        data = json.dumps(body).encode() if body is not None else None
        url = f"{self.server}/api/v1/namespaces/{namespace}/{target}/proxy{path}"
        req = urllib.request.Request(url, data=data, method="POST" if data else "GET")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, context=self.ssl_context, timeout=timeout) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def kill_container(self, namespace: str, pod: str, container: str) -> None:
        """SIGKILL a container's processes from the node, as a crash would (from inside the
        container, its PID 1 ignores signals it does not handle)."""
        obj = self.get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
        if self._local is not None:
            pids = self.container_pids(obj["metadata"]["uid"], container)
            if not pids:
                raise AssertionError(f"no process of {namespace}/{pod}/{container} on the node")
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            return
        if not self.node_shell:
            raise AssertionError("killing a container of an external cluster needs a node shell")
        (status,) = [cs for cs in obj["status"]["containerStatuses"] if cs["name"] == container]
        cid = status["containerID"].split("://", 1)[-1]
        template = "{{.info.pid}}"
        script = f"kill -9 $(crictl inspect --output go-template --template '{template}' {cid})"
        self.run([*self.node_shell, "sh", "-c", script])

    def pods(self, namespace: str, selector: str = "") -> list[Obj]:
        q = f"?labelSelector={urllib.parse.quote(selector)}" if selector else ""
        items: list[Obj] = self.get(f"/api/v1/namespaces/{namespace}/pods{q}")["items"]
        return items

    # ---- kubectl / helm

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        return self.run(["kubectl", *args], input=input, check=check)

    def run(self, argv: list[str], input: str | None = None, check: bool = True) -> str:
        """Run a command (kubectl, helm, ...) with KUBECONFIG set and the binaries on PATH.
        This process is already in the cluster's network namespace; children inherit it."""
        proc = subprocess.run(
            argv, input=input, capture_output=True, text=True, env=self.env, timeout=120
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
            )
        return proc.stdout

    def apply(self, manifest: Obj | list[Obj] | str, namespace: str | None = None) -> str:
        text = (
            manifest
            if isinstance(manifest, str)
            else yaml.safe_dump_all(manifest if isinstance(manifest, list) else [manifest])
        )
        ns_args = ["-n", namespace] if namespace else []
        return self.kubectl("apply", *ns_args, "-f", "-", input=text)

    # ---- waiting and logs

    def wait_for(
        self, what: str, fn: Callable[[], T | None], timeout: float = 60, interval: float = 0.2
    ) -> T:
        """Poll `fn` until it returns something truthy; fail with `what` after `timeout`."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                value = fn()
                if value:
                    return value
            except (ApiError, OSError) as e:
                last = e
            time.sleep(interval)
        raise AssertionError(
            f"timed out after {timeout:.0f} s waiting for {what}"
            + (f" (last error: {last})" if last else "")
        )

    def container_logs(self, namespace: str) -> str:
        """Every container log of the pods (live or deleted) of `namespace`, every restart, from
        the kubelet's log directory (its CRI format reduced to the text)."""
        parts = []
        for d in sorted(self.cluster.layout.pod_logs.glob(f"{namespace}_*")):
            for log in sorted(d.glob("*/*.log")):
                lines = [_cri_text(line) for line in log.read_text(errors="replace").splitlines()]
                parts.append(f"==== {d.name}/{log.parent.name}/{log.name}\n" + "\n".join(lines))
        return "\n".join(parts) if parts else f"(no container logs for namespace {namespace})"

    def describe_pods(self, namespace: str) -> str:
        """One line per pod and container: phase, IP, state and reason (for failure reports)."""
        try:
            pods = self.pods(namespace)
        except (ApiError, OSError) as e:
            return f"(cannot list pods of {namespace}: {e})"
        lines = []
        for p in pods:
            st = p.get("status") or {}
            deleting = " (deleting)" if p["metadata"].get("deletionTimestamp") else ""
            why = (
                f" reason={st['reason']} message={st.get('message')!r}" if st.get("reason") else ""
            )
            lines.append(
                f"pod {p['metadata']['name']}{deleting}: phase={st.get('phase')} "
                f"ip={st.get('podIP')} node={p['spec'].get('nodeName')}{why}"
            )
            for cs in (st.get("initContainerStatuses") or []) + (st.get("containerStatuses") or []):
                states: dict[str, Obj] = cs.get("state") or {"unknown": {}}
                kind, info = next(iter(states.items()))
                detail = " ".join(f"{k}={v}" for k, v in info.items() if k != "startedAt")
                lines.append(
                    f"  {cs['name']}: {kind} {detail} ready={cs.get('ready')} "
                    f"restarts={cs.get('restartCount')}"
                )
        try:
            (node,) = self.get("/api/v1/nodes")["items"]
            pressure = [
                f"{c['type']}: {c.get('message')}"
                for c in node["status"].get("conditions") or ()
                if c["type"] != "Ready" and c["status"] == "True"
            ]
            if pressure:
                lines.append("node: " + "; ".join(pressure))
        except (ApiError, OSError, ValueError):
            pass
        return "\n".join(lines) if lines else f"(no pods in {namespace})"

    def node_log_tail(self, lines: int = 40) -> str:
        """The last lines of the supervisor's and the kubelet's logs (for failure reports)."""
        logs = self.cluster.layout.logs
        return "\n".join(
            f"---- {name}\n" + processes.tail(logs / f"{name}.log", lines)
            for name in ("supervisor", "kubelet")
        )

    def restart_apiserver(self, timeout: float = 120) -> None:
        """Stop and start the API server (etcd keeps the data); returns once it is healthy."""
        restarts = self.cluster.layout.apiserver_restarts
        before = int(restarts.read_text()) if restarts.exists() else 0
        (supervisor,) = cluster_mod.children(self.cluster.unshare_pid)
        os.kill(supervisor, signal.SIGUSR1)
        self.wait_for(
            "the API server to restart",
            lambda: restarts.exists() and int(restarts.read_text()) > before,
            timeout=timeout,
        )

    def container_pids(self, pod_uid: str, container: str | None = None) -> list[int]:
        """Host PIDs of the processes a pod's containers (or one of them) run, found by their
        cgroup: the kubelet names it after the pod's uid, and containerd after the container's
        id, which the pod's status gives."""
        ids: set[str] | None = None
        if container is not None:
            ids = set()
            pods = [p for p in self.get("/api/v1/pods")["items"] if p["metadata"]["uid"] == pod_uid]
            for pod in pods:
                for cs in (pod.get("status") or {}).get("containerStatuses") or ():
                    if cs["name"] == container and cs.get("containerID"):
                        ids.add(cs["containerID"].split("://", 1)[-1])
        pod_dir = "pod" + pod_uid
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                text = Path(f"/proc/{entry}/cgroup").read_text()
            except OSError:
                continue
            # One line per hierarchy; the memory one is enough (every container has one).
            for line in text.splitlines():
                parts = line.split(":", 2)
                if len(parts) == 3 and parts[1] == "memory":
                    segments = parts[2].split("/")
                    if pod_dir in segments and (ids is None or segments[-1] in ids):
                        pids.append(int(entry))
        return sorted(pids)


def _cri_text(line: str) -> str:
    """`2026-12-02T19:00:00.1Z stdout F text` -> `text` (the CRI log format)."""
    parts = line.split(" ", 3)
    return parts[3] if len(parts) == 4 else line
