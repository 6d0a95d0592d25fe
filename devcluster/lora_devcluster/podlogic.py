"""The process kubelet's decisions, purely computational: no I/O, no clock, no processes.

Owns: image -> command mapping, environment resolution (env, envFrom, valueFrom, $(VAR)
expansion), volume file projection and mount lists, restart policy and back-off, named ports,
and building the pod status the kubelet patches.
Must not: read files, start processes or talk to the API server (the kubelet module does that
with what these functions decide).
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import re
from collections.abc import Mapping, Sequence
from pathlib import PurePosixPath
from typing import Any

Obj = dict[str, Any]


class ContainerConfigError(Exception):
    """The pod asks for something this kubelet cannot provide yet (a missing ConfigMap key, an
    unmapped image, ...). Reported as the container's waiting reason; retried later."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# ---------------------------------------------------------------- image -> command


@dataclasses.dataclass(frozen=True)
class ImageEntry:
    """What a container image stands for on this machine: its ENTRYPOINT and default CMD."""

    pattern: str
    entrypoint: tuple[str, ...]
    cmd: tuple[str, ...] = ()


def parse_image_map(raw: Mapping[str, Any]) -> list[ImageEntry]:
    """`{"glob": ["argv", ...]}` or `{"glob": {"entrypoint": [...], "cmd": [...]}}`."""
    entries = []
    for pattern, value in raw.items():
        if isinstance(value, list):
            entries.append(ImageEntry(pattern, tuple(str(v) for v in value)))
        elif isinstance(value, dict) and isinstance(value.get("entrypoint"), list):
            entries.append(
                ImageEntry(
                    pattern,
                    tuple(str(v) for v in value["entrypoint"]),
                    tuple(str(v) for v in value.get("cmd") or []),
                )
            )
        else:
            raise ValueError(
                f"image map entry {pattern!r}: expected a list of arguments or "
                f"{{'entrypoint': [...], 'cmd': [...]}}, got {value!r}"
            )
    return entries


def build_argv(
    image_map: list[ImageEntry], image: str, command: list[str] | None, args: list[str] | None
) -> list[str]:
    """Kubernetes' ENTRYPOINT/CMD rules with a mapped image: `command` replaces the entrypoint
    (and drops the default CMD), `args` replaces the CMD. An unmapped image needs `command`."""
    entry = next((e for e in image_map if fnmatch.fnmatchcase(image, e.pattern)), None)
    if command:
        return list(command) + list(args or [])
    if entry is None:
        raise ContainerConfigError(
            "ErrImageNeverPull",
            f"image {image!r} is not mapped to a local command: set the container's `command`, "
            "or add the image to the devcluster image map (--image-map / "
            "LORA_DEVCLUSTER_IMAGE_MAP)",
        )
    return list(entry.entrypoint) + (list(args) if args is not None else list(entry.cmd))


# ---------------------------------------------------------------- environment

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand_vars(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, unknown ones stay as written,
    `$$` escapes a dollar."""

    def repl(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR_REF.sub(repl, value)


@dataclasses.dataclass(frozen=True)
class PodContext:
    """What the downward API and env resolution may read about a pod."""

    pod: Obj
    pod_ip: str
    host_ip: str
    configmaps: Mapping[str, Mapping[str, str]]  # name -> data (namespace of the pod)
    secrets: Mapping[str, Mapping[str, bytes]]  # name -> decoded data


def _field_ref(path: str, ctx: PodContext) -> str:
    meta = ctx.pod.get("metadata", {})
    spec = ctx.pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": ctx.pod_ip,
        "status.podIPs": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
        "status.hostIPs": ctx.host_ip,
    }
    if path in simple:
        return str(simple[path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise ContainerConfigError("CreateContainerConfigError", f"unsupported fieldRef {path!r}")


def _lookup(
    kind: str, store: Mapping[str, Mapping[str, Any]], ref: Obj
) -> Mapping[str, Any] | None:
    name = ref.get("name", "")
    if name in store:
        return store[name]
    if ref.get("optional"):
        return None
    raise ContainerConfigError("CreateContainerConfigError", f'{kind} "{name}" not found')


def _decode(value: str | bytes) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def build_env(container: Obj, ctx: PodContext, base: Mapping[str, str]) -> dict[str, str]:
    """The container's environment: `base` (PATH etc.), then envFrom, then env in order, each
    value expanding $(VAR) against what came before."""
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        data: Mapping[str, Any] | None = None
        if "configMapRef" in source:
            data = _lookup("configmap", ctx.configmaps, source["configMapRef"])
        elif "secretRef" in source:
            data = _lookup("secret", ctx.secrets, source["secretRef"])
        for key, value in (data or {}).items():
            env[prefix + key] = _decode(value)
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand_vars(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            env[name] = _field_ref(vf["fieldRef"]["fieldPath"], ctx)
        elif "configMapKeyRef" in vf or "secretKeyRef" in vf:
            is_cm = "configMapKeyRef" in vf
            ref = vf["configMapKeyRef"] if is_cm else vf["secretKeyRef"]
            store: Mapping[str, Mapping[str, Any]] = ctx.configmaps if is_cm else ctx.secrets
            found = _lookup("configmap" if is_cm else "secret", store, ref)
            if found is None:
                continue
            if ref["key"] not in found:
                if ref.get("optional"):
                    continue
                raise ContainerConfigError(
                    "CreateContainerConfigError",
                    f"couldn't find key {ref['key']} in {'ConfigMap' if is_cm else 'Secret'} "
                    f"{ctx.pod['metadata'].get('namespace')}/{ref['name']}",
                )
            env[name] = _decode(found[ref["key"]])
        elif "resourceFieldRef" in vf:
            # No resource accounting here; "0" tells a program there is no declared limit.
            env[name] = "0"
        else:
            raise ContainerConfigError(
                "CreateContainerConfigError", f"unsupported valueFrom for {name}: {vf}"
            )
    return env


def decode_secret_data(secret: Obj) -> dict[str, bytes]:
    data = {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}
    data.update({k: v.encode() for k, v in (secret.get("stringData") or {}).items()})
    return data


# ---------------------------------------------------------------- volumes


def build_projected_files(
    data: Mapping[str, str | bytes], items: list[Obj] | None, what: str
) -> dict[str, bytes]:
    """Files of a ConfigMap/Secret volume: every key, or only `items` (key -> path)."""
    if not items:
        return {k: v if isinstance(v, bytes) else v.encode() for k, v in data.items()}
    out = {}
    for item in items:
        if item["key"] not in data:
            raise ContainerConfigError(
                "CreateContainerConfigError", f"{what}: key {item['key']!r} not found"
            )
        value = data[item["key"]]
        out[item["path"]] = value if isinstance(value, bytes) else value.encode()
    for path in out:
        if path.startswith("/") or ".." in path.split("/"):
            raise ContainerConfigError("CreateContainerConfigError", f"{what}: bad path {path!r}")
    return out


@dataclasses.dataclass(frozen=True)
class Mount:
    source: str
    target: str
    readonly: bool


def build_mounts(
    container: Obj, volume_paths: Mapping[str, str], read_only: set[str]
) -> list[Mount]:
    """Bind mounts for the container's volumeMounts, given where each pod volume lives on the
    host. `read_only` names volumes that are always read-only (ConfigMap, Secret)."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        name = vm["name"]
        if name not in volume_paths:
            raise ContainerConfigError(
                "CreateContainerConfigError", f"volumeMount {name!r} names no volume of the pod"
            )
        source = volume_paths[name]
        sub = vm.get("subPath")
        if sub:
            if sub.startswith("/") or ".." in sub.split("/"):
                raise ContainerConfigError("CreateContainerConfigError", f"bad subPath {sub!r}")
            source = f"{source.rstrip('/')}/{sub}"
        mounts.append(Mount(source, vm["mountPath"], bool(vm.get("readOnly")) or name in read_only))
    return mounts


def order_mounts(mounts: Sequence[Mount]) -> list[Mount]:
    """Parents before children (by the depth of the mount point; stable otherwise), as container
    runtimes order them: a volume at /tmp mounted after one at /tmp/conf would hide it."""
    return sorted(mounts, key=lambda m: len(PurePosixPath(m.target).parts))


def hidden_by_mounts(mounts: Sequence[Mount], paths: Sequence[str]) -> list[str]:
    """The `paths` that a mount at them or at one of their parents would hide.

    Here the "image" is the host's own filesystem: the project's virtual environment and source
    tree are what a real image would carry, and a volume at /tmp (or /work...) must not hide
    them when the repository lives below it. The launcher binds those paths back on top.
    """
    hidden = []
    for path in paths:
        target = PurePosixPath(path)
        if any(
            target == PurePosixPath(m.target) or PurePosixPath(m.target) in target.parents
            for m in mounts
        ):
            hidden.append(path)
    return hidden


def build_etc_hosts(hostname: str, pod_ip: str) -> str:
    return (
        "# Kubernetes-managed hosts file (lora-devcluster).\n"
        "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
        f"{pod_ip}\t{hostname}\n"
    )


# ---------------------------------------------------------------- restarts, ports


def should_restart(restart_policy: str, exit_code: int) -> bool:
    if restart_policy == "Never":
        return False
    if restart_policy == "OnFailure":
        return exit_code != 0
    return True  # Always (the default)


def restart_backoff(restart_count: int, base: float = 0.5, cap: float = 10.0) -> float:
    """Seconds to wait before restart number `restart_count + 1` (CrashLoopBackOff, scaled down
    from the kubelet's 10 s .. 5 min so tests stay fast)."""
    return float(min(cap, base * (2 ** max(0, restart_count - 1)))) if restart_count else 0.0


def resolve_port(container: Obj, port: int | str) -> int:
    if isinstance(port, int):
        return port
    if port.isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"container {container.get('name')!r} has no port named {port!r}")


# ---------------------------------------------------------------- status


@dataclasses.dataclass(frozen=True)
class ContainerView:
    """What the kubelet knows about one container, for the status builder."""

    name: str
    image: str
    restart_count: int = 0
    running_since: str | None = None  # RFC 3339
    ready: bool = False
    waiting_reason: str | None = None
    waiting_message: str | None = None
    terminated: Obj | None = None  # {"exitCode", "reason", "startedAt", "finishedAt"}
    last_terminated: Obj | None = None
    container_id: str = ""


def _condition(ctype: str, ok: bool, now: str, old: list[Obj], reason: str | None = None) -> Obj:
    status = "True" if ok else "False"
    prev = next((c for c in old if c.get("type") == ctype), None)
    since = prev["lastTransitionTime"] if prev and prev.get("status") == status else now
    cond: Obj = {
        "type": ctype,
        "status": status,
        "lastProbeTime": None,
        "lastTransitionTime": since,
    }
    if reason and not ok:
        cond["reason"] = reason
    return cond


def _container_status(c: ContainerView) -> Obj:
    state: Obj
    if c.running_since is not None:
        state = {"running": {"startedAt": c.running_since}}
    elif c.terminated is not None:
        state = {"terminated": dict(c.terminated)}
    else:
        waiting: Obj = {"reason": c.waiting_reason or "ContainerCreating"}
        if c.waiting_message:
            waiting["message"] = c.waiting_message
        state = {"waiting": waiting}
    status: Obj = {
        "name": c.name,
        "image": c.image,
        "imageID": "",
        "ready": c.ready and c.running_since is not None,
        "started": c.running_since is not None,
        "restartCount": c.restart_count,
        "state": state,
        "lastState": {"terminated": dict(c.last_terminated)} if c.last_terminated else {},
    }
    if c.container_id:
        status["containerID"] = c.container_id
    return status


def build_pod_phase(restart_policy: str, containers: list[ContainerView]) -> str:
    if any(c.running_since is not None for c in containers):
        return "Running"
    if containers and all(c.terminated is not None for c in containers):
        codes = [int(c.terminated["exitCode"]) for c in containers if c.terminated is not None]
        if all(code == 0 for code in codes) and restart_policy != "Always":
            return "Succeeded"
        if restart_policy == "Never" or (restart_policy == "OnFailure" and not any(codes)):
            return "Failed" if any(codes) else "Succeeded"
        return "Running"
    if any(c.restart_count > 0 for c in containers):
        return "Running"
    return "Pending"


def init_restart_policy(pod_restart_policy: str) -> str:
    """Init containers run to completion: retried on failure unless the pod says Never."""
    return "Never" if pod_restart_policy == "Never" else "OnFailure"


def build_pod_status(
    pod: Obj,
    containers: list[ContainerView],
    *,
    pod_ip: str,
    host_ip: str,
    start_time: str,
    now: str,
    init_containers: list[ContainerView] | None = None,
) -> Obj:
    """The status the kubelet patches: phase, IPs, conditions and container statuses. Until
    every init container has exited 0 the pod is Pending and not Initialized (Failed if one
    failed and the pod's restartPolicy is Never)."""
    old = (pod.get("status") or {}).get("conditions") or []
    restart_policy = pod.get("spec", {}).get("restartPolicy", "Always")
    inits = init_containers or []
    initialized = all(c.terminated is not None and c.terminated["exitCode"] == 0 for c in inits)
    init_failed = restart_policy == "Never" and any(
        c.terminated is not None and c.terminated["exitCode"] != 0 for c in inits
    )
    if init_failed:
        phase = "Failed"
    elif not initialized:
        phase = "Pending"
    else:
        phase = build_pod_phase(restart_policy, containers)
    containers_ready = (
        initialized
        and bool(containers)
        and all(c.ready and c.running_since is not None for c in containers)
    )
    reason = None if containers_ready else "ContainersNotReady"
    if phase in ("Succeeded", "Failed"):
        reason = "PodCompleted"
    status = {
        "phase": phase,
        "hostIP": host_ip,
        "hostIPs": [{"ip": host_ip}],
        "podIP": pod_ip,
        "podIPs": [{"ip": pod_ip}],
        "startTime": start_time,
        # Set by the API server from the resources at creation and immutable afterwards.
        "qosClass": (pod.get("status") or {}).get("qosClass", "BestEffort"),
        "conditions": [
            _condition("PodScheduled", True, now, old),
            _condition("Initialized", initialized, now, old, "ContainersNotInitialized"),
            _condition("ContainersReady", containers_ready, now, old, reason),
            _condition("Ready", containers_ready, now, old, reason),
        ],
        "containerStatuses": [_container_status(c) for c in containers],
    }
    if inits:
        status["initContainerStatuses"] = [_container_status(c) for c in inits]
    return status


def status_differs(old: Obj, new: Obj) -> bool:
    """Whether patching `new` would change anything the API server stores (ignoring nothing:
    the builder keeps transition times stable, so equal states compare equal)."""
    return any(old.get(k) != v for k, v in new.items())


# ---------------------------------------------------------------- logs

LOG_RUN_MARKER = "--- lora-devcluster: starting "


def split_log_runs(text: str) -> list[str]:
    """A container's log file holds every run, each after a marker line; split it per run."""
    runs: list[str] = []
    for line in text.splitlines(keepends=True):
        if line.startswith(LOG_RUN_MARKER):
            runs.append("")
            continue
        if not runs:
            runs.append("")
        runs[-1] += line
    return runs


def select_log(text: str, *, previous: bool, tail_lines: int | None) -> str | None:
    """What `kubectl logs [--previous] [--tail N]` shows; None when there is no such run."""
    runs = split_log_runs(text)
    index = -2 if previous else -1
    if len(runs) < (2 if previous else 1):
        return None if previous else ""
    out = runs[index]
    if tail_lines is not None:
        lines = out.splitlines(keepends=True)
        out = "".join(lines[-tail_lines:]) if tail_lines > 0 else ""
    return out
