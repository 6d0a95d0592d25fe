"""What the demo and the end-to-end suite put on a cluster, as manifests and chart values.

Everything is prepared *in* the cluster by the project's own inference image: a Job writes the
tiny SD 1.5 model onto a claim and random adapter sources onto the adapter volume, so the same
steps work on the local cluster and on kind (or any cluster that can run the images), with no
host path and no torch on the machine that drives them.

Owns: the Job that prepares volumes, the chart values for a CPU cluster, the pod that generates
through a Service's DNS name, and the demo's adapters. Pure: builds dicts, does no I/O.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from lora_volume import layout

Obj = dict[str, Any]

RELEASE = "lora-operator"  # the chart's fullname is then the release name
SERVICE = f"{RELEASE}-inference"
ADAPTER_CLAIM = f"{RELEASE}-adapters"  # the claim the chart creates for the adapter volume
MODEL_CLAIM = "models"
MODEL_NAME = "tiny-sd15"
MODELS_MOUNT = PurePosixPath("/models")
VOLUME_ROOT = PurePosixPath("/var/lib/lora/adapters")  # the chart's default volumeRoot
INFERENCE_LABELS = "app.kubernetes.io/component=inference"
PROMPT = "a lighthouse on a cliff at dusk"
NON_ROOT = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """A random adapter for the tiny model, written to `<volume>/<folder>/<name>`. Strong
    weights, so the difference shows even on a random model."""

    name: str
    seed: int
    text_encoder: bool = False
    folder: str = layout.SHARED  # the volume folder every namespace's adapters may copy from
    rank: int = 8
    strength: float = 0.8

    @property
    def uri(self) -> str:
        """The source URI as the operator sees it (a path under the chart's volumeRoot)."""
        return str(VOLUME_ROOT / self.folder / self.name)


DEMO_ADAPTERS = (
    AdapterSource("pixel-art", seed=1),
    AdapterSource("watercolor", seed=2, text_encoder=True),
)
# A LoRAAdapter that stacks the two above (spec.compose), each at its own scale.
DEMO_COMPOSITION = ("pixel-watercolor", (("pixel-art", 0.8), ("watercolor", 0.5)))


def model_claim(size: str = "1Gi") -> Obj:
    """A claim for the model, from the cluster's default StorageClass."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": MODEL_CLAIM},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def prepare_job(
    name: str,
    image: str,
    *,
    model: bool,
    adapters: tuple[AdapterSource, ...] = (),
    adapter_claim: str = ADAPTER_CLAIM,
) -> Obj:
    """A Job running the inference image's own tools: `tiny-model` onto the model claim (when
    `model`), then `make-adapter` for each source onto the adapter claim."""
    model_dir = MODELS_MOUNT / MODEL_NAME
    commands = []
    if model:
        commands.append(["lora-inference", "tiny-model", str(model_dir), "--arch", "sd15"])
    for a in adapters:
        command = ["lora-inference", "make-adapter", a.uri, "--model", str(model_dir)]
        command += ["--rank", str(a.rank), "--strength", str(a.strength), "--seed", str(a.seed)]
        commands.append(command + (["--text-encoder"] if a.text_encoder else []))
    script = "set -e\n" + "\n".join(shlex.join(c) for c in commands)
    mounts = [
        {"name": "models", "mountPath": str(MODELS_MOUNT), "readOnly": not model},
        {"name": "tmp", "mountPath": "/tmp"},
    ]
    volumes: list[Obj] = [
        {"name": "models", "persistentVolumeClaim": {"claimName": MODEL_CLAIM}},
        {"name": "tmp", "emptyDir": {}},
    ]
    if adapters:
        mounts.append({"name": "adapters", "mountPath": str(VOLUME_ROOT)})
        volumes.append({"name": "adapters", "persistentVolumeClaim": {"claimName": adapter_claim}})
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "prepare",
                            "image": image,
                            "imagePullPolicy": "IfNotPresent",
                            "command": ["sh", "-c", script],
                            "securityContext": NON_ROOT,
                            "volumeMounts": mounts,
                        }
                    ],
                    "volumes": volumes,
                }
            },
        },
    }


def local_values(namespace: str, *, replicas: int) -> Obj:
    """Chart values for a CPU cluster: the tiny model from its claim, small caches, fast probes,
    the operator watching only `namespace`. The adapter volume is the chart's own claim from
    the default StorageClass. The CRD is applied with kubectl (it belongs to no release)."""
    return {
        "crds": {"enabled": False},
        # One node: ReadWriteOnce serves every pod, and every provisioner offers it (kind's
        # local-path offers nothing else).
        "adapterVolume": {"accessModes": ["ReadWriteOnce"]},
        "operator": {"watchNamespaces": [namespace], "resyncSeconds": 5},
        "inference": {
            "replicas": replicas,
            "servedModelName": MODEL_NAME,
            "model": {"existingClaim": MODEL_CLAIM, "path": str(MODELS_MOUNT / MODEL_NAME)},
            "device": "cpu",
            "dtype": "float32",
            "gpu": {"enabled": False},
            "maxLoras": 2,
            "maxCpuLoras": 4,
            "maxBatchSize": 1,
            "maxQueue": 8,
            "readinessProbe": {"initialDelaySeconds": 1, "periodSeconds": 1, "failureThreshold": 3},
            "terminationGracePeriodSeconds": 5,
        },
    }


def adapter(source: AdapterSource, scale: float = 0.8) -> Obj:
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": source.name},
        "spec": {"baseModel": MODEL_NAME, "source": {"uri": source.uri}, "scale": scale},
    }


def composition(name: str, members: tuple[tuple[str, float], ...]) -> Obj:
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {
            "baseModel": MODEL_NAME,
            "compose": [{"name": member, "scale": scale} for member, scale in members],
        },
    }


def generation_request(model: str, *, size: int = 64, steps: int = 10, seed: int = 42) -> Obj:
    return {
        "model": model,
        "prompt": PROMPT,
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "seed": seed,
    }


GENERATE_SCRIPT = """
import json, sys, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=300) as r:
    images = json.loads(r.read())["data"]
print(json.dumps({"status": r.status, "images": len(images), "seed": images[0].get("seed")}))
"""


def generation_pod(name: str, image: str, url: str, request: Obj) -> Obj:
    """A pod that POSTs one generation to `url` (e.g. a Service's DNS name) from inside the
    cluster and prints a one-line JSON summary to its log."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "client",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", GENERATE_SCRIPT, url, json.dumps(request)],
                    "securityContext": NON_ROOT,
                }
            ],
        },
    }


def service_url(namespace: str, path: str, service: str = SERVICE) -> str:
    return f"http://{service}.{namespace}.svc.cluster.local{path}"
