"""Support for the operator's tests on the local cluster (and the operator benchmark): the
operator as a real process, real inference pods (the project's inference image serving the tiny
SD 1.5 model), adapters, and what the pods and the statuses say.

The pytest process has joined the cluster's network namespace (the `devcluster` fixture), so the
operator it starts, the origin server it runs (`tests.support.origin`) and the pods all reach
each other by IP.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from lora_demo import release
from lora_devcluster.harness import Harness
from lora_inference.tools.random_adapters import write_random_adapter

from tests.support.chart import KUBE_VERSION, REGISTRY_FLAGS
from tests.support.http import free_port, http_json

Obj = dict[str, Any]
TOKEN = "test-admin-token"
POD_VOLUME = "/var/lib/lora/adapters"
MODEL_NAME = "tiny-sd15"


@dataclass
class Operator:
    """`python -m lora_operator` as a child process: killed for real, restarted for real."""

    volume: Path
    namespaces: list[str]
    log_path: Path
    extra: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    prefix: list[str] = field(default_factory=list)  # e.g. nsenter into the cluster's mounts
    peering: str | None = None  # kopf's peering object: several replicas, one acts
    proc: subprocess.Popen[bytes] | None = None
    metrics_port: int = 0

    def start(self) -> Operator:
        self.metrics_port = free_port()
        mode = ["--peering", self.peering] if self.peering else ["--standalone"]
        args = [*self.prefix, sys.executable, "-m", "lora_operator", *mode]
        for ns in self.namespaces:
            args += ["--namespace", ns]
        args += [
            "--volume-root",
            str(self.volume),
            "--health-port",
            str(free_port()),
            "--metrics-port",
            str(self.metrics_port),
            "--resync-seconds",
            "5",
            # The tests' sources: an origin on this machine's 127.0.0.1, under any name.
            *("--source-host", "*", "--source-allow-cidr", "127.0.0.0/8"),
            *self.extra,
        ]
        env = {**os.environ, "LORA_ADMIN_TOKEN": TOKEN, **self.env}
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
        return self

    @contextlib.contextmanager
    def running(self) -> Iterator[Operator]:
        """Start it; stop it afterwards and print its log (pytest shows it for failed tests)."""
        self.start()
        try:
            yield self
        finally:
            self.stop()
            print("---- operator log\n" + self.log()[-30000:])

    def kill(self) -> None:
        """SIGKILL: nothing gets a chance to clean up."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> str:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())


def readable_by_pods(root: Path) -> None:
    """Make a host directory written by this (root) process readable by the pods' non-root
    user: safetensors files are written 0600."""
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)


def inference_deployment(
    image: str,
    name: str,
    replicas: int,
    model_dir: Path,
    volume: Path,
    labels: Obj | None = None,
    *,
    watched: bool = True,
    readiness: bool = True,
    model: str = MODEL_NAME,
) -> Obj:
    """Inference pods from the project's image, as the chart runs them (non-root, read-only
    root filesystem, /tmp on an emptyDir), with the model and the adapter volume from host
    directories. `watched=False` leaves out the label the operator finds pods by;
    `readiness=False` the readiness probe (the pod is Ready while its process runs); `model`
    names the folder under `model_dir` the pods serve."""
    pod_labels = {"app": name, **(labels or {})}
    if watched:
        pod_labels["lora.dev/inference"] = "true"
    deployment: Obj = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {
                    "labels": pod_labels,
                    "annotations": {
                        "lora.dev/port": "8000",
                        "lora.dev/adapter-root": POD_VOLUME,
                    },
                },
                "spec": {
                    "terminationGracePeriodSeconds": 2,
                    "volumes": [
                        {"name": "model", "hostPath": {"path": str(model_dir)}},
                        {"name": "adapters", "hostPath": {"path": str(volume)}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                    "containers": [
                        {
                            "name": "server",
                            "image": image,
                            "imagePullPolicy": "Never",
                            "securityContext": {
                                "runAsNonRoot": True,
                                "runAsUser": 65532,
                                "readOnlyRootFilesystem": True,
                                "allowPrivilegeEscalation": False,
                            },
                            "args": [
                                "serve",
                                "--model",
                                f"/models/{model}",
                                "--adapter-root",
                                f"{POD_VOLUME}/$(POD_NAMESPACE)",
                                "--device",
                                "cpu",
                                "--port",
                                "8000",
                                "--max-loras",
                                "2",
                                "--max-batch-size",
                                "1",
                            ],
                            "env": [
                                {
                                    "name": "POD_NAMESPACE",
                                    "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}},
                                },
                                {"name": "LORA_ADMIN_TOKEN", "value": TOKEN},
                            ],
                            "volumeMounts": [
                                {"name": "model", "mountPath": "/models", "readOnly": True},
                                {"name": "adapters", "mountPath": POD_VOLUME, "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                            "readinessProbe": {
                                "httpGet": {"path": "/ready", "port": 8000},
                                "periodSeconds": 1,
                            },
                        }
                    ],
                },
            },
        },
    }
    if not readiness:
        del deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    return deployment


def adapter(name: str, uri: str, **spec: Any) -> Obj:
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {"baseModel": MODEL_NAME, "source": {"uri": uri, **spec.pop("source", {})}, **spec},
    }


def get_adapter(h: Harness, ns: str, name: str) -> Obj | None:
    return h.get_or_none(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters/{name}")


def wait_phase(
    h: Harness, ns: str, name: str, phase: str, ready: str | None = None, timeout: float = 120
) -> Obj:
    def check() -> Obj | None:
        obj = get_adapter(h, ns, name)
        st = (obj or {}).get("status") or {}
        if st.get("phase") == phase and (ready is None or st.get("ready") == ready):
            return obj
        return None

    try:
        return h.wait_for(f"{ns}/{name} to be {phase} {ready or ''}", check, timeout=timeout)
    except AssertionError as e:
        obj = get_adapter(h, ns, name)
        raise AssertionError(f"{e}; status: {json.dumps((obj or {}).get('status'))}") from None


def models(ip: str) -> dict[str, Obj]:
    """`GET /v1/models` of the pod at `ip`: model or adapter name -> its card."""
    status, body = http_json(f"http://{ip}:8000/v1/models")
    assert status == 200, body
    return {c["id"]: c for c in body["data"]}


def revisions(volume: Path, ns: str, name: str) -> list[str]:
    d = volume / ns / name / "revisions"
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def event_notes(h: Harness, ns: str, name: str, type_: str | None = None) -> dict[str, list[str]]:
    """The Events about the object `name` in `ns`: reason -> their messages, oldest first."""
    items = sorted(
        h.get(f"/api/v1/namespaces/{ns}/events")["items"],
        key=lambda e: e["metadata"]["creationTimestamp"],  # the API lists them by name
    )
    out: dict[str, list[str]] = {}
    for e in items:
        if e["involvedObject"].get("name") == name and type_ in (None, e["type"]):
            out.setdefault(str(e["reason"]), []).append(str(e.get("message") or e.get("note")))
    return out


@dataclass(frozen=True)
class Models:
    root: Path  # mounted at /models in the pods
    pipe: Any  # the same tiny pipeline, to write adapters that fit it


def write_adapter(models: Models, directory: Path, seed: int) -> tuple[Path, str]:
    path = write_random_adapter(directory, models.pipe, base_model=MODEL_NAME, seed=seed)
    readable_by_pods(path)  # the tests also load sources directly on the pods
    weights = path / "pytorch_lora_weights.safetensors"
    return path, hashlib.sha256(weights.read_bytes()).hexdigest()


def pod_ips(h: Harness, ns: str, n: int) -> dict[str, str]:
    """Name -> IP of `n` ready inference pods (others, not ready, may be there too)."""
    pods = release.ready_pods(h, ns, "app=inference", n, timeout=180, all_ready=False)
    return {p["metadata"]["name"]: p["status"]["podIP"] for p in pods}


def holds(ip: str, name: str, sha: str) -> bool:
    card = models(ip).get(name)
    return card is not None and (card.get("root"), card.get("revision")) == (name, sha)


def adapter_names(prefix: str, k: int) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(k)]


def many_adapters(models: Models, volume: Path, ns: str, names: list[str]) -> list[Obj]:
    """LoRAAdapters for `names`, each from its own directory; four distinct weights files,
    hard-linked, so writing hundreds takes no time (the store keeps each content once)."""
    distinct = [
        write_adapter(models, volume / ns / "src" / f"distinct-{i}", seed=i)[0] for i in range(4)
    ]
    out = []
    for i, name in enumerate(names):
        directory = volume / ns / "src" / name
        directory.mkdir(parents=True, exist_ok=True)
        weights = directory / "pytorch_lora_weights.safetensors"
        if not weights.exists():
            os.link(distinct[i % 4] / "pytorch_lora_weights.safetensors", weights)
        out.append(adapter(name, str(directory)))
    return out


def adapters_ready(h: Harness, ns: str, names: list[str], ready: str) -> bool:
    items = h.get(f"/apis/lora.dev/v1alpha1/namespaces/{ns}/loraadapters")["items"]
    done = {
        i["metadata"]["name"]
        for i in items
        if (i.get("status") or {}).get("phase") == "Ready"
        and (i.get("status") or {}).get("ready") == ready
    }
    return set(names) <= done


PHASE_ORDER = {"Pending": 0, "Staging": 1, "Loading": 2, "Ready": 3}


class StatusRecorder:
    """Lists the LoRAAdapters of a namespace every `period` seconds in a thread and remembers
    each one's status over time, to check that none ever goes backwards."""

    def __init__(self, h: Harness, ns: str, period: float = 0.3) -> None:
        self.h, self.ns, self.period = h, ns, period
        self.seen: dict[str, list[tuple[str, int, int]]] = {}  # name -> (phase, ready, gen)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> StatusRecorder:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._sample()  # what the caller saw last is seen here too

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self._sample()

    def __enter__(self) -> StatusRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _sample(self) -> None:
        try:
            items = self.h.get(f"/apis/lora.dev/v1alpha1/namespaces/{self.ns}/loraadapters")
        except Exception:  # the API server restarting: the next round reads again
            return
        for item in items["items"]:
            st = item.get("status") or {}
            if "phase" not in st:
                continue
            sample = (
                st["phase"],
                int(st.get("readyPods") or 0),
                int(st.get("observedGeneration") or 0),
            )
            history = self.seen.setdefault(item["metadata"]["name"], [])
            if not history or history[-1] != sample:
                history.append(sample)

    def backwards(self) -> dict[str, list[tuple[str, int, int]]]:
        """The adapters whose phase, ready pods or observed generation ever went back."""
        out = {}
        for name, history in self.seen.items():
            for before, after in itertools.pairwise(history):
                if (
                    PHASE_ORDER.get(after[0], -1) < PHASE_ORDER.get(before[0], -1)
                    or after[1] < before[1]
                    or after[2] < before[2]
                ):
                    out[name] = history
        return out


def peering_crds(h: Harness) -> None:
    """kopf's peering CRDs, as the chart renders them for several operator replicas."""
    rendered = h.run(
        [
            *("helm", "template", "t", str(release.CHART), "--set", "operator.replicas=2"),
            *REGISTRY_FLAGS,
            *("--kube-version", KUBE_VERSION),
            *("--show-only", "templates/crds.yaml"),
        ]
    )
    crds = [
        d
        for d in yaml.safe_load_all(rendered)
        if d and d.get("kind") == "CustomResourceDefinition" and d["spec"]["group"] == "kopf.dev"
    ]
    h.apply(crds)
    for crd in crds:
        h.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd['metadata']['name']}", "--timeout=60s"
        )


def log_times(log: str, needle: str) -> list[datetime.datetime]:
    """When the operator logged lines containing `needle` (its log's asctime, local time)."""
    return [
        datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
        for line in log.splitlines()
        if needle in line and line[:4].isdigit()
    ]


def registrations(h: Harness, ns: str, pod: str) -> dict[str, int]:
    """How many times the pod's server registered each adapter (its log says so each time)."""
    counts: dict[str, int] = {}
    for line in h.kubectl("logs", "-n", ns, pod).splitlines():
        marker = "registered adapter "
        if marker in line and not line.split(marker, 1)[0].endswith("un"):
            name = line.split(marker, 1)[1].split()[0]
            counts[name] = counts.get(name, 0) + 1
    return counts
