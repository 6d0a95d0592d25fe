"""What the demo and the end-to-end suite put on a cluster, as manifests and chart values.

Everything is prepared *in* the cluster by the project's own inference image: a Job writes a
model onto a claim and adapter sources onto the adapter volume, so the same steps work on the
local cluster and on kind (or any cluster that can run the images), with no host path and no
torch on the machine that drives them. Two models: the demo's small trained SD 1.5-family model
and its trained adapters, which the inference image carries (`lora_inference.tools.shapes`), and
a tiny random one with random adapters for the tests, which only need images that differ.

Owns: the Job that prepares volumes, the chart values for a CPU cluster, the pod that generates
through a Service's DNS name, and the demo's adapters. Pure: builds dicts, does no I/O.
"""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import PurePosixPath
from typing import Any

from lora_devcluster.images import catalog
from lora_volume import layout

Obj = dict[str, Any]

RELEASE = "lora-operator"  # the chart's fullname is then the release name
SERVICE = f"{RELEASE}-inference"
ADAPTER_CLAIM = f"{RELEASE}-adapters"  # the claim the chart creates for the adapter volume
MODEL_CLAIM = "models"
MODEL_NAME = "tiny-sd15"  # the tests' model: random weights, built by the Job
TINY_MODELS = {MODEL_NAME: "sd15", "tiny-sdxl": "sdxl"}  # tiny models by name -> their family
DEMO_MODEL = "shapes-sd15"  # the demo's model: trained, copied from the inference image
SHAPES_IN_IMAGE = PurePosixPath("/opt/lora/shapes")  # where docker/inference.Dockerfile puts it
MODELS_MOUNT = PurePosixPath("/models")
VOLUME_ROOT = PurePosixPath("/var/lib/lora/adapters")  # the chart's default volumeRoot
INFERENCE_LABELS = "app.kubernetes.io/component=inference"
PROMPT = "a lighthouse on a cliff at dusk"
DEMO_PROMPTS = ("a red circle", "a blue square", "a yellow triangle")  # what the demo model knows
# The chart's images as `lora-devcluster up` imported them into the node, under the names
# `make images` built them with (containerd spells Docker Hub's default out): never pulled, so
# a node without them fails the pod instead of fetching a stranger's image of that name. The
# chart has no default registry (`image.registry`), so every local install names them.
LOCAL_IMAGES: dict[str, Obj] = {
    role: {"repository": f"docker.io/{repository}", "pullPolicy": "Never"}
    for role, (_, repository) in catalog.DOCKERFILE_IMAGES.items()
}
NON_ROOT = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
}


@dataclasses.dataclass(frozen=True)
class AdapterSource:
    """An adapter source written to `<volume>/<folder>/<name>`: one of the demo model's trained
    adapters (`trained`, copied from the image), or a random one for the tiny model, strong enough
    that the difference shows on a random model and no stronger: far stronger random weights make
    the tiny model chaotic, and a pod that merges a layer another runs as a branch would then
    draw another picture (docs/architecture.md, "The same image on every path")."""

    name: str
    seed: int = 0
    text_encoder: bool = False
    folder: str = layout.SHARED  # the volume folder every namespace's adapters may copy from
    rank: int = 8
    strength: float = 0.3
    trained: bool = False
    base: str = MODEL_NAME  # the tiny model a random adapter is made for (TINY_MODELS)

    @property
    def uri(self) -> str:
        """The source URI as the operator sees it (a path under the chart's volumeRoot)."""
        return str(VOLUME_ROOT / self.folder / self.name)

    @property
    def model(self) -> str:
        """The base model the adapter was made for."""
        return DEMO_MODEL if self.trained else self.base


# A palette, a texture and a shape: each visibly changes what the demo model draws.
DEMO_ADAPTERS = (
    AdapterSource("pixel-art", trained=True),
    AdapterSource("palette-swap", trained=True),
    AdapterSource("shape-shift", trained=True),
)
# A LoRAAdapter that stacks the two above (spec.compose), each at its own scale.
DEMO_COMPOSITION = ("pixel-palette", (("pixel-art", 0.8), ("palette-swap", 0.8)))


def model_claim(size: str = "1Gi") -> Obj:
    """A claim for the model, from the cluster's default StorageClass."""
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": MODEL_CLAIM},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": size}}},
    }


def _copy(source: PurePosixPath, target: str) -> str:
    # Replaces a copy already there: cp -R into an existing folder would nest the new one.
    into, there = shlex.quote(str(PurePosixPath(target).parent)), shlex.quote(target)
    return f"mkdir -p {into} && rm -rf {there} && cp -R {shlex.quote(str(source))} {there}"


def _prepare_model(model: str) -> str:
    """The command that puts `model` into its folder on the model claim."""
    if model == DEMO_MODEL:
        return _copy(SHAPES_IN_IMAGE / DEMO_MODEL, str(MODELS_MOUNT / DEMO_MODEL))
    if model in TINY_MODELS:
        arch = TINY_MODELS[model]
        return shlex.join(
            ["lora-inference", "tiny-model", str(MODELS_MOUNT / model), "--arch", arch]
        )
    choices = ", ".join([*TINY_MODELS, DEMO_MODEL])
    raise ValueError(f"no way to prepare model {model!r}; choose one of {choices}")


def _prepare_adapter(a: AdapterSource) -> str:
    """The command that writes source `a` onto the adapter claim."""
    if a.trained:
        return _copy(SHAPES_IN_IMAGE / "adapters" / a.name, a.uri)
    command = ["lora-inference", "make-adapter", a.uri, "--model", str(MODELS_MOUNT / a.model)]
    command += ["--rank", str(a.rank), "--strength", str(a.strength), "--seed", str(a.seed)]
    return shlex.join(command + (["--text-encoder"] if a.text_encoder else []))


def prepare_job(
    name: str,
    image: str,
    *,
    model: str | None,
    adapters: tuple[AdapterSource, ...] = (),
    adapter_claim: str = ADAPTER_CLAIM,
) -> Obj:
    """A Job running the inference image's own tools: `model` onto the model claim (when
    given), then each adapter source onto the adapter claim."""
    commands = [_prepare_model(model)] if model is not None else []
    commands += [_prepare_adapter(a) for a in adapters]
    script = "set -e\n" + "\n".join(commands)
    mounts = [
        {"name": "models", "mountPath": str(MODELS_MOUNT), "readOnly": model is None},
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


def local_values(namespace: str, *, replicas: int, model: str = MODEL_NAME) -> Obj:
    """Chart values for a CPU cluster: the images imported into its node (LOCAL_IMAGES),
    `model` from its claim, small caches, fast probes, the operator watching only `namespace`.
    The adapter volume is the chart's own claim from the default StorageClass. The CRD is
    applied with kubectl (it belongs to no release)."""
    return {
        "crds": {"enabled": False},
        # One node: ReadWriteOnce serves every pod, and every provisioner offers it (kind's
        # local-path offers nothing else).
        "adapterVolume": {"accessModes": ["ReadWriteOnce"]},
        "operator": {
            "image": dict(LOCAL_IMAGES["operator"]),
            "watchNamespaces": [namespace],
            "resyncSeconds": 5,
        },
        "inference": {
            "image": dict(LOCAL_IMAGES["inference"]),
            "replicas": replicas,
            "servedModelName": model,
            "model": {"existingClaim": MODEL_CLAIM, "path": str(MODELS_MOUNT / model)},
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
        "spec": {"baseModel": source.model, "source": {"uri": source.uri}, "scale": scale},
    }


def composition(name: str, members: tuple[tuple[str, float], ...], model: str) -> Obj:
    return {
        "apiVersion": "lora.dev/v1alpha1",
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": {
            "baseModel": model,
            "compose": [{"name": member, "scale": scale} for member, scale in members],
        },
    }


def generation_request(
    model: str, *, size: int = 64, steps: int = 10, seed: int = 42, prompt: str = PROMPT
) -> Obj:
    return {
        "model": model,
        "prompt": prompt,
        "size": f"{size}x{size}",
        "num_inference_steps": steps,
        "seed": seed,
    }


# A refused connection is tried again for a minute: a new pod is refused by the namespace's
# NetworkPolicies until the cluster's enforcer has added its address to what they allow.
GENERATE_SCRIPT = """
import json, sys, time, urllib.error, urllib.request
url, body = sys.argv[1], sys.argv[2]
req = urllib.request.Request(url, data=body.encode(), headers={"Content-Type": "application/json"})
for attempt in range(60):
    try:
        r = urllib.request.urlopen(req, timeout=300)
        break
    except urllib.error.URLError as e:
        if not isinstance(e.reason, ConnectionRefusedError) or attempt == 59:
            raise
        time.sleep(1)
with r:
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
