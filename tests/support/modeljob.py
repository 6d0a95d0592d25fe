"""examples/model-sdxl.yaml's download Job, read from the file and pointed elsewhere with as
few changes as possible (pure): another repository and folder, a Hub stand-in's endpoint, the
cluster's image and storage class. The unit test runs its command and environment against the
Hub stand-in (tests/support/hubstandin.py); the end-to-end test applies it to a cluster."""

from __future__ import annotations

import copy
from pathlib import PurePosixPath
from typing import Any

import yaml

from tests.support import ROOT

EXAMPLE = ROOT / "examples" / "model-sdxl.yaml"
JOB_NAME = "prepare-model-sdxl"
REPO_ID = "stabilityai/stable-diffusion-xl-base-1.0"
LOCAL_DIR = "/models/stable-diffusion-xl-base-1.0"

Obj = dict[str, Any]


def example() -> list[Obj]:
    """The example's objects (the claim, then the Job), as written."""
    return [d for d in yaml.safe_load_all(EXAMPLE.read_text()) if d]


def of_kind(docs: list[Obj], kind: str) -> Obj:
    (obj,) = [d for d in docs if d["kind"] == kind]
    return obj


def container(job: Obj) -> Obj:
    c: Obj
    (c,) = job["spec"]["template"]["spec"]["containers"]
    return c


def excludes(job: Obj) -> list[str]:
    """The Job's `--exclude=` patterns, in order."""
    prefix = "--exclude="
    return [a[len(prefix) :] for a in container(job)["command"] if a.startswith(prefix)]


def literal_env(job: Obj) -> dict[str, str]:
    """The Job's environment variables with a literal value (not those from a Secret)."""
    return {e["name"]: e["value"] for e in container(job)["env"] if "value" in e}


def command_for(job: Obj, repo_id: str, local_dir: str) -> list[str]:
    """The Job's command with the repository and the folder replaced, the rest as written."""
    command = list(container(job)["command"])
    if command[:2] != ["hf", "download"] or command[2] != REPO_ID:
        raise AssertionError(f"the example's command changed shape: {command}")
    replaced = [repo_id if a == REPO_ID else a for a in command]
    flag = f"--local-dir={LOCAL_DIR}"
    if flag not in replaced:
        raise AssertionError(f"the example's command has no {flag}: {command}")
    return [f"--local-dir={local_dir}" if a == flag else a for a in replaced]


def retargeted(
    job: Obj,
    *,
    repo_id: str,
    folder: str,
    endpoint: str,
    image: str,
    env: dict[str, str] | None = None,
) -> Obj:
    """A copy of the Job that downloads `repo_id` into `/models/<folder>` from `endpoint` with
    `image` (never pulled: the node has it), `env` overriding the literal values. Nothing else
    changes: the token from the optional Secret, the pull secret, the deadline and the tries
    stay as the example has them."""
    job = copy.deepcopy(job)
    c = container(job)
    c["command"] = command_for(job, repo_id, str(PurePosixPath("/models") / folder))
    c["image"] = image
    c["imagePullPolicy"] = "Never"
    values = {"HF_ENDPOINT": endpoint, **(env or {})}
    for e in c["env"]:
        if e["name"] in values:
            e["value"] = values.pop(e["name"])
    c["env"] += [{"name": k, "value": v} for k, v in values.items()]
    return job


def claim_for(docs: list[Obj], storage_class: str | None, access: str) -> Obj:
    """The example's claim on another storage class (None: the cluster's default) and access
    mode (a one-node cluster has no ReadWriteMany class)."""
    claim = copy.deepcopy(of_kind(docs, "PersistentVolumeClaim"))
    if storage_class is None:
        claim["spec"].pop("storageClassName", None)
    else:
        claim["spec"]["storageClassName"] = storage_class
    claim["spec"]["accessModes"] = [access]
    claim["spec"]["resources"]["requests"]["storage"] = "1Gi"
    return claim
