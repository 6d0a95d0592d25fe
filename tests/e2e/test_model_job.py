"""examples/model-sdxl.yaml's download Job, run in the cluster against a Hub stand-in.

The stand-in (tests/support/hubstandin.py, mounted from a ConfigMap and run by the inference
image's Python) serves a tiny diffusers pipeline that an init container writes with the image's
own `lora-inference tiny-model`, plus one file for each of the example's exclude patterns, and
requires a bearer token. The example is applied changed only where this cluster differs
(tests/support/modeljob.py): the image (the node's, never pulled), the claim's storage class and
access mode (one node), HF_ENDPOINT (the stand-in's Service) and the repository and folder (the
tiny one's). The token reaches the Job as the docs tell a user to give it: the Secret `hf-token`,
key `token`.

The same Job with the image's HF_HUB_OFFLINE=1 must fail, all its tries, quickly, and reach
nothing: the control that shows a Complete Job means a download from the stand-in. After the
real one, the files on the claim must be the stand-in's byte for byte (sha256), the excluded ones
absent, the stand-in's access log must show each file fetched, and the folder must load as the
server loads its model.
"""

from __future__ import annotations

import json
import re
from typing import Any

from lora_demo import release
from lora_demo.manifests import NON_ROOT
from lora_devcluster.harness import Harness
from lora_devcluster.nodeconfig import STORAGE_CLASS

from tests.support import ROOT, modeljob

Obj = dict[str, Any]

REPO_ID = "lora-test/tiny-sd15"
FOLDER = "tiny-sd15"
HUB = "hub"  # the stand-in's pod and Service
HUB_TOKEN = "hf_e2e_token"
REPO_ROOT = "/repo"
STANDIN = ROOT / "tests" / "support" / "hubstandin.py"
# One file for each of the example's exclude patterns (tests/unit/support/test_hubstandin.py
# holds the same list to the patterns).
EXTRAS = (
    "unet/diffusion_pytorch_model.fp16.safetensors",
    "text_encoder/model.onnx",
    "unet/diffusion_flax_model.msgpack",
    "unet/diffusion_pytorch_model.bin",
    "sd_xl_base_1.0.safetensors",
    "text_encoder/openvino_model.xml",
)

# {relative path: sha256} of every file under a folder, hidden ones (.cache/) left out.
HASH_SCRIPT = """
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
for d, dirs, files in os.walk(root):
    dirs[:] = [x for x in dirs if not x.startswith(".")]
    for f in files:
        p = os.path.join(d, f)
        out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
print(json.dumps(out, sort_keys=True))
"""

# The hashes, then the folder loaded as the server loads its model (on the CPU).
CHECK_SCRIPT = (
    HASH_SCRIPT
    + """
from pathlib import Path
import torch
from lora_inference.pipeline import DiffusionBackend
backend = DiffusionBackend.load(Path(root), device="cpu", dtype=torch.float32, slots=1)
print(json.dumps({"family": backend.family}))
"""
)


def _hub_manifests(image: str) -> list[Obj]:
    write_repo = [f"lora-inference tiny-model {REPO_ROOT}/{FOLDER} --arch sd15"]
    write_repo += [
        f"mkdir -p $(dirname {REPO_ROOT}/{FOLDER}/{x}) && "
        f"head -c 64 /dev/urandom > {REPO_ROOT}/{FOLDER}/{x}"
        for x in EXTRAS
    ]
    mounts = [{"name": "repo", "mountPath": REPO_ROOT}, {"name": "tmp", "mountPath": "/tmp"}]
    labels = {"app.kubernetes.io/name": HUB}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": "hub-standin"},
            "data": {"hubstandin.py": STANDIN.read_text()},
        },
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "hub-token"},
            "stringData": {"token": HUB_TOKEN},
        },
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": HUB, "labels": labels},
            "spec": {
                "automountServiceAccountToken": False,
                "restartPolicy": "Never",
                "initContainers": [
                    {
                        "name": "write-repo",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "command": ["sh", "-c", "set -e\n" + "\n".join(write_repo)],
                        "securityContext": NON_ROOT,
                        "volumeMounts": mounts,
                    }
                ],
                "containers": [
                    {
                        "name": "hub",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "command": [
                            "python",
                            "/standin/hubstandin.py",
                            f"--folder={REPO_ROOT}/{FOLDER}",
                            f"--repo-id={REPO_ID}",
                            "--port=8080",
                            "--token-file=/token/token",
                        ],
                        "ports": [{"name": "http", "containerPort": 8080}],
                        "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1},
                        "securityContext": NON_ROOT,
                        "volumeMounts": [
                            *mounts,
                            {"name": "standin", "mountPath": "/standin", "readOnly": True},
                            {"name": "token", "mountPath": "/token", "readOnly": True},
                        ],
                    }
                ],
                "volumes": [
                    {"name": "repo", "emptyDir": {}},
                    {"name": "tmp", "emptyDir": {}},
                    {"name": "standin", "configMap": {"name": "hub-standin"}},
                    {"name": "token", "secret": {"secretName": "hub-token"}},
                ],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": HUB},
            "spec": {
                "selector": labels,
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}],
            },
        },
    ]


def _outcome(h: Harness, ns: str, name: str, timeout: float) -> Obj:
    """The Job's status once it has the condition Complete or Failed (True)."""

    def finished() -> Obj | None:
        status: Obj = h.get(f"/apis/batch/v1/namespaces/{ns}/jobs/{name}").get("status") or {}
        done = {c["type"] for c in status.get("conditions") or () if c["status"] == "True"}
        return status if done & {"Complete", "Failed"} else None

    return h.wait_for(f"job {ns}/{name} to complete or fail", finished, timeout=timeout)


def _conditions(status: Obj) -> set[str]:
    return {c["type"] for c in status.get("conditions") or () if c["status"] == "True"}


def _hub_log(h: Harness, ns: str) -> str:
    return h.kubectl("logs", "-n", ns, HUB, "-c", "hub", check=False)


def test_the_example_job_downloads_from_a_hub_in_the_cluster(e2e: tuple[Harness, str]) -> None:
    h, ns = e2e
    image = h.image("inference")
    docs = modeljob.example()
    job = modeljob.of_kind(docs, "Job")
    endpoint = f"http://{HUB}.{ns}.svc.cluster.local"

    # The stand-in, and the token as the docs have the user create it.
    h.apply(_hub_manifests(image), ns)
    h.kubectl(
        "create", "secret", "generic", "hf-token", f"--from-literal=token={HUB_TOKEN}", "-n", ns
    )
    h.apply(modeljob.claim_for(docs, STORAGE_CLASS if h.is_local else None, "ReadWriteOnce"), ns)
    h.wait_for(
        "the Hub stand-in to be Ready",
        lambda: release.is_ready(h.get(f"/api/v1/namespaces/{ns}/pods/{HUB}")),
        timeout=300,
    )
    (served,) = [json.loads(line) for line in _hub_log(h, ns).splitlines() if line.startswith("{")]
    assert served["repo_id"] == REPO_ID and served["files"] > len(EXTRAS), served

    # The control: the image's offline default fails every try, at once, and reaches nothing.
    offline = modeljob.retargeted(
        job,
        repo_id=REPO_ID,
        folder=FOLDER,
        endpoint=endpoint,
        image=image,
        env={"HF_HUB_OFFLINE": "1"},
    )
    offline["metadata"]["name"] = f"{modeljob.JOB_NAME}-offline"
    h.apply(offline, ns)
    status = _outcome(h, ns, offline["metadata"]["name"], timeout=240)
    assert "Failed" in _conditions(status), status
    assert status.get("failed") == job["spec"]["backoffLimit"] + 1, status
    log = h.kubectl("logs", "-n", ns, f"job/{offline['metadata']['name']}", check=False)
    assert "offline mode is enabled" in log, log
    assert f"/{REPO_ID}/" not in _hub_log(h, ns)

    # The example's Job, online: Complete within a few minutes.
    online = modeljob.retargeted(
        job, repo_id=REPO_ID, folder=FOLDER, endpoint=endpoint, image=image
    )
    assert online["metadata"]["name"] == modeljob.JOB_NAME
    h.apply(online, ns)
    status = _outcome(h, ns, modeljob.JOB_NAME, timeout=300)
    log = h.kubectl("logs", "-n", ns, f"job/{modeljob.JOB_NAME}", check=False)
    assert "Complete" in _conditions(status), (status, log)

    # What the stand-in holds, what it was asked for, and what is on the claim.
    hub_files = json.loads(
        h.kubectl(
            "exec",
            "-n",
            ns,
            HUB,
            "-c",
            "hub",
            "--",
            "python",
            "-c",
            HASH_SCRIPT,
            f"{REPO_ROOT}/{FOLDER}",
        )
    )
    expected = {p: sha for p, sha in hub_files.items() if p not in EXTRAS}
    assert set(hub_files) - set(expected) == set(EXTRAS), sorted(hub_files)
    hub_log = _hub_log(h, ns)
    for path in expected:
        fetched = rf'"GET /{re.escape(REPO_ID)}/resolve/\w+/{re.escape(path)} HTTP/1\.1" 200 '
        assert re.search(fetched, hub_log), (path, hub_log[-3000:])

    check = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "check-model"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "check",
                            "image": image,
                            "imagePullPolicy": "Never",
                            "command": ["python", "-c", CHECK_SCRIPT, f"/models/{FOLDER}"],
                            "securityContext": NON_ROOT,
                            "volumeMounts": [
                                {"name": "models", "mountPath": "/models", "readOnly": True},
                                {"name": "tmp", "mountPath": "/tmp"},
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "models", "persistentVolumeClaim": {"claimName": "models"}},
                        {"name": "tmp", "emptyDir": {}},
                    ],
                }
            },
        },
    }
    # The download Job's pod has finished, so the one-node claim is free for the check's.
    out = release.run_job(h, ns, check, timeout=300)
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    on_claim, loaded = lines[0], lines[-1]
    assert on_claim == expected, {
        "missing": sorted(set(expected) - set(on_claim)),
        "extra": sorted(set(on_claim) - set(expected)),
        "different": sorted(p for p in expected if on_claim.get(p) not in (None, expected[p])),
    }
    assert loaded == {"family": "StableDiffusionPipeline"}, out
